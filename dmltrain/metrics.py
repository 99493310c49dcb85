"""Sample-weighted metric means that stay on the device until they are read."""

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from dmltrain.errors import UserError

Values = Mapping[str, Tensor | float]


class MetricAccumulator:
    """Accumulates ``value * n`` per metric: tensors on the device, Python numbers on the
    host; ``compute`` syncs once.

    ``update`` only keeps a step's values (no kernel, no host sync: a step costs a list
    append). They are summed into the running totals, one stack and sum per metric, at the
    first step (so a bad value fails there), every ``keep`` steps (which bounds the
    tensors held) and whenever the totals are read or saved. Tensors handed to ``update``
    must not require grad: they are held until then.

    ``compute(reduce=...)`` lets a distributed caller sum the packed totals across ranks
    with one collective before dividing.
    """

    def __init__(self, device: torch.device | str, keep: int = 64) -> None:
        self.device = torch.device(device)
        self.keep = keep
        self._sums: dict[str, Tensor | float] = {}
        self._kept: list[tuple[Values, int]] = []
        self._count = 0

    def update(self, metrics: Values, n: int) -> None:
        self._kept.append((metrics, n))
        self._count += n
        if len(self._kept) >= self.keep or not self._sums:
            self._sum_kept()

    def _sum_kept(self) -> None:
        kept, self._kept = self._kept, []
        columns: dict[str, dict[int, list[Tensor | float]]] = {}  # name -> n -> values
        for metrics, n in kept:
            for name, value in metrics.items():
                columns.setdefault(name, {}).setdefault(n, []).append(value)
        for name, by_count in columns.items():
            total = self._sums.get(name, 0.0)
            for n, values in by_count.items():
                total = total + n * self._sum(name, values)
            self._sums[name] = total

    def _sum(self, name: str, values: list[Tensor | float]) -> Tensor | float:
        tensors = [v for v in values if isinstance(v, Tensor)]
        try:
            number = sum(float(v) for v in values if not isinstance(v, Tensor))
        except (TypeError, ValueError):
            kind = next(type(v).__name__ for v in values if not isinstance(v, Tensor))
            raise UserError(
                f"metric {name!r} is a {kind}: a step's metrics must be numbers or "
                "one-element tensors"
            ) from None
        if not tensors:
            return number
        odd = next((t for t in tensors if t.numel() != 1), None)
        if odd is not None:
            raise UserError(
                f"metric {name!r} is a tensor of shape {tuple(odd.shape)}: a step's metrics "
                "must be single numbers (reduce it, e.g. with .mean())"
            )
        # on the tensors' own device: a CPU metric of a GPU run adds to the total as a
        # scalar, with no copy that would wait for the GPU
        device = tensors[0].device
        stacked = torch.stack([t.reshape(()).to(device, torch.float32) for t in tensors])
        return stacked.sum() + number

    def state_dict(self) -> dict:
        self._sum_kept()
        # copies: the totals go on growing after a checkpoint took them
        sums = {
            k: v.to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in self._sums.items()
        }
        return {"sums": sums, "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        self._sums = {
            k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in state["sums"].items()
        }
        self._kept = []
        self._count = int(state["count"])

    @property
    def count(self) -> int:
        return self._count

    def compute(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        self._sum_kept()
        names = list(self._sums)  # insertion order: the order the step returned them
        values = [torch.as_tensor(self._sums[n], device=self.device).float() for n in names]
        count = torch.tensor(float(self._count), device=self.device)
        packed = torch.stack([*values, count])
        if reduce is not None:
            packed = reduce(packed)
        totals = packed.tolist()
        total = totals[-1]
        return (
            {name: v / total for name, v in zip(names, totals[:-1], strict=True)} if total else {}
        )

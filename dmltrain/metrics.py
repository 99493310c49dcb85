"""Sample-weighted metric means that stay on the device until they are read."""

from collections.abc import Callable, Mapping

import torch
from torch import Tensor


class MetricAccumulator:
    """Accumulates ``value * n`` per metric, tensors on the device (in place: one kernel a
    metric and step, no host sync) and Python numbers on the host; ``compute`` syncs once.

    ``compute(reduce=...)`` lets a distributed caller sum the packed totals across ranks
    with one collective before dividing.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._sums: dict[str, Tensor | float] = {}
        self._count = 0

    def update(self, metrics: Mapping[str, Tensor | float], n: int) -> None:
        sums = self._sums
        for name, value in metrics.items():
            total = sums.get(name)
            if isinstance(value, Tensor):
                value = value.detach()
                if value.ndim:
                    value = value.reshape(())  # a one-element tensor; more is an error
                if isinstance(total, Tensor):
                    total.add_(value, alpha=n)
                    continue
                value = value.to(self.device, torch.float32) * n
                sums[name] = value if total is None else value + total
            else:
                sums[name] = float(value) * n + (0.0 if total is None else total)
        self._count += n

    def state_dict(self) -> dict:
        # copies: the sums go on growing in place after a checkpoint took them
        sums = {
            k: v.to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in self._sums.items()
        }
        return {"sums": sums, "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        self._sums = {
            k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in state["sums"].items()
        }
        self._count = int(state["count"])

    @property
    def count(self) -> int:
        return self._count

    def compute(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
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

"""Sample-weighted metric means that stay on the device until they are read."""

from collections.abc import Callable, Mapping

import torch
from torch import Tensor


class MetricAccumulator:
    """Accumulates ``value * n`` per metric on the device; ``compute`` syncs once.

    ``compute(reduce=...)`` lets a distributed caller sum the packed totals across ranks
    with one collective before dividing.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._sums: dict[str, Tensor] = {}
        self._count = 0

    def update(self, metrics: Mapping[str, Tensor | float], n: int) -> None:
        for name, value in metrics.items():
            value = torch.as_tensor(value, device=self.device).detach().float().reshape(())
            total = self._sums.get(name)
            self._sums[name] = value * n if total is None else total + value * n
        self._count += n

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self._sums.items()}, "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        self._sums = {k: v.to(self.device) for k, v in state["sums"].items()}
        self._count = int(state["count"])

    @property
    def count(self) -> int:
        return self._count

    def compute(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        names = list(self._sums)  # insertion order: the order the step returned them
        count = torch.tensor([float(self._count)], device=self.device)
        packed = torch.cat([torch.stack([self._sums[n] for n in names]), count]) if names else count
        if reduce is not None:
            packed = reduce(packed)
        values = packed.tolist()
        total = values[-1]
        return (
            {name: v / total for name, v in zip(names, values[:-1], strict=True)} if total else {}
        )

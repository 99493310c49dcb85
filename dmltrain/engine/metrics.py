"""Sample-weighted metric means that stay on the device until they are read."""

import math
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any

import torch
from torch import Tensor

from dmltrain.checkpoint.snapshot import snapshot
from dmltrain.data.batches import to_device
from dmltrain.errors import UserError

Values = Mapping[str, Tensor | float]
_TENSORS = {Tensor}
_SECOND = itemgetter(1)  # a kept step's sample count


class MetricAccumulator:
    """Accumulates ``value * n`` per metric: tensors on the device, Python numbers on the
    host; ``compute`` syncs once.

    ``update`` only keeps a step's values (no kernel, no host sync: a step costs a list
    append). They are summed into the running totals, one stack and sum per metric, after
    the first step (so a bad value fails there) and then every ``keep`` steps, which bounds
    the tensors held. Where the groups fall depends on the step count alone, and the kept
    values travel in ``state_dict``: a run resumed mid-epoch adds in the same order, bit
    for bit, as one never interrupted. Tensors handed to ``update`` must not require grad.

    ``compute(reduce=...)`` lets a distributed caller sum the packed totals across ranks
    with one collective before dividing.
    """

    def __init__(self, device: torch.device | str, keep: int = 64) -> None:
        self.device = torch.device(device)
        self.keep = keep
        self._sums: dict[str, Tensor | float] = {}
        self._kept: list[tuple[Values, int]] = []
        self._steps = 0  # summed into ``_sums``; the kept ones come on top
        self._count = 0  # samples summed into ``_sums``
        self._sum_at = 1  # kept steps that are summed: the first step at once, then ``keep``
        self._dropped: Tensor | None = None  # samples of steps the NaN checks dropped

    def update(self, metrics: Values, n: int) -> None:
        # a step's whole cost: the counts are added up when the kept steps are summed
        kept = self._kept
        kept.append((metrics, n))
        if len(kept) >= self._sum_at:
            self._sum_kept()

    def drop(self, dropped: Tensor, n: int) -> None:
        """The ``n`` samples of a step that counts for nothing where ``dropped`` (a device
        flag: the NaN checks' verdict, not read); its values come in as 0."""
        lost = dropped * n
        self._dropped = lost if self._dropped is None else self._dropped + lost

    def _sum_kept(self) -> None:
        kept = self._kept
        self._sums, self._kept = self._totals(), []
        self._steps += len(kept)
        self._count += sum(map(_SECOND, kept))
        self._sum_at = self.keep

    def _totals(self) -> dict[str, Tensor | float]:
        """The running totals with the kept steps added (read only: reading the metrics
        must not move where the groups fall)."""
        totals = dict(self._sums)
        for name, by_count in self._columns().items():
            total = totals.get(name, 0.0)
            for n, values in by_count.items():
                total = total + n * self._sum(name, values)
            totals[name] = total
        return totals

    def _columns(self) -> dict[str, dict[int, list[Tensor | float]]]:
        """The kept values by name, then by the steps' sample count, in step order."""
        if not self._kept:
            return {}
        steps, counts = zip(*self._kept, strict=True)
        names = set(map(tuple, steps))
        if len(names) == 1 and len(set(counts)) == 1:
            # the usual case: every step the same metrics and batch size; map and
            # itemgetter walk the steps in C, not as bytecode per step and metric
            n = counts[0]
            return {name: {n: list(map(itemgetter(name), steps))} for name in next(iter(names))}
        columns: dict[str, dict[int, list[Tensor | float]]] = {}
        for metrics, n in self._kept:
            for name, value in metrics.items():
                columns.setdefault(name, {}).setdefault(n, []).append(value)
        return columns

    def _sum(self, name: str, values: list[Tensor | float]) -> Tensor | float:
        if set(map(type, values)) == _TENSORS:  # the usual case, checked in C
            try:
                stacked = torch.stack(values)  # type: ignore[arg-type]
            except RuntimeError:
                pass  # shapes or devices differ: below, one by one
            else:
                if stacked.numel() == len(values):  # one element each
                    # + 0: the general case adds the numbers' sum, 0 here (a -0.0 total
                    # then becomes 0.0 in both)
                    return stacked.sum(dtype=torch.float32) + 0
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
        try:  # the usual case, one stack: the same shape on one device (a call per
            # tensor, as below, costs microseconds each)
            stacked = torch.stack(tensors)
        except RuntimeError:
            # on the first tensor's device: a CPU metric of a GPU run adds to the total
            # as a scalar, with no copy that would wait for the GPU
            device = tensors[0].device
            stacked = torch.stack([t.reshape(()).to(device) for t in tensors])
        return stacked.sum(dtype=torch.float32) + number

    def state_dict(self) -> dict:
        # copies: the totals go on growing after a checkpoint took them
        sums, kept = snapshot(self._sums), snapshot(self._kept)
        state = {"sums": sums, "kept": kept, "steps": self.steps, "count": self.count}
        if self._dropped is not None:
            state["dropped"] = snapshot(self._dropped)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._sums = to_device(state["sums"], self.device)
        self._kept = to_device(state.get("kept", []), self.device)
        steps = int(state.get("steps", 1))  # older checkpoints kept nothing unsummed
        self._steps = steps - len(self._kept)
        self._count = int(state["count"]) - sum(map(_SECOND, self._kept))
        self._sum_at = self.keep if steps else 1
        dropped = state.get("dropped")
        self._dropped = None if dropped is None else to_device(dropped, self.device)

    @property
    def count(self) -> int:
        """Samples of the steps so far."""
        return self._count + sum(map(_SECOND, self._kept))

    @property
    def steps(self) -> int:
        """Steps so far."""
        return self._steps + len(self._kept)

    def compute(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        return self.compute_with(reduce)[0]

    def compute_with(
        self, reduce: Callable[[Tensor], Tensor] | None = None, rider: Tensor | None = None
    ) -> tuple[dict[str, float], list[float]]:
        """The means, and ``rider`` (a float vector on the device) reduced with them: one
        collective and one read for both."""
        sums = self._totals()
        names = list(sums)  # insertion order: the order the step returned them
        values = [torch.as_tensor(sums[n], device=self.device).float() for n in names]
        count = torch.tensor(float(self.count), device=self.device)
        if self._dropped is not None:
            count = count - self._dropped
        packed = torch.stack([*values, count])
        if rider is not None:
            packed = torch.cat([packed, rider])
        if reduce is not None:
            packed = reduce(packed)
        totals = packed.tolist()
        total, rode = totals[len(names)], totals[len(names) + 1 :]
        means = dict(zip(names, totals[: len(names)], strict=True))
        return ({name: v / total for name, v in means.items()} if total else {}), rode


class WeightedMeans:
    """``val_step``'s ``(value, weight)`` metrics: the sum of value x weight over the sum of
    weight, over every batch and rank (a token-weighted loss: ``{"loss": (mean, tokens)}``).
    Sums in float64 on the device (no host sync a batch); ``compute`` reduces them at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.dtype = torch.float32 if device.type == "mps" else torch.float64  # mps has no f64
        self._sums: dict[str, Tensor] = {}  # name -> [sum of value x weight, sum of weight]

    def update(self, name: str, pair: tuple[Any, ...], method: str) -> None:
        try:
            value, weight = (
                torch.as_tensor(part, dtype=self.dtype, device=self.device).reshape(())
                for part in pair
            )
        except (ValueError, RuntimeError, TypeError):
            raise UserError(
                f"{method} returned {name!r} as a tuple of {len(pair)}: a weighted metric is "
                "(value, weight), two numbers or one-element tensors, e.g. (loss, tokens)"
            ) from None
        pair_sum = torch.stack([value * weight, weight])
        kept = self._sums.get(name)
        self._sums[name] = pair_sum if kept is None else kept + pair_sum

    def __bool__(self) -> bool:
        return bool(self._sums)

    def compute(self, reduce: Callable[[Tensor], Tensor]) -> dict[str, float]:
        names = list(self._sums)
        totals = reduce(torch.stack([self._sums[n] for n in names])).tolist()
        return {n: v / w if w else math.nan for n, (v, w) in zip(names, totals, strict=True)}


def merge_states(states: list[dict | None]) -> dict | None:
    """Several ranks' ``MetricAccumulator.state_dict()`` of a partial epoch as one (for a
    resume at another number of processes: one rank carries the sums on). None where no
    rank has any."""
    found = [state for state in states if state is not None]
    if not found:
        return None
    totals: dict[str, Tensor | float] = {}
    for state in found:
        one = MetricAccumulator("cpu")
        one.load_state_dict(state)
        for name, value in one._totals().items():
            value = value.cpu() if isinstance(value, Tensor) else value
            totals[name] = totals.get(name, 0.0) + value
    steps = max(int(state.get("steps", 1)) for state in found)
    # the samples of steps the NaN checks dropped leave the count here, read once
    count = sum(s["count"] - int(s.get("dropped", 0)) for s in found)
    return {"sums": totals, "kept": [], "steps": steps, "count": count}

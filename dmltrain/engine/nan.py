"""NaN/Inf checks that every rank agrees on: ``--check-nans``, ``--on-nan``.

A check is one finiteness reduction per group of tensors, in fp32: on a GPU the 2-norms of
all of them by one fused ``_foreach_norm`` (NaN or Inf anywhere makes its tensor's norm
non-finite; so do values beyond about 1e19, which overflow the norm and are no better), on
the CPU their sums (the same for NaN and Inf; finite values overflow only beyond about
3e38); then one collective that tells every rank which ranks saw what; only then is there a
host sync.
Every rank therefore takes the same decision in the same step. Naming the offending
parameters is the slow path, taken only after a failure.

Under DDP a gradient that is non-finite on one rank before the all-reduce is non-finite on
every rank after it; the loss check (local to each rank) is what names the rank then.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from dmltrain import compat
from dmltrain.errors import NonFiniteError


def _local(tensor: Tensor) -> Tensor:
    """The part of a (possibly sharded, DTensor) tensor that lives on this rank."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def nonfinite(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """A 0-d bool tensor on ``device``: whether any element of ``tensors`` is NaN or Inf."""
    local = [t for t in (_local(t.detach()) for t in tensors) if t.numel()]
    if not local:
        return torch.zeros((), dtype=torch.bool, device=device)
    if local[0].device.type == "cpu":
        # The CPU runs _foreach_norm tensor by tensor; a plain sum reads the same memory
        # faster, and NaN or Inf anywhere makes it non-finite as well.
        reduced: Sequence[Tensor] = [t.sum(dtype=torch.float32) for t in local]
    else:
        reduced = compat.foreach_norm(local)  # one fused kernel
    return ~torch.isfinite(torch.stack([r.to(device) for r in reduced])).all()


@dataclass
class NanEvent:
    """What went non-finite where: one event is the same on every rank."""

    kind: str  # loss, gradient or parameter
    epoch: int  # 1-based
    step: int  # optimizer step in the epoch, 1-based
    global_step: int
    ranks: list[int]
    parameters: list[str] = field(default_factory=list)  # "name (shape)", first few

    def describe(self) -> str:
        where = f"epoch {self.epoch}, step {self.step} (global step {self.global_step})"
        ranks = ", ".join(map(str, self.ranks))
        text = f"non-finite {self.kind} at {where} on rank {ranks}"
        if self.parameters:
            text += f"; first offending parameters: {', '.join(self.parameters)}"
        return text


class NanChecker:
    """Checks of one model's loss, gradients and parameters, agreed across ranks."""

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        world_size: int,
        device: torch.device,
        all_reduce_sum: Callable[[Tensor], Tensor],
        all_gather_object: Callable[[object], list[object]],
        report: Path,
    ) -> None:
        self.named = list(model.named_parameters())  # the unwrapped model's: plain names
        self.rank, self.world_size, self.device = rank, world_size, device
        self.all_reduce_sum, self.all_gather_object = all_reduce_sum, all_gather_object
        self.report = report

    def flags(self, loss: Tensor | None, gradients: bool, parameters: bool) -> dict[str, Tensor]:
        """Local device flags (no sync) for the parts asked for."""
        out = {}
        if loss is not None:
            out["loss"] = ~torch.isfinite(loss.detach()).all()
        if gradients:
            grads = [p.grad for _, p in self.named if p.grad is not None]
            out["gradient"] = nonfinite(grads, self.device)
        if parameters:
            out["parameter"] = nonfinite((p for _, p in self.named), self.device)
        return out

    def agree(
        self, flags: dict[str, Tensor], epoch: int, step: int, global_step: int
    ) -> NanEvent | None:
        """One collective: the same event (or None) on every rank."""
        kinds = list(flags)
        table = torch.zeros(self.world_size, len(kinds), device=self.device)
        table[self.rank] = torch.stack([flags[k].float() for k in kinds])
        seen = self.all_reduce_sum(table).tolist()  # the host sync of this check
        for column, kind in enumerate(kinds):
            ranks = [r for r in range(self.world_size) if seen[r][column]]
            if ranks:
                event = NanEvent(kind, epoch, step, global_step, ranks)
                if kind != "loss":
                    event.parameters = self._offenders(kind)
                return event
        return None

    def _offenders(self, kind: str, few: int = 5) -> list[str]:
        """The first few non-finite parameters (or gradients) of any rank (collective)."""
        mine = []
        for name, p in self.named:
            tensor = p.grad if kind == "gradient" else p
            if tensor is not None and bool(nonfinite([tensor], self.device)):
                mine.append(f"{name} {tuple(p.shape)}")
                if len(mine) == few:
                    break
        found: list[str] = []
        for names in self.all_gather_object(mine):
            found += [n for n in names if n not in found]  # type: ignore[attr-defined]
        return found[:few]

    def act(
        self,
        event: NanEvent,
        mode: str,
        info: Callable[[str], None],
        newest: Callable[[], Path | None],
    ) -> NanEvent | None:
        """What ``--on-nan`` ``mode`` does with ``event``, the same on every rank: None when
        the step is dropped (skip), the event when the run rolls back; ``raise`` stops
        (``NonFiniteError`` naming ``newest()``, the last good checkpoint)."""
        if mode == "skip" and event.kind == "parameter":
            mode = "rollback"  # the update is applied already: only a checkpoint undoes it
        if mode == "skip":
            self.record(event, "step skipped on every rank", info)
            return None
        if mode == "rollback":
            self.record(event, "rolling back to the last checkpoint", info)
            return event
        line = self.record(event, "stopping", None)  # the exit line says it
        last = newest()
        kept = f"; last good checkpoint: {last}" if last else "; no checkpoint yet"
        raise NonFiniteError(line + kept + f" (report: {self.report})")

    def record(self, event: NanEvent, action: str, info: Callable[[str], None] | None) -> str:
        """Rank 0 appends the event to the report file and prints it (with ``info``)."""
        line = f"NaN check: {event.describe()}; {action}"
        if self.rank == 0:
            if info is not None:
                info(f"dmltrain: {line}")
            with open(self.report, "a") as handle:
                handle.write(line + "\n")
        return line

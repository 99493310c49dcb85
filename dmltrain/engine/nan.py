"""NaN/Inf checks that every rank agrees on, without a host sync a step: ``--check-nans``,
``--on-nan``.

A check is one finiteness reduction per group of tensors, in fp32: on a GPU the 2-norms of
all of them by one fused ``_foreach_norm`` (NaN or Inf anywhere makes its tensor's norm
non-finite; so do values beyond about 1e19, which overflow the norm and are no better), on
the CPU their sums (the same for NaN and Inf; finite values overflow only beyond about
3e38).

The flags stay on the device. A step's loss and gradient flags are summed over the ranks
(one small all-reduce, with more ranks no larger) into ``found``, which the fused optimizers
read as ``torch.amp.GradScaler`` has them do: a non-finite step's update is skipped on the
device, on every rank alike. Each rank also records what it saw (how many steps, the first
step of each kind, the gradients that were not finite). ``settle`` reads those records:
with the metrics at a log interval (the same read), and before every checkpoint; only then
does ``--on-nan`` act, on what every rank read alike. An optimizer that cannot skip on the
device (not fused) reads ``found`` at every step instead, and acts at once.

Under DDP a gradient that is non-finite on one rank before the all-reduce is non-finite on
every rank after it; the loss check (local to each rank) is what names the rank then.
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain import compat
from dmltrain.errors import NonFiniteError
from dmltrain.records.files import append_own

KINDS = ("loss", "gradient", "parameter")  # a record's columns; at one step, the first wins
FEW = 5  # offending parameters named in a report


def _local(tensor: Tensor) -> Tensor:
    """The part of a (possibly sharded, DTensor) tensor that lives on this rank."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def each_nonfinite(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """A bool vector on ``device``: whether each of ``tensors`` holds a NaN or an Inf."""
    with torch.no_grad():  # no graph: a parameter needs no detach() (an operator each)
        local = [_local(t) for t in tensors]
        if not local:
            return torch.zeros(0, dtype=torch.bool, device=device)
        if local[0].device.type == "cpu":
            # The CPU runs _foreach_norm tensor by tensor; a plain sum reads the same
            # memory twice as fast, and NaN or Inf anywhere makes it non-finite as well.
            reduced: Sequence[Tensor] = [t.sum(dtype=torch.float32) for t in local]
        else:
            reduced = compat.foreach_norm(local)  # one fused kernel
        return ~torch.isfinite(torch.stack(list(reduced)).to(device))


def nonfinite(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """A 0-d bool tensor on ``device``: whether any element of ``tensors`` is NaN or Inf."""
    return each_nonfinite(tensors, device).any()


def can_skip_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` skips its update when handed ``found_inf`` (the fused kernels
    of Adam, AdamW, SGD and Adagrad do, on the device), as torch's grad scaler hands it."""
    groups = getattr(optimizer, "param_groups", None) or [{}]
    return all(group.get("fused") for group in groups)


@contextlib.contextmanager
def skipped_if(optimizers: Iterable[Any], found: Tensor) -> Iterator[None]:
    """Around the update: each optimizer skips it on the device where ``found`` is 1 (the
    attributes ``torch.amp.GradScaler.step`` sets on a fused optimizer, for one step)."""
    armed = list(optimizers)
    flag = found.float()
    for optimizer in armed:
        optimizer.grad_scale, optimizer.found_inf = None, flag
    try:
        yield
    finally:
        for optimizer in armed:
            del optimizer.grad_scale, optimizer.found_inf


@dataclass
class NanEvent:
    """What went non-finite where: one event is the same on every rank."""

    kind: str  # loss, gradient or parameter
    epoch: int  # 1-based
    step: int  # optimizer step in the epoch, 1-based
    global_step: int
    ranks: list[int]
    parameters: list[str] = field(default_factory=list)  # "name (shape)", first few
    skipped: int = 1  # steps skipped on the device since the last report
    found_at: int = 0  # the global step whose end read the records (0: the event's own)

    def describe(self) -> str:
        where = f"epoch {self.epoch}, step {self.step} (global step {self.global_step})"
        ranks = ", ".join(map(str, self.ranks))
        text = f"non-finite {self.kind} at {where} on rank {ranks}"
        if self.parameters:
            text += f"; first offending parameters: {', '.join(self.parameters)}"
        if self.found_at > self.global_step:
            text += f"; read at global step {self.found_at}"
        return text


class RollBack(Exception):
    """``--on-nan rollback``: out of the step (or the log interval, or a save) to the loop,
    which reloads the newest checkpoint and skips ``event``'s step."""

    def __init__(self, event: NanEvent) -> None:
        super().__init__(event.describe())
        self.event = event


class NanChecker:
    """Checks of one model's loss, gradients and parameters, recorded on the device and
    settled when the ranks read them together."""

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
        self.waits = False  # True: an optimizer cannot skip on the device (``wait_for``)
        self._none = torch.zeros((), dtype=torch.bool, device=device)  # a part not checked
        self._which: dict[tuple[int, ...], Tensor] = {}  # gradients' indices, by their pattern
        self._reset()

    def _reset(self) -> None:
        """The records since the last settle, each rank's own: steps flagged by kind, the
        first step of each kind, the gradients flagged at the first gradient step, and the
        steps skipped on every rank."""
        device = self.device
        self._seen = torch.zeros(len(KINDS), dtype=torch.int64, device=device)
        self._first = torch.zeros(len(KINDS), dtype=torch.int64, device=device)
        self._bad_grads = torch.zeros(len(self.named), dtype=torch.bool, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    def wait_for(self, optimizers: Sequence[Any], info: Callable[[str], None]) -> None:
        """If an optimizer cannot skip a step on the device, every step reads ``found``
        (one host sync a step): said once, with what avoids it."""
        slow = [type(o).__name__ for o in optimizers if not can_skip_on_device(o)]
        self.waits = bool(slow)
        if slow and self.rank == 0:
            info(
                f"dmltrain: --check-nans: {', '.join(slow)} cannot skip a step on the device, "
                "so each step waits for its check; create it with fused=True to avoid that"
            )

    def flags(
        self,
        step: int,
        loss: Tensor | None = None,
        gradients: bool = False,
        parameters: bool = False,
        only: set[int] | None = None,
    ) -> Tensor:
        """This rank's flags for the parts asked for at global ``step`` (a bool vector by
        ``KINDS``, on the device, no sync), added to its records. ``only``: the ids of the
        parameters whose gradients to check (one optimizer's), else all."""
        device, none = self.device, self._none
        with torch.no_grad():
            loss_bad = none if loss is None else ~torch.isfinite(loss).all()
            grad_bad, param_bad = none, none
            if gradients:
                which = [
                    i
                    for i, (_, p) in enumerate(self.named)
                    if p.grad is not None and (only is None or id(p) in only)
                ]
                each = each_nonfinite([self.named[i][1].grad for i in which], device)  # type: ignore[misc]
                grad_bad = each.any()
                if len(which) != len(self.named):  # some parameters have no gradient
                    each = self._spread(which, each)
                # the gradients of the first flagged step are the ones named
                first = (self._first[1] == 0) & grad_bad
                self._bad_grads = torch.where(first, each, self._bad_grads)
            if parameters:
                param_bad = nonfinite((p for _, p in self.named), device)
            found = torch.stack([loss_bad, grad_bad, param_bad])
            self._seen += found
            self._first = torch.where(self._first > 0, self._first, found * step)
        return found

    def _spread(self, which: list[int], each: Tensor) -> Tensor:
        """``each`` (flags of the parameters ``which``) at their places among all of them."""
        key = tuple(which)
        index = self._which.get(key)
        if index is None:  # made once per pattern: a copy to the GPU each step would wait
            index = self._which[key] = torch.tensor(which, device=self.device)
        full = torch.zeros(len(self.named), dtype=torch.bool, device=self.device)
        return full.index_put_((index,), each)

    def agree(self, found: Tensor) -> Tensor:
        """Whether the step's loss or gradients were not finite on any rank (a 0-d bool on
        the device, the same on every rank: one small all-reduce, no sync). A skipped step
        is counted."""
        either = found[:2].any()
        if self.world_size > 1:
            either = self.all_reduce_sum(either.float()) > 0
        self._skipped += either
        return either

    def pending(self) -> Tensor:
        """What this rank saw since the last settle (steps by kind, float), to be summed over
        the ranks with the metrics and handed to ``settle``."""
        return self._seen.float()

    def settle(
        self,
        mode: str,
        now: int,
        where: Callable[[int], tuple[int, int]],
        info: Callable[[str], None],
        newest: Callable[[], str | None],
        seen: Sequence[float] | None = None,
    ) -> None:
        """Collective: what the ranks saw since the last settle, read and acted on alike.
        ``seen``: ``pending()`` summed over the ranks, read already (with the metrics);
        else one all-reduce and one read here. ``now``: the global step the records are
        read at; ``where`` turns a global step into (epoch, step in it). Skip: reported;
        rollback: ``RollBack``; raise: ``NonFiniteError``."""
        if seen is None:
            seen = self.all_reduce_sum(self.pending()).tolist()
        if not any(seen):
            return
        event = self._event(where)
        event.found_at = now
        self._reset()
        self.act(event, mode, info, newest)

    def _event(self, where: Callable[[int], tuple[int, int]]) -> NanEvent:
        """The first event of the ranks' records (collective, after a failure only)."""
        gathered: list[Any] = self.all_gather_object((self._first.tolist(), int(self._skipped)))
        firsts: list[list[int]] = [first for first, _ in gathered]  # 0: not seen
        skipped = max(skips for _, skips in gathered)  # alike on every rank
        candidates = [(first[k], k) for first in firsts for k in range(len(KINDS)) if first[k]]
        step, column = min(candidates)
        kind = KINDS[column]
        ranks = [r for r, first in enumerate(firsts) if first[column] == step]
        epoch, in_epoch = where(step)
        event = NanEvent(kind, epoch, in_epoch, step, ranks, skipped=skipped)
        if kind == "gradient":
            mine_named = self._names(self._bad_grads.tolist()) if self.rank in ranks else []
            event.parameters = self._gathered(mine_named)
        elif kind == "parameter":
            event.parameters = self._offenders()
        return event

    def _offenders(self) -> list[str]:
        """The first few non-finite parameters of any rank (collective)."""
        flags = each_nonfinite((p for _, p in self.named), self.device).tolist()
        return self._gathered(self._names(flags))

    def _names(self, flags: list[bool]) -> list[str]:
        """ "name (shape)" of the parameters flagged."""
        pairs = zip(flags, self.named, strict=True)
        return [f"{n} {tuple(p.shape)}" for bad, (n, p) in pairs if bad]

    def _gathered(self, mine: list[str]) -> list[str]:
        found: list[str] = []
        for names in self.all_gather_object(mine[:FEW]):
            found += [n for n in names if n not in found]  # type: ignore[attr-defined]
        return found[:FEW]

    def act(
        self,
        event: NanEvent,
        mode: str,
        info: Callable[[str], None],
        newest: Callable[[], str | None],
    ) -> None:
        """What ``--on-nan`` ``mode`` does with ``event``, the same on every rank: skip
        (the step's update was skipped: reported), rollback (``RollBack``), raise
        (``NonFiniteError`` naming ``newest()``, the last good checkpoint)."""
        if mode == "skip" and event.kind == "parameter":
            mode = "rollback"  # the update is applied already: only a checkpoint undoes it
        if mode == "skip":
            more = event.skipped - 1
            also = f" ({more} more since, skipped alike)" if more > 0 else ""
            self.record(event, f"step skipped on every rank{also}", info)
            return
        if mode == "rollback":
            self.record(event, "rolling back to the last checkpoint", info)
            raise RollBack(event)
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
            append_own(self.report, f"{line}\n".encode())
        return line

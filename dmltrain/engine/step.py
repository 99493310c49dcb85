"""One optimizer step: forward and backward of each micro-batch, checks, clipping, update.

This is the loop's own cost over a hand-written one (``benchmarks/overhead.py``), so the
usual step (one micro-batch, no anomaly mode, fp32) enters no context and calls few
Python functions: each costs a microsecond or more between torch's kernels.
"""

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain.data.batches import batch_size_of, split_step_output, to_device
from dmltrain.engine import contract
from dmltrain.engine.nan import NanChecker, skipped_if
from dmltrain.engine.precision import Precision
from dmltrain.engine.state import TrainState
from dmltrain.errors import SharedError, UserError
from dmltrain.runtime.strategies import Strategy

_SEQUENCES = (tuple, list)


@dataclass
class OptimizerStep:
    """The parts a step uses, gathered once in setup; ``run`` takes one step."""

    train_step: Callable[[Any], Any]  # the experiment's: batch -> loss (, metrics)
    on_after_backward: Callable[[], None] | None  # None: the trainer does not override it
    model: nn.Module
    optimizers: tuple[Any, ...]  # each steps on the one loss (create_optimizer)
    schedulers: tuple[Any, ...]  # stepped after every update; () when they step per epoch
    precision: Precision
    strategy: Strategy
    state: TrainState  # its metrics take the step's loss and metrics
    device: torch.device
    grad_clip: float
    detect_anomaly: bool
    nan_checker: NanChecker | None
    settle: Callable[[], None]  # the NaN records read and acted on (--on-nan), collective
    grad_norm: Tensor | None = None  # the last step's, before clipping (with --grad-clip)
    # callbacks' on_before_optimizer_step, bound to the trainer: they see final gradients
    before_update: tuple[Callable[[], None], ...] = ()
    _parts: int = 0  # micro-batches of the step in progress (0: none in progress)

    def __post_init__(self) -> None:
        # Worked out once, so the usual step (fp32, one optimizer, a strategy that leaves
        # the update to the optimizer) calls none of the wrappers it does not need.
        self._moves = self.device.type != "cpu"  # a DataLoader's batches are on the CPU
        self._unscales = bool(self.grad_clip or self.nan_checker is not None or self.before_update)
        hands_off = (
            type(self.strategy).sync_gradients is Strategy.sync_gradients
            and type(self.strategy).optimizer_step is Strategy.optimizer_step
        )
        self._finals = self._unscales or not hands_off  # the loop over optimizers below
        # the one optimizer that steps by itself (its step is looked up at each call: an
        # LR scheduler made later wraps it)
        alone = hands_off and self.precision.plain and len(self.optimizers) == 1
        self._alone = self.optimizers[0] if alone else None
        checks = self._unscales or self.nan_checker is not None or self.detect_anomaly
        if self._alone is not None and not checks:
            self.run = self._run_usual  # type: ignore[method-assign]

    def run(self, micro_batches: Sequence[Any], epoch: int, step: int) -> None:
        """Forward and backward of each micro-batch, checks, clipping, the update (skipped
        on the device when the checks found a NaN: ``dmltrain.engine.nan``)."""
        precision, checker, global_step = self.precision, self.nan_checker, self.state.global_step
        optimizers = self.optimizers
        for optimizer in optimizers:
            optimizer.zero_grad()  # set_to_none is the default
        results = []
        last = len(micro_batches) - 1
        self._parts = last + 1
        try:
            for i, batch in enumerate(micro_batches):
                if self._moves:
                    batch = to_device(batch, self.device)
                if i == last and not self.detect_anomaly:
                    loss, step_metrics = self._forward_backward(batch, last + 1)
                else:
                    with self._micro_batch_context(last=i == last):
                        loss, step_metrics = self._forward_backward(batch, last + 1)
                results.append((loss.detach(), step_metrics, batch_size_of(batch)))
        finally:
            self._parts = 0
        if self.on_after_backward is not None:
            self.on_after_backward()
        if self._finals:
            for optimizer in optimizers:
                self.strategy.sync_gradients(optimizer)
                if self._unscales:
                    precision.unscale(optimizer)
        flags = None
        if checker is not None:
            losses = torch.stack([loss.float() for loss, _, _ in results])
            flags = checker.flags(global_step + 1, losses, gradients=precision.scaler is None)
        found, _ = _update(self, flags, optimizers, self.model.parameters(), self._apply)
        return _after_updates(self, results, found)

    def _apply(self) -> None:
        """The optimizers' updates, through the strategy and the precision."""
        optimizers, precision = self.optimizers, self.precision
        if self._alone is not None:
            self._alone.step()
        elif len(optimizers) == 1:
            self.strategy.optimizer_step(precision.step, optimizers[0])
        else:
            for optimizer in optimizers:
                self.strategy.optimizer_step(precision.apply, optimizer)
            precision.update()

    def _run_usual(self, micro_batches: Sequence[Any], epoch: int, step: int) -> None:
        """``run`` for the usual step (one micro-batch, one optimizer that steps by itself,
        fp32, nothing checked or clipped), in one frame: the same calls in the same order,
        without the branches and calls that only other steps need."""
        try:
            (batch,) = micro_batches
        except ValueError:  # several: gradient accumulation
            return OptimizerStep.run(self, micro_batches, epoch, step)
        if self._moves:
            batch = to_device(batch, self.device)
        optimizer: Any = self._alone
        optimizer.zero_grad()
        self._parts = 1
        try:
            loss = self.train_step(batch)  # or (loss, metrics)
        finally:
            self._parts = 0
        step_metrics = None
        if isinstance(loss, tuple):
            loss, step_metrics = split_step_output(loss)
        try:
            loss.backward()
        except (AttributeError, RuntimeError, TypeError) as exc:
            bad = contract.loss(loss, exc)
            if bad is None:
                raise
            raise bad from None
        # batch_size_of's answer for the usual batch, a tuple or list led by a tensor
        first = batch[0] if type(batch) in _SEQUENCES and batch else None
        n = first.shape[0] if type(first) is Tensor else batch_size_of(batch)
        if self.on_after_backward is not None:
            self.on_after_backward()
        optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        values = {"loss": loss.detach()}
        if step_metrics:
            values.update(step_metrics)
        self.state.metrics.update(values, n)
        return None

    def _forward_backward(
        self, batch: Any, micro_batches: int
    ) -> tuple[Tensor, Mapping[str, Tensor | float]]:
        """``train_step`` under the precision's autocast, then its (scaled) backward."""
        precision = self.precision
        if precision.plain:
            output = self.train_step(batch)
        else:
            output = precision.forward(self.train_step, batch)
        loss, step_metrics = (
            split_step_output(output) if isinstance(output, tuple) else (output, {})
        )
        _backward(loss, micro_batches, precision)
        return loss, step_metrics

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Inside ``train_step``: forward passes that leave the gradients unsynchronised
        (DDP decides at the forward); the step's last one, outside it, syncs them all."""
        if not self._parts:
            raise UserError("self.no_sync() is for train_step; it was called outside")
        return self.strategy.no_sync(self.model)

    def backward_early(self, loss: Tensor) -> None:
        """A part of the step's loss backpropagated inside ``train_step``, before the rest
        it returns: scaled and shared among micro-batches as that is, with no gradient
        sync (the returned loss's backward syncs them all, once)."""
        if not self._parts:
            raise UserError("self.backward_early(loss) is for train_step; it was called outside")
        with self.strategy.no_sync(self.model):
            _backward(loss, self._parts, self.precision)

    def _micro_batch_context(self, last: bool) -> contextlib.ExitStack:
        """Around forward and backward of a micro-batch: no gradient sync before the last
        one of an accumulation; anomaly mode when asked for."""
        stack = contextlib.ExitStack()
        if not last:
            stack.enter_context(self.strategy.no_sync(self.model))
        if self.detect_anomaly:
            stack.enter_context(torch.autograd.detect_anomaly())
        return stack


def _backward(loss: Tensor, parts: int, precision: Precision) -> None:
    """``loss`` shared among ``parts`` micro-batches, backpropagated, scaled by
    ``precision``; a bad loss (not a tensor, no grad: it fails in the division or the
    backward) is one line about it."""
    try:
        share = loss / parts if parts > 1 else loss
        if precision.plain:
            share.backward()
        else:
            precision.backward(share)
    except (AttributeError, RuntimeError, TypeError) as exc:
        bad = contract.loss(loss, exc)
        if bad is None:
            raise
        raise bad from None


def _update(
    step: "OptimizerStep | ManualStep",
    flags: Tensor | None,
    optimizers: Sequence[Any],
    params: Iterable[Tensor],
    apply: Callable[[], None],
) -> tuple[Tensor | None, bool]:
    """The one update sequence, once the gradients are final (averaged, unscaled): the
    ranks agree on the NaN checks' ``flags``, the callbacks see the gradients, ``params``
    are clipped, and ``apply`` updates (skipped on the device where a check failed; the
    fp16 scaler skips by itself). Returns the agreed flag and whether ``apply`` ran."""
    checker, found = step.nan_checker, None
    if checker is not None and flags is not None:
        found = checker.agree(flags)
        if checker.waits and bool(found):  # an optimizer that cannot skip on the device
            step.settle()  # reported (skip), or raised
            return found, False  # no update, as on the device
    for call in step.before_update:
        call()
    if step.grad_clip:  # the norm stays on the device until a log interval reads it
        step.grad_norm = torch.nn.utils.clip_grad_norm_(params, step.grad_clip)
    waits = checker is not None and checker.waits
    skip = None if found is None or waits or step.precision.scaler is not None else found
    with contextlib.nullcontext() if skip is None else skipped_if(optimizers, skip):
        apply()
    return found, True


def _after_updates(
    step: "OptimizerStep | ManualStep", results: list[Any], dropped: Tensor | None
) -> None:
    """After a step's updates: the parameters' NaN flags, the per-step schedulers, and
    the step's losses and metrics into the epoch's sums; none of a ``dropped`` step (a
    device flag: its values count as 0 of 0 samples)."""
    checker = step.nan_checker
    if checker is not None:
        checker.flags(step.state.global_step + 1, parameters=True)  # settled later
    for scheduler in step.schedulers:
        scheduler.step()
    metrics = step.state.metrics
    for loss, step_metrics, n in results:
        values = {"loss": loss, **step_metrics}
        if dropped is not None:
            values = {k: torch.where(dropped, 0.0, v) for k, v in values.items()}
            metrics.drop(dropped, n)
        metrics.update(values, n)


@dataclass
class ManualStep:
    """A step whose ``train_step`` makes its own updates (``manual_optimization``) through
    ``backward`` and ``optimizer_step``, with what the automatic step gives: autocast and
    one fp16 scaler for every optimizer, gradient accumulation (updates at the last
    micro-batch, no gradient sync before it), gradients averaged over the ranks for each
    optimizer's parameters whichever modules the step called, NaN agreement, clipping."""

    train_step: Callable[[Any], Any]  # the experiment's: batch -> loss (, metrics) to log
    model: nn.Module
    optimizers: tuple[Any, ...]
    schedulers: tuple[Any, ...]  # stepped after every step; () when they step per epoch
    precision: Precision
    strategy: Strategy
    state: TrainState
    device: torch.device
    grad_clip: float
    detect_anomaly: bool
    nan_checker: NanChecker | None
    settle: Callable[[], None]
    before_update: tuple[Callable[[], None], ...] = ()
    grad_norm: Tensor | None = None  # the last update's, before clipping (with --grad-clip)
    _micro_batches: int = 0  # of the step in progress (0: no step in progress)
    _last: bool = False  # whether the micro-batch in progress is its last
    # each optimizer's own parameters (by id(optimizer)), and their ids, found once
    _own: dict[int, tuple[list[Tensor], set[int]]] = field(default_factory=dict)
    # the first step's calls of backward and optimizer_step (None: checked, after it)
    _calls: list[int] | None = field(default_factory=lambda: [0, 0])

    def __post_init__(self) -> None:
        for optimizer in self.optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._own[id(optimizer)] = (params, {id(p) for p in params})

    def run(self, micro_batches: Sequence[Any], epoch: int, step: int) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        self._micro_batches = len(micro_batches)
        results = []
        try:
            for i, batch in enumerate(micro_batches):
                self._last = i == len(micro_batches) - 1
                batch = to_device(batch, self.device)
                with contextlib.ExitStack() as stack:
                    if self.detect_anomaly:
                        stack.enter_context(torch.autograd.detect_anomaly())
                    output = self.precision.forward(self.train_step, batch)
                loss, step_metrics = split_step_output(output)
                results.append((loss.detach(), step_metrics, batch_size_of(batch)))
        finally:
            self._micro_batches = 0
        if self._calls is not None:
            self._check_first_step(self._calls)
        self.precision.update()
        dropped = None
        checker = self.nan_checker
        if checker is not None:  # a loss that is not finite counts for nothing (this rank's)
            losses = torch.stack([loss.float() for loss, _, _ in results])
            dropped = checker.flags(self.state.global_step + 1, losses)[0]
        _after_updates(self, results, dropped)

    def _check_first_step(self, calls: list[int]) -> None:
        """A first step that updated nothing through ``optimizer_step``, or without
        ``backward``: the run would end 'done' with its weights as they were, or its ranks
        would train apart (a direct ``opt.step()`` averages no gradients)."""
        self._calls = None
        backwards, updates = calls  # alike on every rank: rank 0 says it for all
        if not updates:
            raise SharedError(
                "train_step (manual_optimization) made no update through "
                "self.optimizer_step(optimizer) in its first step: call self.backward(loss) "
                "and self.optimizer_step(optimizer); a direct loss.backward() and "
                "optimizer.step() skip the gradients' averaging over the ranks, scaling and checks"
            )
        if not backwards:
            raise SharedError(
                "train_step (manual_optimization) called self.optimizer_step without "
                "self.backward(loss) in its first step: call self.backward(loss), not "
                "loss.backward() (it scales the loss and accumulates as the step needs)"
            )

    def backward(self, loss: Tensor, optimizer: Any = None) -> None:
        """``loss``'s gradients, scaled (fp16) and divided among the micro-batches of an
        accumulation; no gradient sync before its last micro-batch. With ``optimizer``,
        only its parameters keep what this adds (the generator's loss leaves the
        discriminator's gradients as they were)."""
        n = self._check("backward")
        if self._calls is not None:
            self._calls[0] += 1
        kept = None
        if optimizer is not None:
            kept = [
                (p, None if p.grad is None else p.grad.clone()) for p in self._others(optimizer)
            ]
        with contextlib.nullcontext() if self._last else self.strategy.no_sync(self.model):
            _backward(loss, n, self.precision)
        for param, grad in kept or ():
            param.grad = grad

    def _others(self, optimizer: Any) -> list[Tensor]:
        """The model's parameters that ``optimizer`` does not update."""
        own = self._owned(optimizer)[1]
        return [p for p in self.model.parameters() if id(p) not in own]

    def _owned(self, optimizer: Any) -> tuple[list[Tensor], set[int]]:
        """``optimizer``'s parameters and their ids; one not from create_optimizer is refused."""
        owned = self._own.get(id(optimizer))
        if owned is None:
            raise UserError(
                "that optimizer is not one create_optimizer returned; use self.optimizers[i]"
            )
        return owned

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Tensor] | None = None) -> Any:
        """``optimizer``'s update, at the last micro-batch of an accumulation (before it:
        nothing): its gradients averaged over the ranks, unscaled, checked, clipped. With
        ``closure`` (LBFGS), ``optimizer.step`` calls it as often as it needs (``closed``),
        and what it returns (LBFGS: the first loss) is returned."""
        self._check("optimizer_step")
        if self._calls is not None:
            self._calls[1] += 1
        if closure is not None:
            return self._closed(optimizer, closure)
        if not self._last:
            return None
        params = self._owned(optimizer)[0]
        self.strategy.average_gradients([p for p in params if p.grad is not None])
        checker = self.nan_checker
        if self.grad_clip or checker is not None or self.before_update:
            self.precision.unscale(optimizer)
        flags = None
        if checker is not None and self.precision.scaler is None:  # else the scaler's
            step = self.state.global_step + 1
            flags = checker.flags(step, gradients=True, only=self._owned(optimizer)[1])
        _, applied = _update(
            self, flags, [optimizer], params, partial(self.precision.apply, optimizer)
        )
        if applied:  # a later loss of the step may reach these parameters again
            optimizer.zero_grad()

    def _closed(self, optimizer: Any, closure: Callable[[], Tensor]) -> Any:
        """``optimizer.step`` with a closure (LBFGS: several forwards a step). Each call of
        ``closure`` (zero_grad, forward, ``self.backward(loss)``, return loss) is followed
        by the gradients' average over the ranks, the callbacks' look and clipping; the
        optimizer is given the loss averaged over the ranks, so every rank decides alike."""
        why = None
        if self._micro_batches > 1:
            why = "a step of --grad-accum micro-batches (give --grad-accum 1)"
        elif self.precision.scaler is not None:
            why = "fp16's loss scaling (give --precision bf16 or fp32)"
        elif self.nan_checker is not None:
            why = "--check-nans, which checks a step's gradients once (drop it)"
        if why is not None:
            raise UserError(f"self.optimizer_step(optimizer, closure) does not work with {why}")
        params = self._owned(optimizer)[0]
        world = self.strategy.info.world_size

        def evaluated() -> Tensor:
            loss = closure()
            self.strategy.average_gradients([p for p in params if p.grad is not None])
            for call in self.before_update:
                call()
            if self.grad_clip:
                self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            if world == 1:
                return loss
            return self.strategy.all_reduce_sum(loss.detach().reshape(1))[0] / world

        result = optimizer.step(evaluated)
        optimizer.zero_grad()
        return result

    def _check(self, what: str) -> int:
        if not self._micro_batches:
            raise UserError(
                f"self.{what}() is for train_step with manual_optimization = True; it was "
                "called outside a training step"
            )
        return self._micro_batches


def check_first_forward(step: OptimizerStep, wrapper: nn.Module | None) -> None:
    """Under DDP the gradients are averaged by hooks that the wrapper's forward sets up: a
    ``train_step`` that calls a submodule of it directly would train each rank apart,
    silently. The first step checks that the wrapper ran; later steps run unwatched."""
    if wrapper is None:
        return
    plain = step.train_step

    def first(batch: Any) -> Any:
        called: list[bool] = []
        handle = wrapper.register_forward_pre_hook(lambda *_: called.append(True))
        try:
            output = plain(batch)
        finally:
            handle.remove()
        if not called:
            raise UserError(
                "train_step did not call self.model: under DDP only its forward keeps the "
                "ranks' gradients averaged; call self.model(...), or set "
                "manual_optimization = True to call parts of the model on their own"
            )
        step.train_step = plain
        return output

    step.train_step = first

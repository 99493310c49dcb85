"""One optimizer step: forward and backward of each micro-batch, checks, clipping, update.

This is the loop's own cost over a hand-written one (``benchmarks/overhead.py``), so the
usual step (one micro-batch, no anomaly mode, fp32) enters no context and calls few
Python functions: each costs a microsecond or more between torch's kernels.
"""

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain import contract
from dmltrain.batches import batch_size_of, split_step_output, to_device
from dmltrain.distributed import Strategy
from dmltrain.nan import NanChecker, NanEvent
from dmltrain.precision import Precision
from dmltrain.state import TrainState


@dataclass
class OptimizerStep:
    """The parts a step uses, gathered once in setup; ``run`` takes one step."""

    train_step: Callable[[Any], Any]  # the experiment's: batch -> loss (, metrics)
    on_after_backward: Callable[[], None]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # stepped after every update; None when it steps per epoch
    precision: Precision
    strategy: Strategy
    state: TrainState  # its metrics take the step's loss and metrics
    device: torch.device
    grad_clip: float
    detect_anomaly: bool
    nan_checker: NanChecker | None
    on_nan: Callable[[NanEvent], NanEvent | None]  # the --on-nan action
    grad_norm: Tensor | None = None  # the last step's, before clipping (with --grad-clip)
    # callbacks' on_before_optimizer_step, bound to the trainer: they see final gradients
    before_update: tuple[Callable[[], None], ...] = ()

    def run(self, micro_batches: list[Any], epoch: int, step: int) -> NanEvent | None:
        """Forward and backward of each micro-batch, checks, clipping, the update. Returns
        the non-finite step to roll back from (``--on-nan rollback``), else None."""
        precision, checker, global_step = self.precision, self.nan_checker, self.state.global_step
        self.optimizer.zero_grad()  # set_to_none is the default
        results = []
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            batch = to_device(batch, self.device)
            if i == last and not self.detect_anomaly:
                loss, step_metrics = self._forward_backward(batch, last + 1)
            else:
                with self._micro_batch_context(last=i == last):
                    loss, step_metrics = self._forward_backward(batch, last + 1)
            results.append((loss.detach(), step_metrics, batch_size_of(batch)))
        self.on_after_backward()
        self.strategy.sync_gradients(self.optimizer)
        if self.grad_clip or checker is not None or self.before_update:
            precision.unscale(self.optimizer)
        if checker is not None:
            losses = torch.stack([loss.float() for loss, _, _ in results])
            flags = checker.flags(losses, gradients=precision.scaler is None, parameters=False)
            event = checker.agree(flags, epoch, step, global_step + 1)
            if event is not None:
                return self.on_nan(event)  # the step is dropped on every rank
        for call in self.before_update:
            call()
        if self.grad_clip:  # the norm stays on the device until a log interval reads it
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.strategy.optimizer_step(precision.step, self.optimizer)
        if checker is not None:
            flags = checker.flags(None, gradients=False, parameters=True)
            event = checker.agree(flags, epoch, step, global_step + 1)
            if event is not None:
                return self.on_nan(event)  # an update cannot be dropped: raise or roll back
        if self.scheduler is not None:
            self.scheduler.step()
        metrics = self.state.metrics
        for loss, step_metrics, n in results:
            metrics.update({"loss": loss, **step_metrics}, n)
        return None

    def _forward_backward(
        self, batch: Any, micro_batches: int
    ) -> tuple[Tensor, Mapping[str, Tensor | float]]:
        """``train_step`` under the precision's autocast, then its (scaled) backward."""
        precision = self.precision
        loss, step_metrics = split_step_output(precision.forward(self.train_step, batch))
        try:
            precision.backward(loss / micro_batches if micro_batches > 1 else loss)
        except (AttributeError, RuntimeError, TypeError) as exc:
            bad = contract.loss(loss, exc)
            if bad is None:
                raise
            raise bad from None
        return loss, step_metrics

    def _micro_batch_context(self, last: bool) -> contextlib.ExitStack:
        """Around forward and backward of a micro-batch: no gradient sync before the last
        one of an accumulation; anomaly mode when asked for."""
        stack = contextlib.ExitStack()
        if not last:
            stack.enter_context(self.strategy.no_sync(self.model))
        if self.detect_anomaly:
            stack.enter_context(torch.autograd.detect_anomaly())
        return stack

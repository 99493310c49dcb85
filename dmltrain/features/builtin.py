"""The built-in optional features as callbacks of the loop: EMA, the profiler, the hang
watchdog, the step's own scalars, steps.csv and the trackers. Each is made from its settings
only when it is on, so a feature that is off is not registered and costs nothing.

They are ``Callback`` s like the experiment's, on the same events (``dmltrain.callback``),
the advanced ones included: ``scalars`` (values of a log interval), ``validation`` (extra
columns of a validation), ``around_long_work``, ``explain`` and ``on_stop``.

Run order is part of the bitwise promise: ``assembly.assemble`` registers them before the
experiment's callbacks, EMA first (its update reads the weights the step made, before
anything else at the step's end).
"""

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from dmltrain.callback import Callback, TrainerView
from dmltrain.errors import PeerLost
from dmltrain.features.ema import EMA
from dmltrain.features.profiling import Profiler
from dmltrain.features.tracking import Tracker
from dmltrain.features.watchdog import Watchdog
from dmltrain.records.training_log import StepsLog


class EmaFeature(Callback):
    """``--ema-decay``: the averaged weights, updated after every step (a step rolled back
    by ``--on-nan rollback`` is not one) and validated beside the model's."""

    def __init__(self, ema: EMA, validated: bool, state: Any) -> None:
        # state: the run's engine.state.TrainState (its counters and rolled-back steps)
        self.ema, self.validated, self.state = ema, validated, state

    def on_step_end(self, trainer: TrainerView) -> None:
        s = self.state
        if not s.skip_steps or (s.epoch + 1, s.step_in_epoch) not in s.skip_steps:
            self.ema.update(s.global_step)

    def validation(
        self, trainer: TrainerView, validate: Callable[[], dict[str, float]]
    ) -> Mapping[str, float]:
        if not self.validated:
            return {}
        with self.ema.swapped_in():
            return {f"ema_{k}": v for k, v in validate().items()}


class ProfilerFeature(Callback):
    """``--profile-steps``, ``--memory-snapshot``: this rank's profile window."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler

    def on_train_start(self, trainer: TrainerView) -> None:
        self.profiler.at(trainer.global_step)

    def on_step_end(self, trainer: TrainerView) -> None:
        self.profiler.at(trainer.global_step)

    def on_stop(self) -> None:
        self.profiler.close()


class WatchdogFeature(Callback):
    """``--hang-watchdog``: a rank whose step does not end is named, with its stack."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_train_start(self, trainer: TrainerView) -> None:
        self.watchdog.start()

    def around_long_work(self) -> contextlib.AbstractContextManager[Any]:
        return self.watchdog.paused()

    def explain(self, lost: PeerLost) -> PeerLost:
        return self.watchdog.explain(lost)

    def on_stop(self) -> None:
        self.watchdog.stop()


class StepScalars(Callback):
    """The step's own values at each log interval: the learning rate, the gradient norm
    (``--grad-clip``) and the fp16 loss scale with the steps it skipped."""

    def __init__(self, precision: Any, grad_norm: Callable[[], Any]) -> None:
        # precision: the run's engine.precision.Precision (the fp16 scale, steps skipped)
        self.precision, self.grad_norm = precision, grad_norm

    def scalars(self, trainer: TrainerView) -> Mapping[str, Any]:
        values: dict[str, Any] = {"lr": trainer.optimizer.param_groups[0]["lr"]}
        norm = self.grad_norm()
        if norm is not None:
            values["grad_norm"] = norm
        if self.precision.scale is not None:
            values["grad_scale"] = self.precision.scale
            values["skipped_steps"] = self.precision.skipped
        return values


class StepsLogFeature(Callback):
    """steps.csv (rank 0): the scalars of each log interval."""

    def __init__(self, log: StepsLog) -> None:
        self.log = log

    def on_log(self, trainer: TrainerView, values: Mapping[str, float]) -> None:
        self.log.write({"step": trainer.global_step, "epoch": trainer.epoch + 1, **values})

    def on_log_metrics(self, trainer: TrainerView, values: Mapping[str, float], step: int) -> None:
        self.log.add(step, trainer.epoch + 1, dict(values))  # in the row of its step

    def on_stop(self) -> None:
        self.log.write()  # what log_metrics gave after the last log interval


class TrackerFeature(Callback):
    """The trackers (rank 0): the scalars of each log interval, under ``train/``."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def on_log(self, trainer: TrainerView, values: Mapping[str, float]) -> None:
        self.tracker.log({f"train/{k}": v for k, v in values.items()}, trainer.global_step)

    def on_log_metrics(self, trainer: TrainerView, values: Mapping[str, float], step: int) -> None:
        self.tracker.log(dict(values), step)

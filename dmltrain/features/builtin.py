"""The built-in optional features as callbacks of the loop: EMA, the profiler, the hang
watchdog and steps.csv. Each is made from its settings only when it is on, so a feature
that is off is not registered and costs nothing.

They listen to the public events (``dmltrain.callback``) and to four of the engine's
own, which ``Feature`` adds: ``validation`` (extra columns of a validation), ``quiet``
(around validation and checkpoint writes), ``explain`` (a lost peer) and ``stop`` (when
the run's processes end, before the process group goes).

Run order is part of the bitwise promise: ``assembly.assemble`` registers them before
the experiment's callbacks, EMA first (its update reads the weights the step made, before
anything else at the step's end).
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from dmltrain.callback import Callback
from dmltrain.engine.state import TrainState
from dmltrain.errors import PeerLost
from dmltrain.features.ema import EMA
from dmltrain.features.profiling import Profiler
from dmltrain.features.watchdog import Watchdog
from dmltrain.records.training_log import StepsLog


class Feature(Callback):
    """A built-in feature: the public events, and the engine's points below."""

    def validation(self, validate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """More columns for a validation's row (``validate`` runs it again)."""
        return {}

    def quiet(self) -> contextlib.AbstractContextManager[Any]:
        """Around work that is not a step (validation, checkpoint writes)."""
        return contextlib.nullcontext()

    def explain(self, lost: PeerLost) -> PeerLost:
        """A lost peer, said better where this feature knows more."""
        return lost

    def stop(self) -> None:
        """The run's processes are ending (success or not): let go of threads and files."""


class EmaFeature(Feature):
    """``--ema-decay``: the averaged weights, updated after every step (a step rolled back
    by ``--on-nan rollback`` is not one) and validated beside the model's."""

    def __init__(self, ema: EMA, validated: bool, state: TrainState) -> None:
        self.ema, self.validated, self.state = ema, validated, state

    def on_step_end(self, trainer: Any) -> None:
        s = self.state
        if not s.skip_steps or (s.epoch + 1, s.step_in_epoch) not in s.skip_steps:
            self.ema.update(s.global_step)

    def validation(self, validate: Callable[[], dict[str, float]]) -> dict[str, float]:
        if not self.validated:
            return {}
        with self.ema.swapped_in():
            return {f"ema_{k}": v for k, v in validate().items()}


class ProfilerFeature(Feature):
    """``--profile-steps``, ``--memory-snapshot``: this rank's profile window."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler

    def on_train_start(self, trainer: Any) -> None:
        self.profiler.at(trainer.global_step)

    def on_step_end(self, trainer: Any) -> None:
        self.profiler.at(trainer.global_step)

    def stop(self) -> None:
        self.profiler.close()


class WatchdogFeature(Feature):
    """``--hang-watchdog``: a rank whose step does not end is named, with its stack."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_train_start(self, trainer: Any) -> None:
        self.watchdog.start()

    def quiet(self) -> contextlib.AbstractContextManager[Any]:
        return self.watchdog.paused()

    def explain(self, lost: PeerLost) -> PeerLost:
        return self.watchdog.explain(lost)

    def stop(self) -> None:
        self.watchdog.stop()


class StepsLogFeature(Feature):
    """steps.csv (rank 0): the scalars of each log interval."""

    def __init__(self, log: StepsLog) -> None:
        self.log = log

    def on_log(self, trainer: Any, values: Any) -> None:
        self.log.write({"step": trainer.global_step, "epoch": trainer.epoch + 1, **values})

    def stop(self) -> None:
        self.log.write()  # what log_metrics gave after the last log interval


class Features:
    """The built-in features of a run, in run order, and the engine's points over them."""

    def __init__(self, features: Iterable[Feature] = ()) -> None:
        self.all = tuple(features)
        base = Feature
        own = {
            name: tuple(f for f in self.all if getattr(type(f), name) is not getattr(base, name))
            for name in ("validation", "quiet", "explain", "stop")
        }
        self._validation, self._quiet = own["validation"], own["quiet"]
        self._explain, self._stop = own["explain"], own["stop"]

    def validation(self, validate: Callable[[], dict[str, float]]) -> dict[str, float]:
        extra: dict[str, float] = {}
        for feature in self._validation:
            extra.update(feature.validation(validate))
        return extra

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for feature in self._quiet:
                stack.enter_context(feature.quiet())
            yield

    def explain(self, lost: PeerLost) -> PeerLost:
        for feature in self._explain:
            lost = feature.explain(lost)
        return lost

    def stop(self) -> None:
        for feature in self._stop:
            feature.stop()

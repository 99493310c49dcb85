"""The built-in features as callbacks (dmltrain/features/builtin.py): a feature that is off is
not registered; those on run before the experiment's callbacks, EMA first; the advanced
events (around_long_work, explain, validation, scalars, on_stop) reach every callback."""

import contextlib

import torch

from dmltrain import TrainConfig
from dmltrain.callback import Callback, Events
from dmltrain.engine.assembly import assemble
from dmltrain.engine.run import Run
from dmltrain.engine.state import TrainState
from dmltrain.errors import PeerLost
from dmltrain.features.builtin import EmaFeature
from dmltrain.features.ema import EMA
from dmltrain.runtime.preemption import PreemptionWatcher
from tiny import TinyOptions, TinyTrainer
from tiny_listeners import EveryEvent


class Listening(TinyTrainer):
    def create_callbacks(self):
        return [EveryEvent()]


def set_up(tmp_path, **config):
    trainer = Listening(TrainConfig(run_dir=str(tmp_path / "run"), epochs=1, **config),
                        TinyOptions())  # fmt: skip
    run = Run(trainer)
    run.watcher = PreemptionWatcher([])  # fit's signal watcher, of no signal here
    assemble(run)
    return run


def owners_of(run):
    return [type(c).__name__ for c in run.events.callbacks]


def owners(listeners):
    return [type(call.__self__).__name__ for call in listeners]


def test_features_that_are_off_are_not_registered(tmp_path):
    run = set_up(tmp_path, hang_watchdog=False, monitor=False)
    try:
        assert owners_of(run) == ["StepScalars", "StepsLogFeature", "EveryEvent"]
        assert owners(run.events.on_step_end) == ["EveryEvent"]
    finally:
        run.events.on_stop()
        run.run_dir_held.release()


def test_features_run_before_the_callbacks_and_ema_first(tmp_path):
    run = set_up(tmp_path, ema_decay=0.9, profile_steps="2:3")
    try:
        assert owners_of(run) == ["EmaFeature", "ProfilerFeature", "WatchdogFeature",
                                  "StepScalars", "StepsLogFeature", "EveryEvent"]  # fmt: skip
        assert owners(run.events.on_step_end) == ["EmaFeature", "ProfilerFeature",
                                                       "EveryEvent"]  # fmt: skip
        assert owners(run.events.on_log) == ["StepsLogFeature", "EveryEvent"]
    finally:
        run.events.on_stop()
        run.run_dir_held.release()


def test_ema_skips_a_step_dropped_by_a_rollback():
    model = torch.nn.Linear(2, 1)
    ema = EMA(model, decay=0.5, warmup_steps=0, every_steps=1)
    state = TrainState(torch.device("cpu"))
    feature = EmaFeature(ema, validated=False, state=state)

    with torch.no_grad():
        model.weight.add_(1.0)
    state.global_step, state.step_in_epoch, state.skip_steps = 3, 3, {(1, 3)}
    feature.on_step_end(None)  # the dropped step (epoch 1, step 3): no update
    assert not torch.equal(ema.state_dict()["weight"], model.weight)
    state.skip_steps = set()
    before = ema.state_dict()["weight"].clone()
    feature.on_step_end(None)
    assert torch.allclose(ema.state_dict()["weight"], (before + model.weight) / 2)


def test_the_advanced_events_reach_every_callback_that_has_them(tmp_path):
    seen = []

    class Quiet(Callback):
        def __init__(self, name):
            self.name = name

        @contextlib.contextmanager
        def around_long_work(self):
            seen.append(f"{self.name} in")
            yield
            seen.append(f"{self.name} out")

        def explain(self, lost):
            return PeerLost(f"{lost} ({self.name})")

        def validation(self, trainer, validate):
            return {f"{self.name}_{k}": v for k, v in validate().items()}

        def scalars(self, trainer):
            return {f"{self.name}_n": torch.tensor(2.0)}

        def on_stop(self):
            seen.append(f"{self.name} stopped")

    events = Events([Quiet("a"), Callback(), Quiet("b")])
    with events.around_long_work():
        seen.append("work")
    assert seen == ["a in", "b in", "work", "b out", "a out"]
    assert str(events.explain(PeerLost("lost rank 1"))) == "lost rank 1 (a) (b)"
    assert events.validation(None, lambda: {"loss": 1.0}) == {"a_loss": 1.0, "b_loss": 1.0}
    assert events.scalars(None) == {"a_n": 2.0, "b_n": 2.0}
    events.on_stop()
    assert seen[-2:] == ["a stopped", "b stopped"]
    nothing = Events()
    with nothing.around_long_work():
        pass
    assert nothing.validation(None, lambda: {"loss": 1.0}) == {} and nothing.scalars(None) == {}

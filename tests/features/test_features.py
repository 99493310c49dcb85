"""The built-in features as callbacks (dmltrain/features/builtin.py): a feature that is off is
not registered; those on run before the experiment's callbacks, EMA first; the engine's
points (quiet, explain, validation, stop) reach every feature that has them."""

import contextlib

import torch

from dmltrain import TrainConfig
from dmltrain.engine.assembly import assemble
from dmltrain.engine.run import Run
from dmltrain.engine.state import TrainState
from dmltrain.errors import PeerLost
from dmltrain.features.builtin import (
    EmaFeature,
    Feature,
    Features,
)
from dmltrain.features.ema import EMA
from dmltrain.runtime.preemption import PreemptionWatcher
from tiny import EveryEvent, TinyOptions, TinyTrainer


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


def owners(listeners):
    return [type(call.__self__).__name__ for call in listeners]


def test_features_that_are_off_are_not_registered(tmp_path):
    run = set_up(tmp_path, hang_watchdog=False, monitor=False)
    try:
        assert [type(f).__name__ for f in run.features.all] == ["StepsLogFeature"]
        assert owners(run.events.on_step_end) == ["EveryEvent"]
    finally:
        run.features.stop()
        run.run_dir_held.release()


def test_features_run_before_the_callbacks_and_ema_first(tmp_path):
    run = set_up(tmp_path, ema_decay=0.9, profile_steps="2:3")
    try:
        names = [type(f).__name__ for f in run.features.all]
        assert names == ["EmaFeature", "ProfilerFeature", "WatchdogFeature", "StepsLogFeature"]
        assert owners(run.events.on_step_end) == ["EmaFeature", "ProfilerFeature",
                                                       "EveryEvent"]  # fmt: skip
        assert owners(run.events.on_log) == ["StepsLogFeature", "EveryEvent"]
    finally:
        run.features.stop()
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


def test_the_engine_points_reach_every_feature_that_has_them(tmp_path):
    seen = []

    class Quiet(Feature):
        def __init__(self, name):
            self.name = name

        @contextlib.contextmanager
        def quiet(self):
            seen.append(f"{self.name} in")
            yield
            seen.append(f"{self.name} out")

        def explain(self, lost):
            return PeerLost(f"{lost} ({self.name})")

        def validation(self, validate):
            return {f"{self.name}_{k}": v for k, v in validate().items()}

        def stop(self):
            seen.append(f"{self.name} stopped")

    features = Features([Quiet("a"), Feature(), Quiet("b")])
    with features.quiet():
        seen.append("work")
    assert seen == ["a in", "b in", "work", "b out", "a out"]
    assert str(features.explain(PeerLost("lost rank 1"))) == "lost rank 1 (a) (b)"
    assert features.validation(lambda: {"loss": 1.0}) == {"a_loss": 1.0, "b_loss": 1.0}
    features.stop()
    assert seen[-2:] == ["a stopped", "b stopped"]
    nothing = Features()
    with nothing.quiet():
        pass
    assert nothing.validation(lambda: {"loss": 1.0}) == {}

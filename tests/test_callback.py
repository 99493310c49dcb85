"""Callbacks and the state they keep (dmltrain/callback.py), in real runs of tiny
(tests/tiny.py) on 2 processes: a user's callback logs each layer's gradient norm every 2
steps with a counter in its state, through a preemption; a callback on every event
changes no bit of the run; installed callbacks are named by entry point."""

import json

import pytest
import torch
from helpers import AT_ONCE, RANDOM, TINY, assert_same_run, run_cli, tensorboard_scalars

from dmltrain.callback import Callback, Events, states
from dmltrain.checkpoint.checkpointer import _check_loadable
from dmltrain.checkpoint.storage import load_file
from dmltrain.errors import UserError

ARGS = [*TINY, *RANDOM, "--nprocs", "2"]  # 3 epochs of 6 steps


def train(run, *args, code=0):
    done = run_cli(*ARGS, "--run-dir", str(run), *args, cwd=run.parent)
    assert done.returncode == code, done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    train(run)
    return run


def test_a_user_callback_logs_keeps_its_counter_through_a_preemption(tmp_path, reference):
    run = tmp_path / "run"
    logged = ["--grad-norms-every", "2", "--tracker", "", "--tensorboard", "--listen-all"]
    train(run, *logged, "--signal-rank", "1", "--signal-at-step", "8", *AT_ONCE, code=3)
    latest = load_file(run / "checkpoints" / "latest.pt")
    assert latest["states"] == {"GradNorms": {"logged": 4}}
    stopped_at = latest["global_step"]  # the agreed boundary after the signal
    train(run, *logged)
    assert_same_run(reference, run)  # the callbacks changed nothing
    for rank in (0, 1):  # the resumed job loaded that checkpoint, and told its callbacks
        seen = json.loads((run / f"events.{rank}.json").read_text())
        assert seen["loaded"] == [[f"ckpt-000002-{stopped_at:08d}.pt", stopped_at]]
        assert seen["saved_at"] == [12, 18] and seen["steps"][0] == stopped_at + 1
    scalars = tensorboard_scalars(run)
    assert scalars["grad_norms_logged"] == [(s, s / 2) for s in range(2, 19, 2)]  # resumed
    for name in ("0.weight", "0.bias", "3.weight", "3.bias"):
        steps = [step for step, norm in scalars[f"grad_norm/{name}"] if norm > 0]
        assert steps == list(range(2, 19, 2)), name


def test_a_callback_on_every_event_changes_no_bit(tmp_path, reference):
    run = tmp_path / "run"
    train(run, "--listen-all")
    assert_same_run(reference, run)
    for rank in (0, 1):
        seen = json.loads((run / f"events.{rank}.json").read_text())
        assert seen["steps"] == list(range(1, 19)) and seen["error"] == "NoneType"
        assert seen["seen"] == {
            "on_setup": 1, "on_train_start": 1, "on_epoch_start": 3,
            "on_before_optimizer_step": 18, "on_step_end": 18, "on_validation_end": 3,
            "on_epoch_end": 3, "on_save_checkpoint": 3, "on_train_end": 1, "on_close": 1,
            **({"on_log": 3} if rank == 0 else {}),  # rank 0 only, once an epoch here
        }  # fmt: skip
        assert seen["saved_at"] == [6, 12, 18] and seen["loaded"] == []


def test_a_trainer_owns_its_names_step_monitor_state(tmp_path, reference):
    """A user's trainer keeps its own self.step, self.monitor, self.state, self.budget,
    self.progress: the engine's parts live elsewhere, and the run is the same, bitwise."""
    run = tmp_path / "run"
    train(run, "--own-names")
    assert_same_run(reference, run)
    for rank in (0, 1):
        mine = json.loads((run / f"own_names.{rank}.json").read_text())
        assert mine["step"] == 18 and mine["state"] == {"seen": 18 * 8}
        assert mine["monitor"] == "mine" and mine["budget"] == 1.0
        assert mine["progress"] == list(range(18))


def test_installed_callbacks_are_named_by_entry_point(tmp_path):
    run = tmp_path / "run"
    done = run_cli(*TINY, "--epochs", "1", "--callbacks", "every-event", "--run-dir", str(run),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "events.0.json").read_text())["seen"]["on_step_end"] == 12
    for name, says in (("nope", "no callback named 'nope' is installed under the entry-point "
                       "group dmltrain.callbacks (installed: broken, every-event)"),
                       ("broken", "the callback 'broken' (tiny:NoSuchCallback) could not be "
                        "made")):  # fmt: skip
        done = run_cli(*TINY, "--callbacks", name, "--run-dir", str(tmp_path / name),
                       cwd=tmp_path)  # fmt: skip
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], done.stderr


class Counter(Callback):
    def __init__(self) -> None:
        self.n = 0

    def on_step_end(self, trainer):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_dispatch_is_only_the_events_a_callback_overrides():
    counter, plain = Counter(), Callback()
    events = Events([plain, counter])
    assert events.on_step_end == (counter.on_step_end,)
    assert events.on_setup == events.on_close == events.on_log == ()
    assert Events().on_step_end == ()


def test_states_are_keyed_checked_and_unique():
    counter = Counter()
    assert states([counter, Callback()], {"mine": counter}) == {"Counter": counter,
                                                                "mine": counter}  # fmt: skip
    with pytest.raises(UserError, match="two states are kept under 'Counter'"):
        states([Counter(), Counter()], {})
    with pytest.raises(UserError, match=r"create_states: 'x' \(int\) has no state_dict"):
        states([], {"x": 3})
    with pytest.raises(UserError, match="not a non-empty string"):
        states([], {"": counter})


def test_a_state_a_checkpoint_cannot_load_is_refused_at_the_save():
    _check_loadable({"n": 1, "t": torch.ones(2), "l": [1.0, ("a", None)]}, "'ok'")
    with pytest.raises(
        UserError, match=r"the state 'mine'\['x'\] is a numpy.ndarray, .* torch.from_numpy"
    ):
        import numpy as np

        _check_loadable({"x": np.zeros(2)}, "'mine'")


CLOSING = """
from tiny import TinyOptions, TinyTrainer

from dmltrain import Callback, register_experiment


class Upload(Callback):
    def on_close(self, trainer, error):
        if error is None:
            raise RuntimeError("the upload failed")


class Closing(TinyTrainer):
    def create_callbacks(self):
        return [*super().create_callbacks(), Upload()]


EXPERIMENT = register_experiment("closing", Closing, TinyOptions)
"""


def test_an_on_close_that_fails_after_a_finished_run_leaves_it_recorded_done(tmp_path):
    """The run trained to its end, then a callback's on_close raised: exit 1 with its
    traceback, and outcome.json says done (there was none, and a sweep ran the trial
    again)."""
    experiment = tmp_path / "closing.py"
    experiment.write_text(CLOSING)
    run = tmp_path / "run"
    done = run_cli(str(experiment), "--epochs", "1", "--progress", "off", "--run-dir", str(run),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1 and "RuntimeError: the upload failed" in done.stderr
    assert json.loads((run / "outcome.json").read_text())["status"] == "done"


@pytest.mark.parametrize(
    "returned, said",
    [
        ("none", "create_callbacks returned None; return a list of callbacks"),
        ("one", "create_callbacks returned <test_callback.test_a_hook_returning_the_wrong_kin"),
        ("names", "--activation-checkpointing: checkpointed_modules returned '0'; return a list"),
    ],
)
def test_a_hook_returning_the_wrong_kind_is_one_line(tmp_path, returned, said):
    """``create_callbacks`` giving one callback or None, ``checkpointed_modules`` giving
    names: one line naming the hook and what to return, before any step."""
    from dmltrain import TrainConfig
    from tiny import TinyOptions, TinyTrainer

    class Quiet(Callback):
        pass

    class Odd(TinyTrainer):
        def create_callbacks(self):
            return {"none": None, "one": Quiet()}.get(returned, [])

        def checkpointed_modules(self, model):
            return ["0"] if returned == "names" else super().checkpointed_modules(model)

    config = TrainConfig(run_dir=str(tmp_path / "run"), epochs=1, progress="off",
                         activation_checkpointing=returned == "names")  # fmt: skip
    with pytest.raises(UserError, match="^" + said.replace("(", r"\(").replace("[", r"\[")):
        Odd(config, TinyOptions()).fit()

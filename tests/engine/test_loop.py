"""The loop: where nothing of a step's tail is due, it skips the tail's tests (``_calm``),
and everything falls on the very steps where testing at every step puts it."""

import torch

from dmltrain import Callback, TrainConfig
from dmltrain.engine.loop import Loop
from dmltrain.runtime.preemption import AgreementSchedule
from tiny import TinyTrainer


class Seen(Callback):
    """What happened, in order, with the global step it happened at."""

    def __init__(self, seen):
        self.seen = seen

    def on_log(self, trainer, values):
        self.seen.append(("log", trainer.global_step))

    def on_validation_end(self, trainer, row):
        self.seen.append(("validation", trainer.global_step))

    def on_save_checkpoint(self, trainer):
        self.seen.append(("save", trainer.global_step))

    def on_epoch_end(self, trainer, row):
        self.seen.append(("epoch end", trainer.global_step))


def fit(tmp_path, name, monkeypatch, calm):
    seen = []
    state = {}

    class Watched(TinyTrainer):
        def create_callbacks(self):
            state["trainer"] = self
            return [Seen(seen)]

    def agreed(schedule, steps, cost):
        seen.append(("agreement", state["trainer"].global_step))
        schedule._every = schedule._left = steps

    # every 6th boundary agrees (by the clock, the count would differ from run to run)
    monkeypatch.setattr(AgreementSchedule, "proposal", lambda schedule: 6)
    monkeypatch.setattr(AgreementSchedule, "agreed", agreed)
    if not calm:
        monkeypatch.setattr(Loop, "_calm", lambda loop, step, last: 0)
    trainer = Watched(
        TrainConfig(
            run_dir=str(tmp_path / name),
            progress="off",
            epochs=3,
            batch_size=4,  # 24 steps an epoch
            log_every=5,
            val_every_steps=7,
            checkpoint_every_steps=9,
            max_steps=62,  # inside the third epoch
        )
    )
    trainer.fit()
    return trainer, seen


def test_the_tail_falls_on_the_same_steps_when_the_loop_skips_its_tests(tmp_path, monkeypatch):
    calm, seen = fit(tmp_path, "calm", monkeypatch, calm=True)
    every, every_seen = fit(tmp_path, "every", monkeypatch, calm=False)
    assert seen == every_seen
    kinds = {kind for kind, _ in seen}
    assert kinds == {"log", "validation", "save", "epoch end", "agreement"}
    assert [s for kind, s in seen if kind == "agreement"][:3] == [1, 7, 13]
    assert [s for kind, s in seen if kind == "log"][:6] == [5, 10, 15, 20, 24, 29]
    assert seen[-1][1] == calm.global_step == 62
    a, b = calm.model.state_dict(), every.model.state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)

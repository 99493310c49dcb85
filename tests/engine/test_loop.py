"""The loop: each part of a step's tail (log interval, validation, checkpoint by steps,
agreement, the budget's last step, the epoch's end) falls on its own steps."""

from dmltrain import Callback, TrainConfig
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


def fit(tmp_path, name, monkeypatch):
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


def test_the_tail_falls_on_its_own_steps(tmp_path, monkeypatch):
    trainer, seen = fit(tmp_path, "run", monkeypatch)
    kinds = {kind for kind, _ in seen}
    assert kinds == {"log", "validation", "save", "epoch end", "agreement"}
    at = {kind: [s for k, s in seen if k == kind] for kind in kinds}
    assert at["agreement"] == list(range(1, 62, 6))  # the first boundary, then every 6th
    # every 5 steps of an epoch and its last; --val-every-steps 7, epochs' ends, the end
    assert at["log"] == [5, 10, 15, 20, 24, 29, 34, 39, 44, 48, 53, 58]
    assert at["validation"] == [7, 14, 21, 24, 28, 35, 42, 48, 49, 56, 62]
    assert at["epoch end"] == [24, 48]
    # --checkpoint-every-steps 9, epochs' ends, the end; the others a validation's best
    by_steps = {9, 18, 27, 36, 45, 54, 24, 48, 62}
    assert by_steps <= set(at["save"]) <= by_steps | set(at["validation"])
    assert seen[-1][1] == trainer.global_step == 62

"""The loop: each part of a step's tail (log interval, validation, checkpoint by steps,
agreement, the budget's last step, the epoch's end) falls on its own steps."""

import json

import pytest
import torch
from helpers import run_cli

from dmltrain import Callback, TrainConfig
from dmltrain.records.training_log import read_training_log
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


PORT_HOOKS = '''
import json
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from dmltrain import BaseTrainer, register_experiment

SEEN = []


class Logged:  # a state whose state_dict() marks when the epoch's checkpoint is taken
    def state_dict(self):
        SEEN.append("checkpoint")
        return {}

    def load_state_dict(self, state):
        pass


class Tokens(BaseTrainer):
    """Sample i has value i and i + 1 tokens: val_step's (mean, tokens) per batch."""

    def create_model(self):
        return nn.Linear(1, 1)

    def create_datasets(self):
        i = torch.arange(13.0).unsqueeze(1)
        return TensorDataset(i, i), TensorDataset(i, i + 1)

    def train_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def val_step(self, batch):
        value, tokens = batch
        return {"loss": F.mse_loss(self.model(value), value),
                "per_token": ((value * tokens).sum() / tokens.sum(), tokens.sum())}

    def create_states(self):
        return {"logged": Logged()}

    def on_validation_start(self):
        SEEN.append("validation start, eval mode next" if self.model.training else "odd")

    def on_validation_end(self, row):
        SEEN.append(f"validation end, best so far {self.best_value}")

    def on_epoch_end(self, epoch, row):
        if self.dist.is_main:  # rank 0 writes the training log
            SEEN.append(f"epoch end, best {self.best_value == min_loss(self.run_dir)}")
            (self.run_dir / "seen.json").write_text(json.dumps(SEEN))


def min_loss(run_dir):
    import csv
    return min(float(r["val_loss"]) for r in csv.DictReader(open(run_dir / "training_log.csv")))


EXPERIMENT = register_experiment("tokens", Tokens)
'''


def test_a_ports_hooks_weighted_metrics_and_the_order_of_an_epochs_end(tmp_path):
    """What a port needs from the loop (issue #84, point 5): val_step's (value, weight)
    metric averaged by its weight over the batches of both ranks, not by samples;
    on_validation_start and on_validation_end around each validation; the best value so
    far on the trainer; on_epoch_end before the epoch's checkpoint is taken."""
    (tmp_path / "tokens.py").write_text(PORT_HOOKS)
    done = run_cli("tokens.py", "--epochs", "2", "--batch-size", "3", "--nprocs", "2",
                   "--run-dir", "run", "--progress", "off", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_training_log(tmp_path / "run" / "training_log.csv")
    value = torch.arange(13.0, dtype=torch.float64)
    expected = float((value * (value + 1)).sum() / (value + 1).sum())  # 8; by samples: 6
    # rel: val_step's own float32 mean of each batch
    assert [r["val_per_token"] for r in rows] == pytest.approx([expected] * 2, rel=1e-6)
    seen = json.loads((tmp_path / "run" / "seen.json").read_text())
    first = float(rows[0]["val_loss"])
    assert seen[:4] == [
        "validation start, eval mode next",
        "validation end, best so far None",
        "epoch end, best True",
        "checkpoint",
    ], seen
    assert seen[4:7] == [
        "validation start, eval mode next",
        f"validation end, best so far {first}",
        "epoch end, best True",
    ], seen

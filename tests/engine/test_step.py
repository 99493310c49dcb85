"""The optimizer step: the usual step's own path (one frame) takes the very steps of the
general one."""

import torch
import torch.nn.functional as F

from dmltrain import TrainConfig
from dmltrain.engine.step import OptimizerStep
from dmltrain.records.training_log import read_training_log
from tiny import TinyOptions, TinyTrainer


class WithMetrics(TinyTrainer):
    """tiny with a metric of its own: the step's output is (loss, metrics)."""

    def train_step(self, batch):
        x, y = batch[:2]
        out = self.model(x)
        return F.mse_loss(out, y), {"mae": (out - y).abs().mean()}


def fit(tmp_path, name, **config):
    options = TinyOptions(dropout=0.2, augment=True)  # random draws in the step and the data
    run = tmp_path / name
    trainer = WithMetrics(
        TrainConfig(run_dir=str(run), progress="off", epochs=2, batch_size=8, **config), options
    )
    trainer.fit()
    return trainer, read_training_log(run / "training_log.csv")


def test_the_usual_step_takes_the_general_steps_bit_for_bit(tmp_path):
    usual, usual_log = fit(tmp_path, "usual")
    # A clip no gradient reaches sends the step down the general path (gradients
    # unscaled, clipped by a factor of exactly 1.0), with the same updates.
    general, general_log = fit(tmp_path, "general", grad_clip=1e9)
    assert usual._step.run.__func__ is OptimizerStep._run_usual
    assert general._step.run.__func__ is OptimizerStep.run
    assert "train_mae" in usual_log[0]
    for row in (*usual_log, *general_log):
        row.pop("epoch_time_s")
    assert usual_log == general_log
    a, b = usual.model.state_dict(), general.model.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key

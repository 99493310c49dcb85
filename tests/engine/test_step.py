"""The optimizer step: the usual step's own path (one frame) takes the very steps of the
general one."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli, run_of

from dmltrain import TrainConfig, UserError
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
    assert run_of(usual).step.run.__func__ is OptimizerStep._run_usual
    assert run_of(general).step.run.__func__ is OptimizerStep.run
    assert "train_mae" in usual_log[0]
    for row in (*usual_log, *general_log):
        row.pop("epoch_time_s")
    assert usual_log == general_log
    a, b = usual.model.state_dict(), general.model.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_usual_step_counts_each_batch_as_batch_size_of_does():
    """The usual step reads the sample count of a tuple or list led by a tensor itself,
    and hands every other batch to ``batch_size_of``: the same count for each kind."""
    from collections import namedtuple

    from dmltrain.config import DistConfig
    from dmltrain.data.batches import batch_size_of
    from dmltrain.engine.precision import Precision
    from dmltrain.engine.state import TrainState
    from dmltrain.runtime.launch import detect
    from dmltrain.runtime.strategies import Strategy

    cpu = torch.device("cpu")
    model = torch.nn.Linear(3, 1)

    def first_tensor(batch):
        if isinstance(batch, torch.Tensor):
            return batch
        values = batch.values() if isinstance(batch, dict) else batch
        return next(first_tensor(v) for v in values if not isinstance(v, str))

    def train_step(batch):
        return model(first_tensor(batch)).sum()

    pair = namedtuple("pair", "x y")
    x5, x2 = torch.ones(5, 3), torch.ones(2, 3)
    batches = [
        (x5, torch.ones(5)),
        [x2],
        {"x": x5, "y": x2},
        x2,
        ([x5], x2),
        ("tag", x2),
        pair(x5, x2),
        (torch.nn.Parameter(x2),),
    ]
    for batch in batches:
        state = TrainState(cpu)
        step = OptimizerStep(
            train_step=train_step,
            on_after_backward=None,
            model=model,
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1),),
            schedulers=(),
            precision=Precision("fp32", cpu),
            strategy=Strategy(detect("single", 1), DistConfig()),
            state=state,
            device=cpu,
            grad_clip=0.0,
            detect_anomaly=False,
            nan_checker=None,
            settle=lambda: None,
        )
        assert step.run.__func__ is OptimizerStep._run_usual
        step.run((batch,), 1, 1)
        assert state.metrics.count == batch_size_of(batch), batch


GAN_MISTAKES = str(Path(__file__).with_name("gan_mistakes.py"))


@pytest.mark.parametrize(
    ("mistake", "nprocs", "said"),
    [
        ("no-update", "1", "made no update through self.optimizer_step(optimizer)"),
        ("direct", "2", "made no update through self.optimizer_step(optimizer)"),
        ("no-backward", "1", "called self.optimizer_step without self.backward(loss)"),
    ],
)
def test_a_manual_step_that_would_train_nothing_or_apart_is_one_line(
    tmp_path, mistake, nprocs, said
):
    """The bundled GAN's step written wrongly: no update (the run ended 'done' with its
    weights unchanged), a direct loss.backward()/opt.step() under 2 processes (the ranks
    trained apart, rank 0's model saved), an update without a backward: each stops at the
    first step with one line (exit 2)."""
    run = tmp_path / "run"
    done = run_cli(GAN_MISTAKES, "--mistake", mistake, "--nprocs", nprocs, "--epochs", "1",
                   "--no-download", "--progress", "off", "--run-dir", str(run),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("dmltrain: error:")]
    assert len(lines) == 1 and said in lines[0] and "first step" in lines[0], done.stderr[-3000:]
    assert not list((run / "checkpoints").glob("ckpt-*"))


class Lbfgs(TinyTrainer):
    """tiny trained with LBFGS, whose step evaluates the loss several times."""

    def create_optimizer(self, model):
        return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)


class LbfgsClosure(Lbfgs):
    def create_model(self):
        model = super().create_model()
        self.manual_optimization = True  # tiny sets it from its options there
        return model

    def train_step(self, batch):
        x, y = batch[:2]

        def closure():
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            return loss

        return self.optimizer_step(self.optimizer, closure)

    def val_step(self, batch):
        x, y = batch[:2]
        return {"loss": F.mse_loss(self.model(x), y)}


def test_an_optimizer_with_a_closure_trains_or_is_refused_in_one_line(tmp_path):
    """LBFGS: the automatic step (which calls step()) refuses it at setup, saying what to
    do; self.optimizer_step(optimizer, closure) trains with it, evaluating the closure
    several times a step, and returns the step's first loss; with what a closure's step
    cannot take (accumulation, fp16 scaling, --check-nans) it is one line."""
    config = TrainConfig(run_dir=str(tmp_path / "auto"), progress="off", epochs=1)
    with pytest.raises(UserError, match=r"LBFGS.step needs a closure .* set manual_optimiza"):
        Lbfgs(config, TinyOptions()).fit()
    calls = []

    class Counted(LbfgsClosure):
        def create_model(self):
            model = super().create_model()
            model.register_forward_hook(lambda *_: calls.append(1))
            return model

    run = tmp_path / "closure"
    rows = Counted(TrainConfig(run_dir=str(run), progress="off", epochs=2), TinyOptions()).fit()
    assert len(rows) == 2 and rows[1]["train_loss"] < rows[0]["train_loss"]
    steps = rows[-1]["step"]
    assert len(calls) > steps * 2  # several forwards a step, and the validations' too
    for extra, said in [
        ({"grad_accum": 2}, "--grad-accum"),
        ({"check_nans": True}, "--check-nans"),
    ]:
        config = TrainConfig(run_dir=str(tmp_path / "x"), progress="off", epochs=1, **extra)
        with pytest.raises(
            UserError, match=f"optimizer_step.optimizer, closure. does not work with .*{said}"
        ):
            LbfgsClosure(config, TinyOptions()).fit()

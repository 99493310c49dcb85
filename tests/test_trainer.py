import math

import pytest
import torch
import torch.nn.functional as F

from dmltrain import BaseTrainer, DistInfo, TrainConfig, UserError
from dmltrain.records.training_log import read_training_log
from tiny import TinyOptions, TinyTrainer


def fit(tmp_path, trainer_cls=TinyTrainer, name="run", options=None, **config):
    config.setdefault("epochs", 3)
    config.setdefault("batch_size", 16)
    config.setdefault("lr", 0.05)
    trainer = trainer_cls(
        TrainConfig(run_dir=str(tmp_path / name), progress="off", **config), options
    )
    rows = trainer.fit()
    return trainer, rows


def test_programmatic_fit_writes_run_dir(tmp_path):
    trainer, rows = fit(tmp_path)
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file()
    log = read_training_log(run / "training_log.csv")
    assert [r["epoch"] for r in log] == [1, 2, 3]
    assert list(log[0]) == [
        "epoch", "step", "train_loss", "val_loss", "lr", "world_size", "epoch_time_s"
    ]  # fmt: skip
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in log]
    assert trainer.global_step == 3 * math.ceil(96 / 16)


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a, rows_a = fit(tmp_path, name="a", seed=3)
    b, rows_b = fit(tmp_path, name="b", seed=3)
    c, _ = fit(tmp_path, name="c", seed=4)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert [r["train_loss"] for r in rows_a] == [r["train_loss"] for r in rows_b]
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))


def test_validation_metrics_are_sample_weighted(tmp_path):
    # 32 validation samples in batches of 24 and 8: a plain mean of batch means would be wrong.
    trainer, rows = fit(tmp_path, epochs=1, batch_size=24)
    x, y = (t.to(trainer.device) for t in trainer.val_loader.dataset.tensors)
    with torch.no_grad():
        expected = F.mse_loss(trainer.model(x), y).item()
    assert rows[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


class StepLRTrainer(TinyTrainer):
    def create_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_scheduler_steps_each_epoch(tmp_path):
    _, rows = fit(tmp_path, StepLRTrainer, lr=0.08)
    assert [r["lr"] for r in rows] == pytest.approx([0.08, 0.04, 0.02])


class FlagsTrainer(StepLRTrainer):
    create_optimizer = BaseTrainer.create_optimizer  # --optimizer, --lr, --weight-decay


def test_config_yaml_records_the_optimizers_and_schedulers_built(tmp_path):
    """What ran, beside the flags: an experiment's own create_optimizer may ignore them."""
    fit(tmp_path, name="own", options=TinyOptions(two_optimizers="auto"), epochs=1)
    own = (tmp_path / "own" / "config.yaml").read_text()
    assert own.endswith(
        "# what was built\n"
        "# (by the experiment's own create_optimizer: --optimizer, --lr and --weight-decay\n"
        "# above apply only as far as it reads them)\n"
        "# optimizer: Adam lr=0.001 betas=(0.9, 0.999) eps=1e-08 weight_decay=0\n"
        "# optimizer: SGD lr=0.01 momentum=0.9 weight_decay=0 nesterov=False\n"
    ), own
    fit(tmp_path, FlagsTrainer, name="flags", epochs=1, optimizer="sgd", weight_decay=0.1)
    flags = (tmp_path / "flags" / "config.yaml").read_text()
    assert flags.endswith(
        "# what was built\n"
        "# optimizer: SGD lr=0.05 momentum=0 weight_decay=0.1 nesterov=False\n"
        "# scheduler: StepLR step_size=1 gamma=0.5\n"
    ), flags


class PerStepTrainer(StepLRTrainer):
    scheduler_interval = "step"


def test_scheduler_can_step_each_step(tmp_path):
    _trainer, rows = fit(tmp_path, PerStepTrainer, lr=0.08, epochs=2)
    # The lr column is the rate at the end of the epoch's training: 6 steps per epoch.
    assert [r["lr"] for r in rows] == pytest.approx([0.08 * 0.5**6, 0.08 * 0.5**12])


class HookTrainer(TinyTrainer):
    def on_train_start(self):
        self.events = ["start"]

    def on_epoch_start(self, epoch):
        self.events.append(f"epoch_start {epoch}")

    def on_epoch_end(self, epoch, metrics):
        self.events.append(f"epoch_end {epoch} {metrics['epoch']}")

    def on_train_end(self):
        self.events.append("end")


def test_hooks_run_in_order(tmp_path):
    trainer, _ = fit(tmp_path, HookTrainer, epochs=2)
    assert trainer.events == [
        "start",
        "epoch_start 0",
        "epoch_end 0 1",
        "epoch_start 1",
        "epoch_end 1 2",
        "end",
    ]


class MetricTrainer(TinyTrainer):
    def train_step(self, batch):
        loss = super().train_step(batch)
        return loss, {"abs_err": (self.model(batch[0]) - batch[1]).abs().mean()}


def test_step_metrics_reach_the_log(tmp_path):
    _, rows = fit(tmp_path, MetricTrainer, epochs=1)
    assert {"train_loss", "train_abs_err", "val_loss", "val_abs_err"} <= set(rows[0])


def test_sgd_and_adamw_from_config(tmp_path):
    trainer, _ = fit(tmp_path, name="sgd", optimizer="sgd", epochs=1)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    trainer, _ = fit(tmp_path, name="adamw", optimizer="adamw", epochs=1, weight_decay=0.1)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)


def test_existing_run_is_never_overwritten(tmp_path):
    fit(tmp_path, epochs=1)
    run = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(UserError, match="already holds a run"):
        fit(tmp_path, epochs=2, resume="never")
    for checkpoint in (run / "checkpoints").glob("ckpt-*"):
        checkpoint.unlink()  # a run with a log but nothing to resume from
    with pytest.raises(UserError, match="no checkpoint to resume"):
        fit(tmp_path, epochs=2)
    assert (run / "training_log.csv").read_bytes() == before["training_log.csv"]
    assert (run / "config.yaml").read_bytes() == before["config.yaml"]


def test_rerun_on_the_same_directory_continues_it(tmp_path):
    _, first = fit(tmp_path, epochs=2)
    trainer, rows = fit(tmp_path, epochs=3)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[:2] == first and trainer.global_step == 3 * 6


def test_default_run_dir_uses_job_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(epochs=1, progress="off")
    trainer = TinyTrainer(config, dist=DistInfo(job_id="4242"))
    trainer.fit()
    assert (tmp_path / "runs" / "tiny-4242" / "training_log.csv").is_file()
    assert trainer.config.run_dir == "runs/tiny-4242"


def test_empty_training_set_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="training dataset is empty"):
        fit(tmp_path, options=TinyOptions(samples=0))


def test_fit_ends_its_loader_workers_before_it_returns(tmp_path):
    """Persistent loader workers end with fit, not at interpreter exit, where torch's
    exit handler joins them after CUDA and the process group are gone."""
    import multiprocessing

    trainer, _ = fit(tmp_path, epochs=1, num_workers=2)
    assert trainer.train_loader._iterator is None and trainer.val_loader._iterator is None
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_gpu_loader_pins_memory_only_where_workers_fill_it(workers):
    """No GPU here: the trainer is told its device is one (the loader is only built); with
    no workers the loop itself would pin, one more copy of each batch."""
    from dmltrain.config import DistConfig
    from dmltrain.runtime.strategies import Strategy

    trainer = TinyTrainer(TrainConfig(num_workers=workers), TinyOptions(), dist=DistInfo())
    trainer.device = torch.device("cuda")
    trainer.strategy = Strategy(trainer.dist, DistConfig())
    dataset = trainer.create_datasets()[0]
    assert trainer.create_dataloader(dataset, train=True).pin_memory is (workers > 0)


def test_the_users_own_names_train_and_the_documented_ones_are_refused_in_one_line(tmp_path):
    """The engine is not the user's object: a Lightning habit (def setup), the counter
    idiom (self._step = 0) and names like step, monitor, budget and _state are the
    experiment's own and the run trains; a documented name (validate, model,
    global_step) defined again is refused when the class is defined."""
    for body in ("def validate(self):\n        pass", "model = None", "global_step = 0"):
        with pytest.raises(TypeError) as refused:
            exec(f"class Mine(TinyTrainer):\n    {body}\n", {"TinyTrainer": TinyTrainer})
        assert str(refused.value).startswith("Mine defines ")
        assert "dmltrain's own name(s) on the trainer; rename yours" in str(refused.value)

    class Mine(TinyTrainer):
        name = "mine"  # the class attributes an experiment sets stay its own
        manual_optimization = False

        def setup(self):
            self.set_up = True

        def step(self):
            return "the user's"

        def monitor(self):
            return "mine too"

        def on_train_start(self):
            self._step = 0
            self._state = {"seen": 0}
            self.budget = "the user's"

        def train_step(self, batch):
            if self.model.training:  # not the default val_step's call
                self._step += 1
                self._state["seen"] += 1
            return super().train_step(batch)

    run = tmp_path / "run"
    trainer = Mine(TrainConfig(epochs=2, progress="off", run_dir=str(run)), TinyOptions())
    rows = trainer.fit()
    assert len(rows) == 2 and trainer.global_step == trainer._step == trainer._state["seen"] > 0
    assert trainer.step() == "the user's" and trainer.monitor() == "mine too"
    assert not hasattr(trainer, "set_up")  # the user's setup is no part of the run
    assert (run / "checkpoints" / "latest.pt").exists()


def test_a_part_read_before_it_is_made_names_the_hook_that_makes_it(tmp_path):
    trainer = TinyTrainer(TrainConfig(epochs=1, progress="off"), TinyOptions(), dist=DistInfo())
    with pytest.raises(UserError, match=r"^self.model is made by create_model: read it in a hook"):
        trainer.model  # noqa: B018 (the read is the test)

    class Early(TinyTrainer):
        def create_model(self):
            self.train_loader  # noqa: B018
            return super().create_model()

    early = Early(TrainConfig(epochs=1, progress="off", run_dir=str(tmp_path / "r")), TinyOptions())
    with pytest.raises(UserError, match=r"^self.train_loader is made by create_datasets"):
        early.fit()

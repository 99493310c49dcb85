"""``BaseTrainer``: the experiment supplies model, data and one step's loss; this runs the loop.

Data loading policy (documented in the README):
- training batches come from one global permutation seeded by ``seed + epoch``; rank r of
  w takes every w-th sample of it (``DistributedSampler``), so for the same global batch
  (``batch_size`` x world size) every world size sees the same samples in each step. The
  last, smaller batch is kept (``drop_last=False``); with w processes the sampler pads
  the epoch to a multiple of w by repeating its first samples;
- validation is sharded without padding (rank r takes samples r, r+w, ...) and never
  shuffled, so validation metrics are exact sample-weighted means;
- ``pin_memory`` is on when training on CUDA; workers persist across epochs when used.
"""

import abc
import dataclasses
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

from dmltrain import launch
from dmltrain.config import CONCERNS, DistConfig, TrainConfig, section, to_yaml
from dmltrain.distributed import Strategy, create_strategy
from dmltrain.errors import UserError
from dmltrain.launch import DistInfo
from dmltrain.metrics import MetricAccumulator
from dmltrain.progress import Progress
from dmltrain.training_log import TrainingLog, read_training_log

StepOutput = Tensor | tuple[Tensor, Mapping[str, Tensor | float]]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, (Tensor, Mapping, list, tuple)):
            return batch_size_of(value)
    raise UserError("cannot tell the batch size: a batch must contain at least one tensor")


def split_step_output(output: StepOutput) -> tuple[Tensor, Mapping[str, Tensor | float]]:
    if isinstance(output, tuple):
        return output[0], output[1]
    return output, {}


class BaseTrainer(abc.ABC):
    """Subclass, implement the three abstract methods, then ``MyTrainer(config).fit()``.

    ``options`` is the experiment's own dataclass of settings (or None).
    """

    name = "experiment"  # run directories default to runs/<name>-<job id or time>
    scheduler_interval = "epoch"  # or "step": when the LR scheduler steps

    # Set by setup(), before the first epoch.
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    val_loader: DataLoader | None
    strategy: Strategy
    progress: Progress
    training_log: TrainingLog
    run_dir: Path

    def __init__(
        self,
        config: TrainConfig | None = None,
        options: Any = None,
        *,
        dist: DistInfo | None = None,
    ) -> None:
        self.config = config if config is not None else TrainConfig()
        self.options = options
        if dist is None:
            dist = launch.detect(self.config.launcher, self.config.nprocs)
        self.dist = dist
        self.device = torch.device(self.dist.device)
        # Chosen (and checked) now, so bad settings fail before any process starts.
        self.strategy = create_strategy(self.dist, section(self.config, DistConfig))
        self.epoch = 0
        self.global_step = 0
        self._spawned_worker = False

    # ----- what an experiment provides -------------------------------------------------
    @abc.abstractmethod
    def create_model(self) -> nn.Module:
        """The model, on the CPU; the trainer moves and wraps it."""

    @abc.abstractmethod
    def create_datasets(self) -> tuple[Dataset, Dataset | None]:
        """The training dataset and the validation dataset (or None)."""

    @abc.abstractmethod
    def train_step(self, batch: Any) -> StepOutput:
        """The loss of one batch (already on the device), optionally with a dict of metrics."""

    def create_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        cfg = self.config
        params = model.parameters()
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        optimizer_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
        return optimizer_cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def create_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """An LR scheduler stepped every epoch (or step, see ``scheduler_interval``); None."""
        return None

    def val_step(self, batch: Any) -> Mapping[str, Tensor | float]:
        """Validation metrics of one batch; by default the training loss."""
        loss, metrics = split_step_output(self.train_step(batch))
        return {"loss": loss, **metrics}

    def prepare_data(self) -> None:
        """Download or unpack data; runs on one process per node before create_datasets."""

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules that become FSDP units (then the root): children that own parameters."""
        return [child for child in model.children() if any(True for _ in child.parameters())]

    def create_dataloader(self, dataset: Dataset, train: bool) -> DataLoader:
        cfg = self.config
        sampler: Sampler[int] = (
            self.strategy.train_sampler(dataset, cfg.seed)
            if train
            else self.strategy.val_sampler(dataset)
        )
        return DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
            drop_last=False,
        )

    # ----- optional hooks ----------------------------------------------------------------
    def on_train_start(self) -> None:
        """Called once, after setup, before the first epoch."""

    def on_epoch_start(self, epoch: int) -> None:
        """Called before each epoch (0-based)."""

    def on_epoch_end(self, epoch: int, metrics: dict[str, float]) -> None:
        """Called after each epoch with the row just written to the training log."""

    def on_train_end(self) -> None:
        """Called once after the last epoch."""

    # ----- the loop ------------------------------------------------------------------------
    def warn(self, message: str) -> None:
        """A warning on stderr; ranks other than 0 prefix theirs with their rank."""
        prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
        print(f"{prefix}WARNING: {message}", file=sys.stderr, flush=True)

    def fit(self) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs; returns the training log's rows."""
        if self.dist.launcher == "spawn" and not self._spawned_worker:
            return self._spawn_workers()
        try:
            self.setup()
            return self._fit()
        except Exception as exc:
            lost = self.strategy.lost_peer(exc)
            if lost is None:
                raise
            raise lost from exc
        finally:
            self.strategy.teardown()

    def _fit(self) -> list[dict[str, Any]]:
        self.on_train_start()
        for epoch in range(self.epoch, self.config.epochs):
            self.epoch = epoch
            self.on_epoch_start(epoch)
            started = time.perf_counter()
            train_metrics = self.train_epoch(epoch)
            val_metrics = self.validate() if self.val_loader is not None else {}
            lr = self.optimizer.param_groups[0]["lr"]
            if self.scheduler is not None and self.scheduler_interval == "epoch":
                self.scheduler.step()
            row: dict[str, Any] = {"epoch": epoch + 1}
            row.update({f"train_{k}": v for k, v in train_metrics.items()})
            row.update({f"val_{k}": v for k, v in val_metrics.items()})
            row.update(lr=lr, epoch_time_s=round(time.perf_counter() - started, 3))
            if self.dist.is_main:
                self.training_log.append(row)
            self.progress.epoch_summary(row)
            self.on_epoch_end(epoch, row)
        self.epoch = self.config.epochs
        self.on_train_end()
        return self.training_log.rows

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        sampler = self.train_loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        metrics = MetricAccumulator(self.device)
        batches = self.progress.epoch(
            self.train_loader, epoch + 1, self.config.epochs, len(self.train_loader)
        )
        for step, batch in enumerate(batches, start=1):
            batch = to_device(batch, self.device)
            loss, step_metrics = split_step_output(self.train_step(batch))
            self.optimizer.zero_grad()  # set_to_none is the default
            loss.backward()
            self.optimizer.step()
            if self.scheduler is not None and self.scheduler_interval == "step":
                self.scheduler.step()
            self.global_step += 1
            metrics.update({"loss": loss, **step_metrics}, batch_size_of(batch))
            self.progress.step(step, metrics.count, metrics.compute)  # rank 0's running mean
        return metrics.compute(self.strategy.all_reduce_sum)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Validation on each rank's shard; the DDP wrapper is bypassed (no collectives)."""
        assert self.val_loader is not None
        wrapped, self.model = self.model, self.strategy.eval_model(self.model)
        try:
            self.model.eval()
            metrics = MetricAccumulator(self.device)
            for batch in self.val_loader:
                batch = to_device(batch, self.device)
                metrics.update(self.val_step(batch), batch_size_of(batch))
        finally:
            self.model = wrapped
        return metrics.compute(self.strategy.all_reduce_sum)

    # ----- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Processes, run directory, model, data, optimizer: everything ``fit`` needs."""
        self.dist = self.strategy.setup()
        self.device = torch.device(self.dist.device)
        self.progress = Progress(self.config.progress, self.dist.is_main, self.config.log_every)
        self.run_dir = self._prepare_run_dir()
        torch.manual_seed(self.config.seed)  # the same initial weights on every rank
        model = self.create_model().to(self.device)
        seed_everything(self.config.seed + self.dist.rank)  # per-rank dropout, augmentation
        self.model = self.strategy.wrap_model(model, self.fsdp_units(model))
        if self.dist.is_local_main:
            self.prepare_data()
        self.strategy.barrier()
        train_set, val_set = self.create_datasets()
        if len(train_set) == 0:  # type: ignore[arg-type]
            raise UserError("the training dataset is empty: check --data-dir")
        self.train_loader = self.create_dataloader(train_set, train=True)
        self.val_loader = None if val_set is None else self.create_dataloader(val_set, False)
        optimizer = self.create_optimizer(self.model)
        self.optimizer = self.strategy.wrap_optimizer(optimizer, self.model)
        self.scheduler = self.create_scheduler(self.optimizer)
        self.training_log = TrainingLog(self.run_dir / "training_log.csv")

    def resolved_config_yaml(self) -> str:
        groups = [(title, section(self.config, cls)) for title, cls in CONCERNS]
        if dataclasses.is_dataclass(self.options):
            groups.append((f"{self.name} options", self.options))
        return to_yaml(groups)

    def _default_run_dir(self) -> str:
        stamp = self.dist.job_id or time.strftime("%Y%m%d-%H%M%S")
        return f"runs/{self.name}-{stamp}"

    def _prepare_run_dir(self) -> Path:
        """Rank 0 chooses and checks the run directory; every rank gets its decision."""
        decision: tuple[str, str | None] = ("", None)
        if self.dist.is_main:
            path = Path(self.config.run_dir or self._default_run_dir())
            error = None
            if (path / "training_log.csv").exists():
                error = (
                    f"run directory {path} already holds a run (training_log.csv); "
                    "pass a new --run-dir to start another"
                )
            decision = (str(path), error)
        run_dir, error = self.strategy.broadcast_object(decision)
        if error:
            raise UserError(error)
        self.config = dataclasses.replace(self.config, run_dir=run_dir)
        if self.dist.is_main:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            text = self.resolved_config_yaml()
            (Path(run_dir) / "config.yaml").write_text(text)
            self.progress.info(f"dmltrain: {self.name} -> {run_dir}\n{text.rstrip()}")
        return Path(run_dir)

    def _spawn_workers(self) -> list[dict[str, Any]]:
        """``--nprocs N``: start N workers here and wait; one failing stops the others."""
        config = dataclasses.replace(
            self.config, run_dir=self.config.run_dir or self._default_run_dir()
        )
        launch.spawn(
            self.dist.world_size,
            _spawned_fit,
            (type(self), self.name, config, self.options, self.dist),
        )
        return read_training_log(Path(str(config.run_dir)) / "training_log.csv")


def _spawned_fit(
    local_rank: int,
    trainer_cls: type,
    name: str,
    config: TrainConfig,
    options: Any,
    parent: DistInfo,
) -> None:
    trainer = trainer_cls(config, options, dist=launch.spawned(parent, local_rank))
    trainer.name = name
    trainer._spawned_worker = True
    launch.exit_on_error(trainer.fit, trainer.dist.rank, trainer.dist.world_size)

"""``BaseTrainer``: the experiment supplies model, data and one step's loss; this runs the loop.

Data loading policy (documented in the README):
- training batches are shuffled with a generator seeded by ``seed + epoch``, so the data
  order is a function of the seed and the epoch, and the last, smaller batch is kept
  (``drop_last=False``): every sample is seen once per epoch;
- validation batches are never shuffled or dropped;
- ``pin_memory`` is on when training on CUDA; workers persist across epochs when used.
"""

import abc
import dataclasses
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

from dmltrain import launch
from dmltrain.config import CONCERNS, TrainConfig, section, to_yaml
from dmltrain.errors import UserError
from dmltrain.launch import DistInfo
from dmltrain.metrics import MetricAccumulator
from dmltrain.progress import Progress
from dmltrain.training_log import TrainingLog

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

    def __init__(
        self,
        config: TrainConfig | None = None,
        options: Any = None,
        *,
        dist: DistInfo | None = None,
    ) -> None:
        self.config = config if config is not None else TrainConfig()
        self.options = options
        self.dist = dist if dist is not None else launch.single_process()
        self.device = torch.device(self.dist.device)
        self.epoch = 0
        self.global_step = 0

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

    def create_dataloader(self, dataset: Dataset, train: bool) -> DataLoader:
        cfg = self.config
        sampler = RandomSampler(dataset, generator=self._data_generator) if train else None  # type: ignore[arg-type]
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
    def fit(self) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs; returns the training log's rows."""
        self.setup()
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
        self._data_generator.manual_seed(self.config.seed + epoch)
        metrics = MetricAccumulator(self.device)
        batches = self.progress.epoch(
            self.train_loader, epoch + 1, self.config.epochs, len(self.train_loader)
        )
        for step, batch in enumerate(batches, start=1):
            batch = to_device(batch, self.device)
            loss, step_metrics = split_step_output(self.train_step(batch))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if self.scheduler is not None and self.scheduler_interval == "step":
                self.scheduler.step()
            self.global_step += 1
            metrics.update({"loss": loss, **step_metrics}, batch_size_of(batch))
            self.progress.step(step, metrics.count, metrics.compute)
        return metrics.compute()

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        assert self.val_loader is not None
        self.model.eval()
        metrics = MetricAccumulator(self.device)
        for batch in self.val_loader:
            batch = to_device(batch, self.device)
            metrics.update(self.val_step(batch), batch_size_of(batch))
        return metrics.compute()

    # ----- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Run directory, seed, model, data, optimizer: everything ``fit`` needs."""
        self.progress = Progress(self.config.progress, self.dist.is_main, self.config.log_every)
        self.run_dir = self._prepare_run_dir()
        seed_everything(self.config.seed)
        self.model = self.create_model().to(self.device)
        train_set, val_set = self.create_datasets()
        if len(train_set) == 0:  # type: ignore[arg-type]
            raise UserError("the training dataset is empty: check --data-dir")
        self._data_generator = torch.Generator()
        self.train_loader = self.create_dataloader(train_set, train=True)
        self.val_loader = None if val_set is None else self.create_dataloader(val_set, False)
        self.optimizer = self.create_optimizer(self.model)
        self.scheduler = self.create_scheduler(self.optimizer)
        self.training_log = TrainingLog(self.run_dir / "training_log.csv")

    def resolved_config_yaml(self) -> str:
        groups = [(title, section(self.config, cls)) for title, cls in CONCERNS]
        if dataclasses.is_dataclass(self.options):
            groups.append((f"{self.name} options", self.options))
        return to_yaml(groups)

    def _prepare_run_dir(self) -> Path:
        run_dir = self.config.run_dir
        if run_dir is None:
            stamp = self.dist.job_id or time.strftime("%Y%m%d-%H%M%S")
            run_dir = f"runs/{self.name}-{stamp}"
        path = Path(run_dir)
        if (path / "training_log.csv").exists():
            raise UserError(
                f"run directory {path} already holds a run (training_log.csv); "
                "pass a new --run-dir to start another"
            )
        self.config = dataclasses.replace(self.config, run_dir=str(path))
        if self.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            text = self.resolved_config_yaml()
            (path / "config.yaml").write_text(text)
            self.progress.info(f"dmltrain: {self.name} -> {path}\n{text.rstrip()}")
        return path

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils.data import DataLoader, Dataset, Sampler

from dmltrain import launch, preemption
from dmltrain.checkpoint import (
    CheckpointDir,
    check_model_fits,
    list_checkpoints,
    load_file,
    load_latest_valid,
    rng_state,
    set_rng_state,
    strip_prefixes,
)
from dmltrain.config import CONCERNS, DistConfig, TrainConfig, section, to_yaml
from dmltrain.distributed import ResumableSampler, Strategy, create_strategy
from dmltrain.errors import StopForRequeue, UserError
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
    checkpoints: CheckpointDir
    watcher: preemption.PreemptionWatcher

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
        self.epoch = 0  # epochs completed (the one in progress, 0-based)
        self.step_in_epoch = 0  # optimizer steps done in the epoch in progress
        self.global_step = 0
        self.epoch_metrics: dict[str, Any] | None = None  # partial epoch (mid-epoch resume)
        self.best_value: float | None = None
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
        # Signals are caught from here on (setup can take long); the loop acts on them.
        self.watcher = preemption.PreemptionWatcher(
            [n.strip() for n in self.config.preempt_signals.split(",") if n.strip()]
        )
        try:
            self.setup()
            return self._fit()
        except Exception as exc:
            lost = self.strategy.lost_peer(exc)
            if lost is None:
                raise
            raise lost from exc
        finally:
            if hasattr(self, "watcher"):
                self.watcher.restore()
            if hasattr(self, "checkpoints") and self.dist.is_main:
                try:
                    self.checkpoints.wait()  # never exit with a write half done
                except UserError as exc:
                    self.warn(str(exc))
            self.strategy.teardown()

    def _fit(self) -> list[dict[str, Any]]:
        self.on_train_start()
        epochs_this_job = 0
        while self.epoch < self.config.epochs:
            epoch = self.epoch
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
            self.training_log.rows.append(row)
            if self.dist.is_main:
                self.training_log.write()
            self.progress.epoch_summary(row)
            self.on_epoch_end(epoch, row)
            self.epoch, self.step_in_epoch, self.epoch_metrics = epoch + 1, 0, None
            self.save_checkpoint(best=self._improves_best(row))
            epochs_this_job += 1
            per_job = self.config.epochs_per_job
            if per_job and epochs_this_job >= per_job and self.epoch < self.config.epochs:
                raise StopForRequeue(
                    f"{epochs_this_job} epoch(s) done in this job (--epochs-per-job), "
                    f"{self.epoch}/{self.config.epochs} in all; exit status 3: requeue to go on"
                )
        self.on_train_end()
        if self.dist.is_main:
            self.checkpoints.wait()
        return self.training_log.rows

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        sampler = self.train_loader.sampler
        if isinstance(sampler, ResumableSampler):
            sampler.set_epoch(epoch)
            sampler.start = self.step_in_epoch * self.config.batch_size
        metrics = MetricAccumulator(self.device)
        if self.epoch_metrics is not None:  # resumed mid-epoch: continue its averages
            metrics.load_state_dict(self.epoch_metrics)
        batches = self.progress.epoch(
            self.train_loader,
            epoch + 1,
            self.config.epochs,
            self.step_in_epoch + len(self.train_loader),
        )
        for step, batch in enumerate(batches, start=self.step_in_epoch + 1):
            batch = to_device(batch, self.device)
            loss, step_metrics = split_step_output(self.train_step(batch))
            self.optimizer.zero_grad()  # set_to_none is the default
            loss.backward()
            self.optimizer.step()
            if self.scheduler is not None and self.scheduler_interval == "step":
                self.scheduler.step()
            self.global_step += 1
            self.step_in_epoch = step
            metrics.update({"loss": loss, **step_metrics}, batch_size_of(batch))
            self.progress.step(step, metrics.count, metrics.compute)  # rank 0's running mean
            self._step_boundary(metrics)
        return metrics.compute(self.strategy.all_reduce_sum)

    def _step_boundary(self, metrics: MetricAccumulator) -> None:
        """Checkpoint when due; on preemption (agreed by all ranks) save and stop."""
        cfg = self.config
        due = (
            bool(cfg.checkpoint_every_steps) and self.global_step % cfg.checkpoint_every_steps == 0
        )
        timed = bool(cfg.checkpoint_every_minutes) and (
            time.monotonic() - self._last_save >= 60 * cfg.checkpoint_every_minutes
        )
        preempt, timed = self.strategy.any_rank([self.watcher.local_request(), timed])
        if not (preempt or due or timed):
            return
        self.epoch_metrics = metrics.state_dict()
        self.save_checkpoint(best=False, wait=preempt)  # the process exits right after
        self.epoch_metrics = None
        if preempt:
            if self.dist.is_main and cfg.requeue:
                preemption.requeue(self.dist.job_id, self.progress.info)
            why = self.watcher.requested or "another rank was signalled"
            raise StopForRequeue(
                f"preempted ({why}): checkpoint saved at epoch {self.epoch + 1}, step "
                f"{self.step_in_epoch}; exit status 3"
            )

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
        self.checkpoints = CheckpointDir(
            self.run_dir / "checkpoints", self.config.keep_last, self.config.async_checkpoint
        )
        self._restore()
        if self.dist.is_main:
            text = self.resolved_config_yaml()
            (self.run_dir / "config.yaml").write_text(text)
            self.progress.info(f"dmltrain: {self.name} -> {self.run_dir}\n{text.rstrip()}")
        self.watcher.deadline = self.strategy.broadcast_object(
            self._deadline() if self.dist.is_main else None
        )
        self._last_save = time.monotonic()

    def _deadline(self) -> float | None:
        """When to checkpoint and stop before the Slurm time limit (rank 0 asks Slurm)."""
        end = preemption.slurm_end_time(self.dist.job_id) if self.dist.job_id else None
        if end is None:
            return None
        deadline = end - 60 * self.config.stop_before_end_minutes
        if deadline <= time.time():  # stopping now would only requeue forever
            self.warn(
                f"--stop-before-end-minutes {self.config.stop_before_end_minutes} is more than "
                f"the time left in job {self.dist.job_id}; not stopping early"
            )
            return None
        return deadline

    # ----- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, best: bool, wait: bool = False) -> None:
        """Every rank contributes (state gathering); rank 0 writes; all wait for the file."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        # Per rank: RNG streams and the partial epoch's metric sums.
        rng = self.strategy.all_gather_object(rng_state())
        epoch_metrics = self.strategy.all_gather_object(self.epoch_metrics)
        if self.dist.is_main:
            state = {
                "model": strip_prefixes(model_state),
                "optimizer": optim_state,
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "scaler": None,
                "epoch": self.epoch,
                "step_in_epoch": self.step_in_epoch,
                "global_step": self.global_step,
                "epoch_metrics": epoch_metrics,
                "rng": rng,
                "world_size": self.dist.world_size,
                "config": self._config_dict(),
                "training_log": self.training_log.rows,
                "best_value": self.best_value,
                "tracking_run_id": None,
            }
            epoch = self.epoch + (self.step_in_epoch > 0)
            self.checkpoints.save(state, epoch, self.global_step, best, wait=wait)
        self.strategy.barrier()
        self._last_save = time.monotonic()

    def _improves_best(self, row: dict[str, Any]) -> bool:
        value = row.get(self.config.best_metric)
        if value is None or value != value:  # missing or NaN
            return False
        better = self.best_value is None or (
            value < self.best_value if self.config.best_mode == "min" else value > self.best_value
        )
        if better:
            self.best_value = value
        return better

    def _config_dict(self) -> dict[str, Any]:
        options = {}
        if dataclasses.is_dataclass(self.options) and not isinstance(self.options, type):
            options = dataclasses.asdict(self.options)
        return {"train": dataclasses.asdict(self.config), "options": options}

    def _restore(self) -> None:
        """Resume (``--resume``) or start from other weights (``--load-weights``)."""
        cfg = self.config
        choice: str | None = None
        if self.dist.is_main:
            if cfg.resume == "auto":
                found = load_latest_valid(self.checkpoints.directory, self.warn)
                choice = None if found is None else str(found[0])
            elif cfg.resume != "never":
                choice = cfg.resume
        choice = self.strategy.broadcast_object(choice)
        if choice is not None:
            state = load_file(Path(choice))
            self._check_resumable(state, Path(choice))
            self._load_state(state, Path(choice), optimizer=True, scheduler=True, counters=True)
            self.progress.info(
                f"dmltrain: resuming from {choice} (epoch {self.epoch + 1}, "
                f"{self.step_in_epoch} steps into it, global step {self.global_step})"
            )
        elif cfg.load_weights:
            path = Path(cfg.load_weights)
            self._load_state(
                load_file(path), path, cfg.load_optimizer, cfg.load_scheduler, cfg.load_epoch
            )
            self.progress.info(f"dmltrain: weights loaded from {cfg.load_weights}")

    def _check_resumable(self, state: dict[str, Any], path: Path) -> None:
        """Batch size, seed and world size fix the data order: they must match. Other
        changed settings are listed in a warning."""
        saved, now = state["config"], self._config_dict()
        before = {**saved["train"], "world size": state["world_size"]}
        current = {**now["train"], "world size": self.dist.world_size}
        for key in ("batch_size", "seed", "world size"):
            if before.get(key) != current.get(key):
                raise UserError(
                    f"cannot resume from {path}: {key} is {current.get(key)!r} now but was "
                    f"{before.get(key)!r}; use the same value, or start a new run "
                    "(--resume never with a new --run-dir)"
                )
        changed = [
            f"{k}: {saved['options'].get(k)!r} -> {v!r}"
            for k, v in now["options"].items()
            if saved["options"].get(k) != v
        ]
        if changed and self.dist.is_main:
            self.warn(f"resuming {path} with changed options: {', '.join(changed)}")

    def _load_state(
        self, state: dict[str, Any], path: Path, optimizer: bool, scheduler: bool, counters: bool
    ) -> None:
        check_model_fits(self.strategy.eval_model(self.model), state["model"], path)
        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.model, state["model"], options=options)
        if optimizer:
            set_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], options=options
            )
        if scheduler and self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if counters:
            self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
            self.global_step = state["global_step"]
            self.epoch_metrics = state["epoch_metrics"][self.dist.rank]
            self.best_value = state.get("best_value")
            self.training_log.rows = list(state["training_log"])
            if "rng" in state and len(state["rng"]) == self.dist.world_size:
                set_rng_state(state["rng"][self.dist.rank])

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
            resumable = self.config.resume == "auto" and list_checkpoints(path / "checkpoints")
            if (path / "training_log.csv").exists() and not resumable:
                error = (
                    f"run directory {path} already holds a run (training_log.csv) with no "
                    "checkpoint to resume; pass a new --run-dir to start another"
                )
            decision = (str(path), error)
        run_dir, error = self.strategy.broadcast_object(decision)
        if error:
            raise UserError(error)
        self.config = dataclasses.replace(self.config, run_dir=run_dir)
        if self.dist.is_main:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
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

"""``BaseTrainer``: the experiment supplies model, data and one step's loss; this runs the loop.

Data loading policy (documented in the README; the samplers and seeds are in
``dmltrain.data``):
- training batches come from one global permutation seeded by ``seed + epoch``; rank r of
  w takes every w-th sample of it (``DistributedSampler``), so for the same global batch
  (``batch_size`` x world size) every world size sees the same samples in each step. The
  last, smaller batch is kept (``drop_last=False``); with w processes the sampler pads
  the epoch to a multiple of w by repeating its first samples;
- each sample is drawn with generators seeded from (seed, epoch, index);
- validation is sharded without padding (rank r takes samples r, r+w, ...) and never
  shuffled, so validation metrics are exact sample-weighted means;
- ``pin_memory`` is on when training on CUDA; workers persist across epochs when used.
"""

import abc
import contextlib
import dataclasses
import inspect
import math
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from dmltrain import data, diagnostics, launch, preemption, threads
from dmltrain.batches import StepOutput, batch_size_of, chunks, split_step_output, to_device
from dmltrain.checkpoint import list_checkpoints
from dmltrain.config import CONCERNS, DistConfig, TrackingConfig, TrainConfig, section, to_yaml
from dmltrain.distributed import Strategy, create_strategy
from dmltrain.errors import NonFiniteError, StopForRequeue, UserError
from dmltrain.launch import DistInfo
from dmltrain.metrics import MetricAccumulator
from dmltrain.nan import NanChecker, NanEvent
from dmltrain.precision import Precision, check_available
from dmltrain.progress import Progress
from dmltrain.resume import Checkpointer, config_dict
from dmltrain.tracking import Tracker, create_tracker
from dmltrain.training_log import TrainingLog, read_training_log


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _RollBack(Exception):
    """Raised in the loop after a non-finite step under ``--on-nan rollback``."""

    def __init__(self, event: NanEvent) -> None:
        super().__init__(event.describe())
        self.event = event


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
    checkpointer: Checkpointer
    watcher: preemption.PreemptionWatcher
    agreement: preemption.AgreementSchedule
    precision: Precision
    nan_checker: NanChecker | None
    ranks: list[dict[str, Any]]  # what each rank reported at start (diagnostics.this_rank)

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
        self.environment = launch.run_environment()
        self.device = torch.device(self.dist.device)
        # Chosen (and checked) now, so bad settings fail before any process starts.
        self.strategy = create_strategy(self.dist, section(self.config, DistConfig))
        check_available(self.config.precision, self.device)
        self.epoch = 0  # epochs completed (the one in progress, 0-based)
        self.step_in_epoch = 0  # optimizer steps done in the epoch in progress
        self.global_step = 0
        self.epoch_metrics: dict[str, Any] | None = None  # partial epoch (mid-epoch resume)
        self.best_value: float | None = None
        self.tracking_run_id: str | None = None
        self.tracker = Tracker()  # rank 0's real one is made in setup
        self.skip_steps: set[tuple[int, int]] = set()  # (epoch, step) dropped by a rollback
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
        sampler: Sampler[tuple[int, int]] = (
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

    def on_after_backward(self) -> None:
        """Called after the backward pass(es) of a step, before gradients are checked,
        clipped and applied."""

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
        self.watcher = preemption.PreemptionWatcher(self._preempt_signals())
        self.agreement = preemption.AgreementSchedule(self.config.preempt_check_seconds)
        try:
            self.setup()
            rows = self._fit()
            self.tracker.finish()
            return rows
        except StopForRequeue:
            self.tracker.finish(preempted=True)
            raise
        except Exception as exc:
            self.tracker.finish()
            lost = self.strategy.lost_peer(exc)
            if lost is None:
                raise
            raise lost from exc
        finally:
            if hasattr(self, "watcher"):
                self.watcher.restore()
            if hasattr(self, "checkpointer") and self.dist.is_main:
                try:
                    self.checkpointer.wait()  # never exit with a write half done
                except UserError as exc:
                    self.warn(str(exc))
            self.strategy.teardown()

    def _fit(self) -> list[dict[str, Any]]:
        self.on_train_start()
        epochs_this_job = 0
        if self.epoch >= self.config.epochs:  # e.g. a later job of a chain
            self.progress.info(
                f"dmltrain: the run has done its {self.config.epochs} epoch(s) already; "
                "nothing left to train (raise --epochs to go on)"
            )
        while self.epoch < self.config.epochs:
            epoch = self.epoch
            self.on_epoch_start(epoch)
            started = time.perf_counter()
            try:
                train_metrics = self.train_epoch(epoch)
            except _RollBack as rollback:
                self._roll_back(rollback.event)
                continue
            val_metrics = self.validate() if self.val_loader is not None else {}
            lr = self.optimizer.param_groups[0]["lr"]
            if self.scheduler is not None and self.scheduler_interval == "epoch":
                self.scheduler.step()
            row: dict[str, Any] = {"epoch": epoch + 1}
            row.update({f"train_{k}": v for k, v in train_metrics.items()})
            row.update({f"val_{k}": v for k, v in val_metrics.items()})
            row.update(lr=lr, epoch_time_s=round(time.perf_counter() - started, 3))
            if self.precision.scaler is not None:  # fp16 steps dropped on overflow, in all
                row["skipped_steps"] = int(self.precision.skipped)
            self.training_log.rows.append(row)
            if self.dist.is_main:
                self.training_log.write()
            self.progress.epoch_summary(row)
            self.on_epoch_end(epoch, row)
            self.epoch, self.step_in_epoch, self.epoch_metrics = epoch + 1, 0, None
            best = self._improves_best(row)
            self.tracker.log(row, self.global_step)
            if best:
                metric = self.config.best_metric
                self.tracker.summary({f"best_{metric}": self.best_value, "best_epoch": epoch + 1})
            epochs_this_job += 1
            per_job = self.config.epochs_per_job
            stop_job = bool(per_job) and epochs_this_job >= per_job
            self.checkpointer.save(best=best, must=stop_job or self.epoch >= self.config.epochs)
            if stop_job and self.epoch < self.config.epochs:
                raise StopForRequeue(
                    f"{epochs_this_job} epoch(s) done in this job (--epochs-per-job), "
                    f"{self.epoch}/{self.config.epochs} in all; exit status 3: requeue to go on"
                )
        self.on_train_end()
        if self.dist.is_main:
            self.checkpointer.wait()
        return self.training_log.rows

    def train_epoch(self, epoch: int) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        sampler = self.train_loader.sampler
        if isinstance(sampler, data.ResumableSampler):
            sampler.set_epoch(epoch)
            sampler.start = self.step_in_epoch * cfg.grad_accum * cfg.batch_size
        metrics = MetricAccumulator(self.device)
        if self.epoch_metrics is not None:  # resumed mid-epoch: continue its averages
            metrics.load_state_dict(self.epoch_metrics)
        steps = self.step_in_epoch + math.ceil(len(self.train_loader) / cfg.grad_accum)
        groups = self.progress.epoch(
            chunks(data.iterate(self.train_loader), cfg.grad_accum), epoch + 1, cfg.epochs, steps
        )
        for step, micro_batches in enumerate(groups, start=self.step_in_epoch + 1):
            if (epoch + 1, step) not in self.skip_steps:  # not dropped by a rollback
                self._optimizer_step(micro_batches, metrics, epoch + 1, step)
            self.global_step += 1
            self.step_in_epoch = step
            # rank 0's running means, read at the log interval only
            shown = self.progress.step(step, metrics.count, metrics.compute, self.tracker.active)
            if shown is not None and self.tracker.active:
                self._track_step(shown)
            self._step_boundary(metrics)
        return metrics.compute(self.strategy.all_reduce_sum)

    def _track_step(self, shown: dict[str, float]) -> None:
        values = {f"train/{k}": v for k, v in shown.items()}
        values["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.precision.scale is not None:
            values["train/grad_scale"] = float(self.precision.scale)
            values["train/skipped_steps"] = int(self.precision.skipped)
        self.tracker.log(values, self.global_step)

    def _optimizer_step(
        self, micro_batches: list[Any], metrics: MetricAccumulator, epoch: int, step: int
    ) -> None:
        """Forward and backward of each micro-batch, checks, clipping, the update.

        This is the loop's own cost over a hand-written one (benchmarks/overhead.py), so the
        usual step (one micro-batch, no anomaly mode, fp32) enters no context and calls few
        Python functions: each costs a microsecond or more between torch's kernels."""
        cfg, precision, checker = self.config, self.precision, self.nan_checker
        self.optimizer.zero_grad()  # set_to_none is the default
        results = []
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            batch = to_device(batch, self.device)
            if i == last and not cfg.detect_anomaly:
                loss, step_metrics = self._forward_backward(batch, last + 1)
            else:
                with self._micro_batch_context(last=i == last):
                    loss, step_metrics = self._forward_backward(batch, last + 1)
            results.append((loss.detach(), step_metrics, batch_size_of(batch)))
        self.on_after_backward()
        self.strategy.sync_gradients(self.optimizer)
        if cfg.grad_clip or checker is not None:
            precision.unscale(self.optimizer)
        if checker is not None:
            losses = torch.stack([loss.float() for loss, _, _ in results])
            flags = checker.flags(losses, gradients=precision.scaler is None, parameters=False)
            event = checker.agree(flags, epoch, step, self.global_step + 1)
            if event is not None:
                self._on_nan(event)
                return  # skipped on every rank
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.strategy.optimizer_step(precision.step, self.optimizer)
        if checker is not None:
            flags = checker.flags(None, gradients=False, parameters=True)
            event = checker.agree(flags, epoch, step, self.global_step + 1)
            if event is not None:
                self._on_nan(event)  # an update cannot be dropped: raise or roll back
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        for loss, step_metrics, n in results:
            metrics.update({"loss": loss, **step_metrics}, n)

    def _forward_backward(
        self, batch: Any, micro_batches: int
    ) -> tuple[Tensor, Mapping[str, Tensor | float]]:
        """``train_step`` under the precision's autocast, then its (scaled) backward."""
        precision = self.precision
        loss, step_metrics = split_step_output(precision.forward(self.train_step, batch))
        precision.backward(loss / micro_batches if micro_batches > 1 else loss)
        return loss, step_metrics

    def _micro_batch_context(self, last: bool) -> contextlib.ExitStack:
        """Around forward and backward of a micro-batch: no gradient sync before the last
        one of an accumulation; anomaly mode when asked for."""
        stack = contextlib.ExitStack()
        if not last:
            stack.enter_context(self.strategy.no_sync(self.model))
        if self.config.detect_anomaly:
            stack.enter_context(torch.autograd.detect_anomaly())
        return stack

    def _on_nan(self, event: NanEvent) -> None:
        """Act on a non-finite step, the same way on every rank."""
        assert self.nan_checker is not None
        mode = self.config.on_nan
        if mode == "skip" and event.kind == "parameter":
            mode = "rollback"  # the update is applied already: only a checkpoint undoes it
        if mode == "skip":
            self.nan_checker.record(event, "step skipped on every rank", self.progress.info)
        elif mode == "rollback":
            self.nan_checker.record(
                event, "rolling back to the last checkpoint", self.progress.info
            )
            raise _RollBack(event)
        else:
            line = self.nan_checker.record(event, "stopping", None)  # the exit line says it
            latest = list_checkpoints(self.checkpointer.files.directory)
            kept = f"; last good checkpoint: {latest[0]}" if latest else "; no checkpoint yet"
            raise NonFiniteError(line + kept + f" (report: {self.nan_checker.report})")

    def _roll_back(self, event: NanEvent) -> None:
        """Reload the newest checkpoint on every rank and mark the bad step to be skipped."""
        self.checkpointer.wait()
        skip = self.skip_steps | {(event.epoch, event.step)}
        path = self.checkpointer.rollback()
        self.skip_steps |= skip
        self.progress.info(
            f"dmltrain: rolled back to {path}; epoch {event.epoch} step {event.step} "
            "will be skipped"
        )

    def _step_boundary(self, metrics: MetricAccumulator) -> None:
        """Checkpoint when due; on preemption (agreed by all ranks) save and stop."""
        cfg = self.config
        due = (
            bool(cfg.checkpoint_every_steps) and self.global_step % cfg.checkpoint_every_steps == 0
        )
        preempt = timed = False
        if self.agreement.due():  # every --preempt-check-seconds (AgreementSchedule)
            timed = bool(cfg.checkpoint_every_minutes) and (
                time.monotonic() - self.checkpointer.last_save >= 60 * cfg.checkpoint_every_minutes
            )
            request, wait = self.watcher.local_request(), self.agreement.proposal()
            agreed = self.strategy.max_over_ranks([request, timed, -wait])
            preempt, timed = bool(agreed[0]), bool(agreed[1])
            self.agreement.agreed(-agreed[2])  # the smallest proposal
        if not (preempt or due or timed):
            return
        self.epoch_metrics = metrics.state_dict()
        self.checkpointer.save(best=False, must=preempt)  # the process exits right after
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
            for batch in data.iterate(self.val_loader):
                batch = to_device(batch, self.device)
                step_metrics = self.precision.forward(self.val_step, batch)
                metrics.update(step_metrics, batch_size_of(batch))
        finally:
            self.model = wrapped
        return metrics.compute(self.strategy.all_reduce_sum)

    # ----- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Processes, run directory, model, data, optimizer: everything ``fit`` needs."""
        self.dist = self.strategy.setup()
        self.device = torch.device(self.dist.device)
        self.progress = Progress(
            self.config.progress,
            self.dist.is_main,
            self.config.log_every,
            world_size=self.dist.world_size,
        )
        self.run_dir = self._prepare_run_dir()
        cfg = self.config
        # Every rank's host and CPUs: each takes its share of its cores (dmltrain.threads).
        self.ranks = self.strategy.all_gather_object(
            diagnostics.this_rank(self.dist, self.environment)
        )
        for rank, entry in enumerate(self.ranks):
            choice = threads.choose(cfg.threads, cfg.num_workers, self.ranks, rank)
            entry.update(threads=choice.threads, threads_why=choice.why)
        torch.set_num_threads(self.ranks[self.dist.rank]["threads"])
        self.precision = Precision(cfg.precision, self.device)
        self._setup_model()
        self._setup_data()
        optimizer = self.create_optimizer(self.model)
        self.optimizer = self.strategy.wrap_optimizer(optimizer, self.model, cfg.grad_accum)
        self.scheduler = self.create_scheduler(self.optimizer)
        self.training_log = TrainingLog(self.run_dir / "training_log.csv")
        self.nan_checker = self._create_nan_checker() if cfg.check_nans else None
        self.checkpointer = Checkpointer(self, self.run_dir / "checkpoints")
        self.checkpointer.restore()
        if cfg.check_nans and cfg.on_nan == "rollback" and self.global_step == 0:
            self.checkpointer.save(best=False)  # something to roll back to from step 1
        self._start_records()

    def _setup_model(self) -> None:
        """The same initial weights on every rank, on the device, wrapped for the strategy."""
        torch.manual_seed(self.config.seed)
        model = self.create_model().to(self.device)
        seed_everything(self.config.seed + self.dist.rank)  # per-rank dropout, augmentation
        self.model = self.strategy.wrap_model(model, self.fsdp_units(model), self.precision.dtype)
        if self.config.compile:
            self.model = torch.compile(self.model)  # type: ignore[assignment]

    def _setup_data(self) -> None:
        """prepare_data on one process per node, then every rank's datasets and loaders."""
        if self.dist.is_local_main:
            self.prepare_data()
        self.strategy.barrier()
        train_set, val_set = self.create_datasets()
        if len(train_set) == 0:  # type: ignore[arg-type]
            raise UserError("the training dataset is empty: check --data-dir")
        seed = self.config.seed
        train_set = data.SeededSamples(train_set, seed) if _indexed(train_set) else train_set
        if val_set is not None and _indexed(val_set):
            val_set = data.SeededSamples(val_set, seed)
        self.train_loader = self.create_dataloader(train_set, train=True)
        self.val_loader = None if val_set is None else self.create_dataloader(val_set, False)

    def _create_nan_checker(self) -> NanChecker:
        return NanChecker(
            self.strategy.eval_model(self.model),
            self.dist.rank,
            self.dist.world_size,
            self.device,
            self.strategy.all_reduce_sum,
            self.strategy.all_gather_object,
            self.run_dir / "nan_report.txt",
        )

    def _start_records(self) -> None:
        """config.yaml, diagnostics and the tracker (rank 0); the Slurm deadline (all ranks)."""
        if self.dist.is_main:
            text = self.resolved_config_yaml()
            (self.run_dir / "config.yaml").write_text(text)
            self.progress.info(f"dmltrain: {self.name} -> {self.run_dir}\n{text.rstrip()}")
            self._write_diagnostics(self.ranks)
            self.tracker = create_tracker(
                section(self.config, TrackingConfig),
                self.environment.wandb_mode,
                self.run_dir,
                self.tracking_run_id,
                self.name,
                config_dict(self),
                self.progress.info,
            )
            self.tracking_run_id = self.tracker.run_id
        deadline = None
        if self.dist.is_main:  # rank 0 asks Slurm, once
            minutes = self.config.stop_before_end_minutes
            deadline = preemption.stop_deadline(self.dist.job_id, minutes, self.warn)
        self.watcher.deadline = self.strategy.broadcast_object(deadline)

    def _write_diagnostics(self, ranks: list[dict[str, Any]]) -> None:
        try:
            code = Path(inspect.getfile(type(self)))
        except (TypeError, OSError):  # defined in a notebook or an interactive session
            code = Path.cwd()
        info = diagnostics.collect(
            ranks,
            self.dist,
            self.strategy.name,
            self.strategy.backend(),
            code,
            config_dict(self),
            self.environment,
        )
        path = self.run_dir / "diagnostics.json"
        diagnostics.write(info, path)
        self.progress.info(diagnostics.summary(info, path))

    # ----- checkpoints ----------------------------------------------------------------------
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
            error = _run_dir_problem(path)
            resumable = self.config.resume == "auto" and list_checkpoints(path / "checkpoints")
            if error is None and (path / "training_log.csv").exists() and not resumable:
                error = (
                    f"run directory {path} already holds a run (training_log.csv) with no "
                    "checkpoint to resume; pass a new --run-dir to start another"
                )
            decision = (str(path), error)
        run_dir, error = self.strategy.broadcast_object(decision)
        if error:
            raise UserError(error)
        self.config = dataclasses.replace(self.config, run_dir=run_dir)
        return Path(run_dir)

    def _preempt_signals(self) -> list[str]:
        return [n.strip() for n in self.config.preempt_signals.split(",") if n.strip()]

    def _spawn_workers(self) -> list[dict[str, Any]]:
        """``--nprocs N``: start N workers here and wait; one failing stops the others.
        Preemption signals sent to this parent only are passed on to the workers."""
        config = dataclasses.replace(
            self.config, run_dir=self.config.run_dir or self._default_run_dir()
        )
        error = _run_dir_problem(Path(str(config.run_dir)))
        if error:
            raise UserError(error)
        watcher = preemption.PreemptionWatcher(self._preempt_signals())  # forwarded
        try:
            launch.spawn(
                self.dist.world_size,
                _spawned_fit,
                (type(self), self.name, config, self.options, self.dist),
                forward=watcher.take_received,
            )
        finally:
            watcher.restore()
        return read_training_log(Path(str(config.run_dir)) / "training_log.csv")


def _run_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the run directory (it is created here if missing), or None."""
    if path.exists() and not path.is_dir():
        return f"--run-dir {path} is a file, not a directory; pass a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the run directory {path}: {exc.strerror}; pass another --run-dir"
    return None


def _indexed(dataset: Dataset) -> bool:
    """A map-style dataset (samples by index), as opposed to an IterableDataset."""
    return not isinstance(dataset, IterableDataset)


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

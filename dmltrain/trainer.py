"""``BaseTrainer``: the experiment supplies model, data and one step's loss; this runs the loop.

The loop is ``_train``: epochs of steps (``_train_epoch``), each epoch ended by validation
and a row of the training log, with checkpoints when due and a stop when the ranks agree
on one. The parts are other modules': the training state (``state``), checkpoints
(``checkpointer``), preemption, NaN checks (``nan``), precision, the strategy
(``distributed``), the data's samplers and seeds (``data``), the run directory
(``rundir``) and the ``--nprocs`` workers (``processes``).
"""

import contextlib
import dataclasses
import inspect
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from dmltrain import data, diagnostics, launch, preemption, processes, rng, rundir, threads
from dmltrain.batches import batch_size_of, chunks, split_step_output, to_device
from dmltrain.checkpointer import Checkpointer, Saved
from dmltrain.config import (
    CONCERNS,
    CheckpointConfig,
    DistConfig,
    TrackingConfig,
    TrainConfig,
    as_plain,
    section,
    to_yaml,
)
from dmltrain.distributed import Strategy, create_strategy, unwrap
from dmltrain.errors import StopForRequeue, UserError
from dmltrain.hooks import TrainerHooks
from dmltrain.launch import DistInfo
from dmltrain.metrics import MetricAccumulator
from dmltrain.nan import NanChecker, NanEvent
from dmltrain.precision import Precision, check_available
from dmltrain.progress import Progress
from dmltrain.state import TrainState
from dmltrain.tracking import Tracker, create_tracker
from dmltrain.training_log import read_training_log, write_training_log


class BaseTrainer(TrainerHooks):
    """Subclass, implement the three abstract methods (``dmltrain.hooks``: what else you
    may override), then ``MyTrainer(config).fit()``.

    ``options`` is the experiment's own dataclass of settings (or None).
    """

    name = "experiment"  # run directories default to runs/<name>-<job id or time>

    # Set by setup(), before the first epoch.
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    val_loader: DataLoader | None
    strategy: Strategy
    progress: Progress
    run_dir: Path
    state: TrainState  # epoch, steps, best value, log rows (what a checkpoint holds)
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
        self.state = TrainState(self.device)
        self.tracker = Tracker()  # rank 0's real one is made in setup

    # ----- the loop ------------------------------------------------------------------------
    def warn(self, message: str) -> None:
        """A warning on stderr; ranks other than 0 prefix theirs with their rank."""
        prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
        print(f"{prefix}WARNING: {message}", file=sys.stderr, flush=True)

    @property
    def epoch(self) -> int:
        """Epochs completed (the one in progress, 0-based)."""
        return self.state.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.state.step_in_epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken, over all epochs and resumes."""
        return self.state.global_step

    def fit(self) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs; returns the training log's rows. Raises
        ``StopForRequeue`` (exit status 3) when the run stopped to go on in a later job."""
        if self.dist.starts_workers:
            return self._spawn_workers()
        # Signals are caught from here on (setup can take long); the loop acts on them.
        self.watcher = preemption.PreemptionWatcher(self._preempt_signals())
        self.agreement = preemption.AgreementSchedule(self.config.preempt_check_seconds)
        try:
            self.setup()
            stopped = self._train()
            self.tracker.finish(preempted=stopped is not None)
        except Exception as exc:
            self.tracker.finish()
            lost = self.strategy.lost_peer(exc)
            if lost is None:
                raise
            raise lost from exc
        finally:
            self.watcher.restore()
            if hasattr(self, "checkpointer"):
                self.checkpointer.close()  # never exit with a write half done
            self.strategy.teardown()
        if stopped is not None:
            raise StopForRequeue(stopped)
        return self.state.log_rows

    def _train(self) -> str | None:
        """The run, epoch by epoch. Returns why it stopped before its last epoch (to go on
        in a later job), or None when every epoch is done."""
        cfg, s = self.config, self.state
        self.on_train_start()
        if s.epoch >= cfg.epochs:  # e.g. a later job of a chain
            self.progress.info(
                f"dmltrain: the run has done its {cfg.epochs} epoch(s) already; "
                "nothing left to train (raise --epochs to go on)"
            )
        epochs_this_job = 0
        while s.epoch < cfg.epochs:
            epoch, started = s.epoch, time.perf_counter()
            self.on_epoch_start(epoch)
            outcome = self._train_epoch()
            if isinstance(outcome, NanEvent):  # --on-nan rollback
                self._roll_back(outcome)
                continue
            if outcome is not None:  # preempted; the checkpoint is saved
                return outcome
            row = self._epoch_row(started)
            s.log_rows.append(row)
            if self.dist.is_main:
                write_training_log(self.run_dir / "training_log.csv", s.log_rows)
            self.progress.epoch_summary(row)
            self.on_epoch_end(epoch, row)
            s.end_epoch()
            best = s.improves(row.get(cfg.best_metric), cfg.best_mode)
            self.tracker.log(row, s.global_step)
            if best:
                self.tracker.summary(
                    {f"best_{cfg.best_metric}": s.best_value, "best_epoch": s.epoch}
                )
            epochs_this_job += 1
            stop = None
            if (
                cfg.epochs_per_job
                and epochs_this_job >= cfg.epochs_per_job
                and s.epoch < cfg.epochs
            ):
                stop = (
                    f"{epochs_this_job} epoch(s) done in this job (--epochs-per-job), "
                    f"{s.epoch}/{cfg.epochs} in all; exit status 3: requeue to go on"
                )
            last = s.epoch >= cfg.epochs
            self.checkpointer.maybe_save(
                epoch_end=True, best=best, stopping=stop is not None, last=last
            )
            if stop is not None:
                return stop
        self.on_train_end()
        self.checkpointer.wait()
        return None

    def _train_epoch(self) -> str | NanEvent | None:
        """The epoch's steps from where the run is. Returns why the run stops here
        (preempted), the non-finite step to roll back from, or None at the epoch's end."""
        cfg, s = self.config, self.state
        epoch = s.epoch + 1  # 1-based, as printed and logged
        self.model.train()
        sampler = self.train_loader.sampler
        if isinstance(sampler, data.ResumableSampler):
            sampler.set_epoch(s.epoch)
            sampler.start = s.step_in_epoch * cfg.grad_accum * cfg.batch_size
        steps = s.step_in_epoch + math.ceil(len(self.train_loader) / cfg.grad_accum)
        batches = chunks(data.iterate(self.train_loader), cfg.grad_accum)
        for step, micro_batches in enumerate(
            self.progress.epoch(batches, epoch, cfg.epochs, steps), start=s.step_in_epoch + 1
        ):
            if (epoch, step) not in s.skip_steps:  # not dropped by a rollback
                event = self._optimizer_step(micro_batches, epoch, step)
                if event is not None:
                    return event
            s.global_step += 1
            s.step_in_epoch = step
            # rank 0's running means, read at the log interval only
            shown = self.progress.step(
                step, s.metrics.count, s.metrics.compute, self.tracker.active
            )
            if shown is not None and self.tracker.active:
                self._track_step(shown)
            stopping, timed = preemption.agree(
                self.agreement, self.watcher, self.strategy.max_over_ranks,
                self.checkpointer.minutes_due,
            )  # fmt: skip
            self.checkpointer.maybe_save(minutes=timed, stopping=stopping)
            if stopping:
                return self._stop_for_preemption()
        return None

    def _epoch_row(self, started: float) -> dict[str, Any]:
        """The epoch's training means, validation, the scheduler's epoch step: the row of
        the training log."""
        train = self.state.metrics.compute(self.strategy.all_reduce_sum)
        val = self.validate() if self.val_loader is not None else {}
        lr = self.optimizer.param_groups[0]["lr"]
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        row: dict[str, Any] = {"epoch": self.state.epoch + 1}
        row.update({f"train_{k}": v for k, v in train.items()})
        row.update({f"val_{k}": v for k, v in val.items()})
        row.update(lr=lr, epoch_time_s=round(time.perf_counter() - started, 3))
        if self.precision.scaler is not None:  # fp16 steps dropped on overflow, in all
            row["skipped_steps"] = int(self.precision.skipped)
        return row

    def _track_step(self, shown: dict[str, float]) -> None:
        values = {f"train/{k}": v for k, v in shown.items()}
        values["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.precision.scale is not None:
            values["train/grad_scale"] = float(self.precision.scale)
            values["train/skipped_steps"] = int(self.precision.skipped)
        self.tracker.log(values, self.global_step)

    def _optimizer_step(self, micro_batches: list[Any], epoch: int, step: int) -> NanEvent | None:
        """Forward and backward of each micro-batch, checks, clipping, the update. Returns
        the non-finite step to roll back from (``--on-nan rollback``), else None.

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
                return self._on_nan(event)  # the step is dropped on every rank
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.strategy.optimizer_step(precision.step, self.optimizer)
        if checker is not None:
            flags = checker.flags(None, gradients=False, parameters=True)
            event = checker.agree(flags, epoch, step, self.global_step + 1)
            if event is not None:
                return self._on_nan(event)  # an update cannot be dropped: raise or roll back
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        for loss, step_metrics, n in results:
            self.state.metrics.update({"loss": loss, **step_metrics}, n)
        return None

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

    def _on_nan(self, event: NanEvent) -> NanEvent | None:
        assert self.nan_checker is not None
        mode, newest = self.config.on_nan, self.checkpointer.newest
        return self.nan_checker.act(event, mode, self.progress.info, newest)

    def _roll_back(self, event: NanEvent) -> None:
        """Every rank reloads the newest checkpoint; the bad step will be skipped."""
        path = self.checkpointer.rollback()
        self.state.skip_steps.add((event.epoch, event.step))
        self.progress.info(
            f"dmltrain: rolled back to {path}; epoch {event.epoch} step {event.step} "
            "will be skipped"
        )

    def _stop_for_preemption(self) -> str:
        """After the preemption checkpoint: ask Slurm to requeue; why the run stops."""
        if self.dist.is_main and self.config.requeue:
            preemption.requeue(self.dist.job_id, self.progress.info)
        why = self.watcher.requested or "another rank was signalled"
        return (
            f"preempted ({why}): checkpoint saved at epoch {self.state.epoch + 1}, step "
            f"{self.state.step_in_epoch}; exit status 3"
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
        """Processes, run directory, model, data, optimizer, state: everything ``fit`` needs."""
        self.dist = self.strategy.setup()
        self.device = torch.device(self.dist.device)
        cfg = self.config
        self.progress = Progress(cfg.progress, self.dist.is_main, cfg.log_every,
                                 world_size=self.dist.world_size)  # fmt: skip
        default = rundir.default_path(self.name, self.dist.job_id)
        self.run_dir = rundir.choose(
            cfg.run_dir, default, cfg.resume, self.dist.is_main, self.strategy.broadcast_object
        )
        self.config = cfg = dataclasses.replace(cfg, run_dir=str(self.run_dir))
        # Every rank's host and CPUs: each takes its share of its cores (dmltrain.threads).
        self.ranks = self.strategy.all_gather_object(
            diagnostics.this_rank(self.dist, self.environment)
        )
        threads.assign(cfg.threads, cfg.num_workers, self.ranks)
        torch.set_num_threads(self.ranks[self.dist.rank]["threads"])
        self.precision = Precision(cfg.precision, self.device)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = self.create_model().to(self.device)
        rng.seed_everything(cfg.seed + self.dist.rank)  # per-rank dropout, augmentation
        self.model = self.strategy.wrap_model(model, self.fsdp_units(model), self.precision.dtype)
        if cfg.compile:
            self.model = torch.compile(self.model)  # type: ignore[assignment]
        self._setup_data()
        optimizer = self.create_optimizer(self.model)
        self.optimizer = self.strategy.wrap_optimizer(optimizer, self.model, cfg.grad_accum)
        self.scheduler = self.create_scheduler(self.optimizer)
        self.state = TrainState(self.device)  # on the device chosen by the strategy
        self.nan_checker = None
        if cfg.check_nans:
            self.nan_checker = NanChecker(
                unwrap(self.model), self.dist.rank, self.dist.world_size, self.device,
                self.strategy.all_reduce_sum, self.strategy.all_gather_object,
                self.run_dir / "nan_report.txt",
            )  # fmt: skip
        saved = Saved(self.model, self.optimizer, self.scheduler, self.precision, self.state)
        self.checkpointer = Checkpointer(
            section(cfg, CheckpointConfig), self.run_dir / "checkpoints", saved, self.strategy,
            self.config_dict(), self.progress.info, self.warn,
        )  # fmt: skip
        self.checkpointer.restore()
        if cfg.check_nans and cfg.on_nan == "rollback" and self.state.global_step == 0:
            self.checkpointer.save(best=False)  # something to roll back to from step 1
        self._start_records()

    def _setup_data(self) -> None:
        """prepare_data on one process per node, then every rank's datasets and loaders."""
        if self.dist.is_local_main:
            self.prepare_data()
        self.strategy.barrier()
        train_set, val_set = self.create_datasets()
        if len(train_set) == 0:  # type: ignore[arg-type]
            raise UserError("the training dataset is empty: check --data-dir")
        seed = self.config.seed
        self.train_loader = self.create_dataloader(data.keyed(train_set, seed), train=True)
        self.val_loader = None
        if val_set is not None:
            self.val_loader = self.create_dataloader(data.keyed(val_set, seed), train=False)

    def _start_records(self) -> None:
        """config.yaml, diagnostics and the tracker (rank 0); the Slurm deadline (all ranks)."""
        deadline = None
        if self.dist.is_main:
            text = self.resolved_config_yaml()
            self.progress.info(f"dmltrain: {self.name} -> {self.run_dir}\n{text.rstrip()}")
            try:
                code = Path(inspect.getfile(type(self)))
            except (TypeError, OSError):  # defined in a notebook or an interactive session
                code = Path.cwd()
            strategy, plain = self.strategy, self.config_dict()
            info = diagnostics.collect(self.ranks, self.dist, strategy.name, strategy.backend(),
                                       code, plain, self.environment)  # fmt: skip
            self.progress.info(rundir.write_records(self.run_dir, text, info))
            self.tracker = create_tracker(
                section(self.config, TrackingConfig), self.environment.wandb_mode, self.run_dir,
                self.state.tracking_run_id, self.name, plain, self.progress.info,
            )  # fmt: skip
            self.state.tracking_run_id = self.tracker.run_id
            minutes = self.config.stop_before_end_minutes  # rank 0 asks Slurm, once
            deadline = preemption.stop_deadline(self.dist.job_id, minutes, self.warn)
        self.watcher.deadline = self.strategy.broadcast_object(deadline)

    def config_dict(self) -> dict[str, Any]:
        """The resolved config as plain values (``config.as_plain``)."""
        return as_plain(self.config, self.options)

    def resolved_config_yaml(self) -> str:
        groups = [(title, section(self.config, cls)) for title, cls in CONCERNS]
        if dataclasses.is_dataclass(self.options):
            groups.append((f"{self.name} options", self.options))
        return to_yaml(groups)

    def _preempt_signals(self) -> list[str]:
        return [n.strip() for n in self.config.preempt_signals.split(",") if n.strip()]

    def _spawn_workers(self) -> list[dict[str, Any]]:
        """``--nprocs N``: start N workers here and wait (``processes.spawn``)."""
        run_dir = self.config.run_dir or rundir.default_path(self.name, self.dist.job_id)
        rundir.check(Path(run_dir))
        config = dataclasses.replace(self.config, run_dir=run_dir)
        args = (type(self), self.name, config, self.options, self.dist)
        processes.spawn(self.dist.world_size, _spawned_fit, args, self._preempt_signals())
        return read_training_log(Path(run_dir) / "training_log.csv")


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
    processes.exit_on_error(trainer.fit, trainer.dist.rank, trainer.dist.world_size)

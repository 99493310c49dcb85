"""``BaseTrainer``: the experiment supplies model, data and one step's loss; this runs the loop.

``fit`` sets up and runs ``_train``: epochs (``_train_epoch``) of optimizer steps
(``dmltrain.step``), each epoch ended by validation and a row of the training log
(``_end_epoch``), checkpoints when due (``checkpointer``), and a stop when the ranks agree
on one (``preemption``, ``budget``). Everything else is composed from the module of
its concern: ``state``, ``nan``, ``precision``, ``distributed``, ``data``, ``rundir``,
``processes``.
"""

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dmltrain import (
    callback,
    contract,
    data,
    diagnostics,
    evaluation,
    launch,
    monitor,
    preemption,
    processes,
    profiling,
    progress,
    rng,
    rundir,
    threads,
)
from dmltrain.batches import chunks
from dmltrain.budget import Budget, Done, total_steps
from dmltrain.callback import Events
from dmltrain.checkpointer import Checkpointer, Saved
from dmltrain.config import LoopConfig, TrainConfig, as_plain, per_process_batch, to_yaml
from dmltrain.distributed import Strategy, create_strategy, unwrap
from dmltrain.ema import EMA
from dmltrain.errors import PeerLost, StopForRequeue, UserError
from dmltrain.files import NotWritten
from dmltrain.hooks import TrainerHooks
from dmltrain.launch import DistInfo
from dmltrain.monitor import Monitor, StepClock, peak_flops
from dmltrain.nan import NanChecker, NanEvent
from dmltrain.precision import Precision, check_available
from dmltrain.progress import Progress
from dmltrain.state import TrainState
from dmltrain.step import ManualStep, OptimizerStep, check_first_forward
from dmltrain.tracking import Tracker, create_trackers
from dmltrain.training_log import StepsLog, read_training_log, write_training_log
from dmltrain.watchdog import Watchdog


class BaseTrainer(TrainerHooks):
    """Subclass, implement the three abstract methods (``dmltrain.hooks``: what else you
    may override), then ``MyTrainer(config).fit()``.

    ``options`` is the experiment's own dataclass of settings (or None).
    """

    # Run directories default to runs/<name>-<job id or time>; the CLI sets the registered
    # name, and a class that sets none is named after itself (e.g. one from a notebook).
    name = "experiment"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name == "experiment":
            cls.name = cls.__name__.lower()

    # Set by setup(), before the first epoch.
    model: nn.Module
    optimizers: tuple[Any, ...]  # create_optimizer's, wrapped by the strategy
    optimizer: Any  # the first of them
    scheduler: Any  # create_scheduler's
    train_loader: DataLoader
    val_loader: DataLoader | None
    strategy: Strategy
    _progress: Progress
    run_dir: Path
    _state: TrainState  # epoch, steps, best value, log rows (what a checkpoint holds)
    _checkpointer: Checkpointer
    _watcher: preemption.PreemptionWatcher
    _agreement: preemption.AgreementSchedule
    _steps_log: StepsLog  # steps.csv (rank 0)
    _ema: EMA | None  # the averaged weights (--ema-decay)
    _step_clock: StepClock  # each step's time in the loader and in train_step (monitor)
    _monitor: Monitor  # throughput, data stalls, stragglers at each log interval
    _watchdog: Watchdog | None  # hangs (--hang-timeout)
    _profiler: profiling.Profiler | None  # --profile-steps, --memory-snapshot
    _best_metric: str  # of the training log: best.pt and early stopping
    _budget: Budget  # when the run is done: epochs, steps, time, early stopping
    total_steps: int  # optimizer steps by --epochs and --max-steps, known before the first
    _precision: Precision
    _nan_checker: NanChecker | None
    _step: OptimizerStep | ManualStep  # one optimizer step (dmltrain.step)
    _epochs_this_job: int
    _ranks: list[dict[str, Any]]  # what each rank reported at start (diagnostics.this_rank)
    _evaluator: evaluation.Evaluator  # validation, --evaluate and --predict over a loader

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
            dist = launch.detect(self.config.distributed.launcher, self.config.distributed.nprocs)
        self.dist = dist
        batch = per_process_batch(self.config.loop, dist.world_size)
        given = self.config.loop.batch_size
        if batch != given and given != LoopConfig().batch_size and dist.is_main:
            self.warn(f"--global-batch-size {self.config.loop.global_batch_size} on "
                      f"{dist.world_size} process(es) sets --batch-size {batch}, not the "
                      f"{given} given")  # fmt: skip
        self.config = self.config.replace(batch_size=batch)
        self.environment = launch.run_environment()
        self.device = torch.device(self.dist.device)
        # Chosen (and checked) now, so bad settings fail before any process starts.
        self.strategy = create_strategy(self.dist, self.config.distributed)
        check_available(self.config.numerics.precision, self.device)
        profiling.check_available(self.config.profiling, self.device)
        self.config.profiling.profiled(dist.world_size)  # a rank beyond the job's is refused
        self._state = TrainState(self.device)
        self._tracker = Tracker()  # rank 0's real one is made in setup
        self._watchdog = None  # made in setup when training
        self._profiler = None  # made in setup when asked for
        self._events = Events()  # the callbacks' listeners, made in setup

    # ----- the loop ------------------------------------------------------------------------
    def warn(self, message: str) -> None:
        """A warning on stderr; ranks other than 0 prefix theirs with their rank."""
        prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
        print(f"{prefix}WARNING: {message}", file=sys.stderr, flush=True)

    @property
    def epoch(self) -> int:
        """Epochs completed (the one in progress, 0-based)."""
        return self._state.epoch

    @property
    def step_in_epoch(self) -> int:
        return self._state.step_in_epoch

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model as ``create_model`` made it, without the DDP or ``torch.compile``
        wrapper: its parameter names are the experiment's (under FSDP its parameters are
        the ranks' shards)."""
        return unwrap(self.model)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken, over all epochs and resumes."""
        return self._state.global_step

    def fit(self) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs; returns the training log's rows. Raises
        ``StopForRequeue`` (exit status 3) when the run stopped to go on in a later job."""
        if self.dist.starts_workers:
            return self._spawn_workers()
        try:
            rows = self._fit()
        except BaseException as exc:
            self._close(exc)
            self._record_outcome(exc)
            raise
        self._close(None)
        self._record_outcome(None)
        return rows

    def _close(self, error: BaseException | None) -> None:
        """The callbacks' ``on_close``; one that fails while the run fails already is a
        warning, so the run's own error is the one reported."""
        for call in self._events.on_close:
            try:
                call(self, error)
            except Exception as exc:
                if error is None:
                    raise
                self.warn(f"a callback's on_close failed too: {exc!r}")

    def log_metrics(self, values: dict[str, Any], step: int | None = None) -> None:
        """Scalars (numbers or one-element tensors) to the trackers, by the names given, at
        ``step`` (default ``global_step``: the steps done; inside a step, as in
        ``on_before_optimizer_step``, the one being taken is ``global_step + 1``). Rank 0
        logs, other ranks do nothing. A tensor is read from the device here: log every N
        steps, not every step, to keep the steps asynchronous."""
        if self.dist.is_main and self._tracker.active:
            at = self.global_step if step is None else step
            self._tracker.log({k: float(v) for k, v in values.items()}, at)

    def _record_outcome(self, exc: BaseException | None) -> None:
        """Rank 0: how this job of the run ended, in RUN_DIR/outcome.json (read by
        ``dmltrain sweep status``). An evaluation leaves the run's record alone, and so does
        a job refused before it trained (a resume with other settings, checkpoints that do
        not load) in a directory that holds a run; a run's first job records its refusal."""
        evaluating = self.config.checkpoint.evaluating
        if not self.dist.is_main or not hasattr(self, "run_dir") or evaluating:
            return
        refused = isinstance(exc, UserError) and not self._state.training
        if refused and rundir.holds_run(self.run_dir):
            return
        rundir.write_outcome(self.run_dir, exc, self._state.global_step)

    def _fit(self) -> list[dict[str, Any]]:
        # Signals are caught from here on (setup can take long); the loop acts on them.
        self._watcher = preemption.PreemptionWatcher(
            self.config.preemption.signal_names(), worker=self.dist.spawned
        )
        self._agreement = preemption.AgreementSchedule(self.config.preemption.preempt_check_seconds)
        evaluating, results = self.config.checkpoint.evaluating, None
        try:
            self.setup()
            stopped, results = (None, [self._evaluate()]) if evaluating else (self._train(), None)
            self._tracker.finish(preempted=stopped is not None)
        except torch.OutOfMemoryError as exc:
            self._tracker.finish()
            raise profiling.out_of_memory(
                exc, self.run_dir / "profile", self.dist.rank, self.device,
                self._state.global_step, self.config.loop.batch_size, self.config.precision,
            ) from exc  # fmt: skip
        except Exception as exc:
            self._tracker.finish()
            lost = self.strategy.lost_peer(exc)
            if lost is None:  # this rank's own failure (or every rank's at once)
                self.strategy.announce_failure(exc)
                bad_data = contract.data(exc)
                if bad_data is not None:
                    raise bad_data from None
                raise
            if self._watchdog is not None and isinstance(lost, PeerLost):  # where a rank hangs
                lost = self._watchdog.explain(lost)
            raise lost from exc
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
            if self._profiler is not None:
                self._profiler.close()
            self._watcher.restore()
            if hasattr(self, "_checkpointer"):
                self._checkpointer.close()  # never exit with a write half done
            if hasattr(self, "_run_dir_held"):
                self._run_dir_held.release()
            self.strategy.teardown()
        if stopped is not None:
            raise StopForRequeue(stopped)
        return results or self._state.log_rows

    def evaluate(self, checkpoint: str | Path, ema: bool = False) -> dict[str, Any]:
        """``--evaluate``: the validation (and test) metrics of ``checkpoint``'s weights (its
        average with ``ema``), written to RUN_DIR/eval_metrics.json. On a trainer not fitted."""
        self.config = self.config.replace(evaluate=str(checkpoint), ema=ema)
        return self.fit()[0]

    def predict(self, checkpoint: str | Path, ema: bool = False) -> Path:
        """``--predict``: ``predict_step``'s outputs with ``checkpoint``'s weights over the test
        (else validation) data; returns RUN_DIR/predictions/predictions.pt."""
        self.config = self.config.replace(predict=str(checkpoint), ema=ema)
        return Path(self.fit()[0]["predictions"])

    def _train(self) -> str | None:
        """The run, epoch by epoch, until it is done (``budget``). Returns why it stopped
        before that (to go on in a later job), or None when it is done."""
        epochs, s, budget = self.config.loop.epochs, self._state, self._budget
        self.on_train_start()
        self._fire(self._events.on_train_start)
        budget.start()
        if self._watchdog is not None:
            self._watchdog.start()
        if self._profiler is not None:
            self._profiler.at(s.global_step)
        before = budget.reason(budget.time_done()) or budget.stopped_early()
        if s.epoch >= epochs or before:  # e.g. a later job of a chain
            self._progress.info(
                f"dmltrain: the run is done already ({before or f'{epochs} epoch(s)'}); "
                "nothing left to train (raise the limit to go on)"
            )
        done = before
        self._epochs_this_job = 0
        while s.epoch < epochs and done is None:
            epoch, started = s.epoch, time.perf_counter()
            self.on_epoch_start(epoch)
            self._fire(self._events.on_epoch_start)
            outcome = self._train_epoch()
            if isinstance(outcome, NanEvent):  # --on-nan rollback
                self._checkpointer.rollback(outcome.epoch, outcome.step)
                continue
            if isinstance(outcome, str):  # preempted; the checkpoint is saved
                return outcome
            best, done = False, None
            if not (outcome and outcome.validated):
                with self._quiet():
                    best, done = self._end_epoch(epoch, started, partial=outcome is not None)
            timed = budget.time_agreed(self.strategy.max_over_ranks)
            done = done or (outcome and outcome.reason) or budget.reason(timed)
            stop = None if done else budget.job_done(self._epochs_this_job)
            last = s.epoch >= epochs or done is not None
            self._checkpointer.maybe_save(
                epoch_end=True, best=best, stopping=stop is not None, last=last
            )
            if stop is not None:
                return stop
        if done and not before:
            self._progress.info(f"dmltrain: done: {done}")
        self.on_train_end()
        self._fire(self._events.on_train_end)
        self._checkpointer.wait()
        return None

    def _train_epoch(self) -> str | NanEvent | Done | None:
        """The epoch's steps from where the run is. Returns why the run stops here
        (preempted), the non-finite step to roll back from, the budget that ended the run
        in the epoch, or None at the epoch's end."""
        loop, s = self.config.loop, self._state
        epoch, started = s.epoch + 1, time.perf_counter()  # 1-based, as printed and logged
        self.model.train()
        sampler = self.train_loader.sampler
        if isinstance(sampler, data.ResumableSampler):
            sampler.set_epoch(s.epoch)
            sampler.start = s.step_in_epoch * loop.grad_accum * loop.batch_size
        steps = s.step_in_epoch + math.ceil(len(self.train_loader) / loop.grad_accum)
        last = self._budget.last_step_in_epoch(steps)  # of --max-steps, when inside the epoch
        batches = chunks(self._step_clock.batches(data.iterate(self.train_loader)), loop.grad_accum)
        step_end = self._events.on_step_end
        self._step_clock.restart()
        for step, micro_batches in enumerate(
            self._progress.epoch(batches, epoch, loop.epochs, steps), start=s.step_in_epoch + 1
        ):
            if (epoch, step) not in s.skip_steps:  # not dropped by a rollback
                event = self._step.run(micro_batches, epoch, step)
                if event is not None:
                    return event
                if self._ema is not None:
                    self._ema.update(s.global_step + 1)
            s.global_step += 1
            s.step_in_epoch = step
            if self._profiler is not None:
                self._profiler.at(s.global_step)
            self._step_clock.step()
            for call in step_end:
                call(self)
            if self._progress.due(step):  # the log interval, and the epoch's last step
                monitored = self._monitor.interval(s.global_step)  # every rank's clocks
                shown = self._progress.step(  # rank 0's running means, read now only
                    step, s.metrics.count, s.metrics.compute, self.dist.is_main, monitored
                )
                if shown is not None:  # rank 0
                    self._log_step(epoch, shown)
            every = loop.val_every_steps
            if every and s.global_step % every == 0 and step < steps and self.val_loader:
                with self._quiet():
                    best, stop_early = self._end_epoch(s.epoch, started, partial=True)
                self.model.train()
                self._step_clock.restart()
                if best:
                    self._checkpointer.save(best=True)
                if stop_early:
                    return Done(stop_early, validated=True)
            stopping, timed, finished = preemption.agree(
                self._agreement, self._watcher, self.strategy.max_over_ranks,
                self._checkpointer.minutes_due, self._budget.time_done,
            )  # fmt: skip
            self._checkpointer.maybe_save(minutes=timed, stopping=stopping)
            if stopping:
                return self._stop_for_preemption()
            if (finished and step < steps) or step == last:  # a budget ends the run in the epoch
                return Done(self._budget.reason(finished) or "")
        return None

    def _end_epoch(self, epoch: int, started: float, partial: bool) -> tuple[bool, str | None]:
        """Training means, validation and the scheduler's epoch step make the epoch's row of
        the training log; the row is written, shown and tracked. ``partial``: a validation
        inside the epoch (``--val-every-steps``, or a budget that ended the run there): the
        row is the epoch's so far, and the epoch stays in progress (no scheduler step, no
        ``on_epoch_end``). Returns whether the validation is the best so far, and why the
        run stops early (``--early-stop-patience``) or None."""
        s, best_metric = self._state, self._best_metric
        train = s.metrics.compute(self.strategy.all_reduce_sum)
        val = self.validate() if self.val_loader is not None else {}
        if val and self._ema is not None and self.config.loop.ema_eval:
            with self._ema.swapped_in():
                val.update({f"ema_{k}": v for k, v in self.validate().items()})
        lr = self._lr()
        if self.scheduler_interval == "epoch" and not partial:
            for scheduler in self._schedulers:
                scheduler.step()
        row: dict[str, Any] = {"epoch": epoch + 1, "step": s.global_step}
        row.update({f"train_{k}": v for k, v in train.items()})
        row.update({f"val_{k}": v for k, v in val.items()})
        # world_size changes when a run resumes on another number of processes
        row.update(lr=lr, world_size=self.dist.world_size)
        row["epoch_time_s"] = round(time.perf_counter() - started, 3)
        if self._precision.scaler is not None:  # fp16 steps dropped on overflow, in all
            row["skipped_steps"] = int(self._precision.skipped)
        s.log_rows.append(row)
        if self.dist.is_main:
            try:  # the rows are kept (and checkpointed): the next epoch writes them all
                write_training_log(self.run_dir / "training_log.csv", s.log_rows)
            except NotWritten as exc:
                self.warn(f"{exc}; training goes on and writes it again at the next epoch")
        self._progress.epoch_summary(row, partial)
        if val:
            self._fire(self._events.on_validation_end, row)
        if not partial:
            self.on_epoch_end(epoch, row)
            self._fire(self._events.on_epoch_end, row)
            s.end_epoch()
            self._epochs_this_job += 1
        stop_early = self._budget.validated(row)  # counted against the best before it
        best = s.improves(row.get(best_metric), self.config.checkpoint.best_mode)
        self._tracker.log(row, s.global_step)
        if best:
            s.best_at = (epoch + 1, s.global_step)
            self._tracker.summary({f"best_{best_metric}": s.best_value, "best_epoch": epoch + 1})
        return best, self._budget.stopped_early() if stop_early else None

    def _quiet(self) -> contextlib.AbstractContextManager[Any]:
        """No hang watch inside (validation)."""
        return self._watchdog.paused() if self._watchdog is not None else contextlib.nullcontext()

    def _lr(self) -> float:
        """The learning rate shown and logged: the first optimizer's first group's."""
        return float(self.optimizer.param_groups[0]["lr"])

    def _fire(self, listeners: tuple[Any, ...], *args: Any) -> None:
        """An event of the callbacks (``dmltrain.callback``) that is not per step."""
        for call in listeners:
            call(self, *args)

    def _log_step(self, epoch: int, shown: dict[str, float]) -> None:
        """The step scalars at a log interval (rank 0): steps.csv and the tracker."""
        values = {**shown, "lr": self._lr()}
        if self._step.grad_norm is not None:
            values["grad_norm"] = float(self._step.grad_norm)
        if self._precision.scale is not None:
            values["grad_scale"] = float(self._precision.scale)
            values["skipped_steps"] = int(self._precision.skipped)
        self._steps_log.write({"step": self.global_step, "epoch": epoch, **values})
        self._fire(self._events.on_log, values)
        if self._tracker.active:
            self._tracker.log({f"train/{k}": v for k, v in values.items()}, self.global_step)

    def _stop_for_preemption(self) -> str:
        """After the preemption checkpoint: ask Slurm to requeue; why the run stops."""
        if self.dist.is_main and self.config.preemption.requeue:
            preemption.requeue(self.dist.job_id, self._progress.info)
        why = self._watcher.why()
        return (
            f"preempted ({why}): checkpoint saved at epoch {self._state.epoch + 1}, step "
            f"{self._state.step_in_epoch}; exit status 3"
        )

    def backward(self, loss: torch.Tensor, optimizer: Any = None) -> None:
        """In ``train_step`` with ``manual_optimization``: ``loss``'s gradients (scaled with
        fp16, shared among an accumulation's micro-batches). With ``optimizer``, only its
        parameters keep them (a generator's loss leaves the discriminator's gradients)."""
        self._manual("backward").backward(loss, optimizer)

    def optimizer_step(self, optimizer: Any) -> None:
        """In ``train_step`` with ``manual_optimization``: ``optimizer``'s update, its
        gradients averaged over the ranks, unscaled, checked (--check-nans) and clipped
        (--grad-clip); at the last micro-batch of an accumulation, a no-op before it."""
        self._manual("optimizer_step").optimizer_step(optimizer)

    def _manual(self, what: str) -> ManualStep:
        step = getattr(self, "_step", None)
        if not isinstance(step, ManualStep):
            raise UserError(
                f"self.{what}() needs manual_optimization = True on {type(self).__name__} "
                "(then train_step makes its own updates)"
            )
        return step

    def validate(self) -> dict[str, float]:
        """Validation over the ranks' shards, every sample counted once."""
        assert self.val_loader is not None
        with self._evaluating_model():
            return self._evaluator.metrics(self.val_loader, self.val_step)[0]

    @contextlib.contextmanager
    def _evaluating_model(self) -> Iterator[None]:
        """``self.model`` in eval mode, bypassing the DDP wrapper (no collectives)."""
        wrapped, self.model = self.model, self.strategy.eval_model(self.model)
        try:
            self.model.eval()
            yield
        finally:
            self.model = wrapped

    def _evaluate(self) -> dict[str, Any]:
        """--evaluate / --predict: the loaded checkpoint's weights over the validation and
        test data, no training (``evaluation``). Rank 0 writes and shows the results."""
        cfg, name = self.config.checkpoint, self.name
        test_set = self.create_test_dataset()
        test = None
        if test_set is not None:
            test = self.create_dataloader(data.keyed(test_set, self.config.loop.seed), False)
        results: dict[str, Any] = {"checkpoint": cfg.evaluating, "ema": cfg.ema}
        signalled = self._watcher  # a preemption stops it, at the same batch on every rank
        self._evaluator = dataclasses.replace(self._evaluator, stop=lambda: bool(
            self.strategy.max_over_ranks([signalled.requested is not None])[0]))  # fmt: skip
        with self._evaluating_model():
            if cfg.predict:
                if type(self).predict_step is TrainerHooks.predict_step:
                    raise UserError(
                        f"--predict: {type(self).__name__} defines no predict_step(batch); "
                        "add one returning what to write for a batch"
                    )
                loader = test or self.val_loader
                if loader is None:
                    raise UserError(f"--predict: {name} has no test or validation dataset")
                path = self._evaluator.predict(loader, self.predict_step, self.run_dir, self.dist)
                self._progress.info(f"dmltrain: predicted with {cfg.evaluating} -> {path}")
                return {**results, "predictions": str(path)}
            if self.val_loader is None and test is None:
                raise UserError(f"--evaluate: {name} has no validation or test dataset")
            sets = {"val": (self.val_loader, self.val_step), "test": (test, self.test_step)}
            results.update(self._evaluator.evaluate(sets))
        path = self.run_dir / "eval_metrics.json"
        if self.dist.is_main:
            evaluation.write_metrics(path, results)
            shown = ", ".join(f"{k} {v:.6g}" for k, v in results.items() if "_" in k)
            self._progress.info(f"dmltrain: evaluated {cfg.evaluating}: {shown} -> {path}")
        return results

    # ----- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Processes, run directory, model, data, optimizer, state: everything ``fit`` needs."""
        self.dist = self.strategy.setup(self.environment)
        self.device = torch.device(self.dist.device)
        cfg, loop, dist = self.config, self.config.loop, self.dist
        self._progress = Progress(
            loop.progress, dist.is_main, loop.log_every, world_size=dist.world_size
        )
        evaluating = cfg.checkpoint.evaluating  # --evaluate/--predict: no training
        name = self.name + ("-eval" if evaluating else "")
        # a requeued job may start while the job before it is still ending
        self.run_dir, self._run_dir_held = rundir.choose(
            loop.run_dir, lambda: rundir.default_path(name, dist.job_id), cfg.checkpoint.resume,
            dist.is_main, self.strategy.broadcast_object, evaluating=bool(evaluating),
            wait=60.0 if dist.job_id else 0.0,
        )  # fmt: skip
        self.config = cfg = cfg.replace(run_dir=str(self.run_dir))
        # Every rank's host and CPUs: each takes its share of its cores (dmltrain.threads).
        self._ranks = self.strategy.all_gather_object(diagnostics.this_rank(dist, self.environment))
        cuda = self.device.type == "cuda"
        threads.assign(cfg.distributed.threads, cfg.data.num_workers, self._ranks, cuda)
        torch.set_num_threads(self._ranks[dist.rank]["threads"])
        self.config = cfg = cfg.replace(num_workers=self._ranks[dist.rank]["workers"])  # no "auto"
        self._precision = Precision(cfg.numerics.precision, self.device)
        profiled = cfg.profiling.profiled(dist.world_size)
        if dist.rank in profiled:  # before the model: its memory is recorded
            show = None  # the lowest rank profiled prints its table
            if dist.rank == profiled[0]:
                show = self._progress.info if dist.is_main else print
            self._profiler = profiling.Profiler(
                cfg.profiling, self.run_dir / "profile", dist.rank, self.device, show
            )
        self._evaluator = evaluation.Evaluator(self.strategy, self._precision, self.device)
        torch.manual_seed(loop.seed)  # the same initial weights on every rank
        model = self.create_model()
        contract.model(model)
        model = model.to(self.device)
        rng.seed_everything(loop.seed + dist.rank)  # per-rank dropout, augmentation
        self.model = self.strategy.wrap_model(
            model, self.fsdp_units(model), self._precision.dtype, self.manual_optimization
        )
        self._ema = None
        if loop.ema_decay and not evaluating:
            self._ema = EMA(unwrap(self.model), loop.ema_decay, loop.ema_warmup_steps,
                           loop.ema_every_steps)  # fmt: skip
        # best.pt and early stopping follow the average's metric when it is validated
        self._best_metric = cfg.checkpoint.best_metric
        if self._ema is not None and loop.ema_eval and self._best_metric.startswith("val_"):
            self._best_metric = "val_ema_" + self._best_metric[4:]
        if loop.compile:
            self.model = torch.compile(self.model)  # type: ignore[assignment]
        self._setup_data()
        self.total_steps = total_steps(loop, math.ceil(len(self.train_loader) / loop.grad_accum))
        made = contract.several(self.create_optimizer(self.model), "create_optimizer")
        self.optimizers = tuple(self.strategy.wrap_optimizer(
            o, self.model, loop.grad_accum, self.manual_optimization) for o in made)  # fmt: skip
        self.optimizer = self.optimizers[0]
        single = len(self.optimizers) == 1
        self.scheduler = self.create_scheduler(self.optimizer if single else self.optimizers)
        self._schedulers = () if self.scheduler is None else contract.several(
            self.scheduler, "create_scheduler")  # fmt: skip
        self._state = TrainState(self.device)  # on the device chosen by the strategy
        checks = cfg.numerics
        self._nan_checker = None
        if checks.check_nans:
            self._nan_checker = NanChecker(
                unwrap(self.model), dist.rank, dist.world_size, self.device,
                self.strategy.all_reduce_sum, self.strategy.all_gather_object,
                self.run_dir / "nan_report.txt",
            )  # fmt: skip
        callbacks = [] if evaluating else callback.create(
            self.create_callbacks(), loop.callback_names())  # fmt: skip
        self._events = Events(callbacks)
        self._fire(self._events.on_setup)
        states = {} if evaluating else callback.states(callbacks, self.create_states())
        saved = Saved(self.model, self.optimizers, self._schedulers, self._precision, self._state,
                      self._ema, states)  # fmt: skip
        plain = as_plain(cfg, self.options)  # what checkpoints and records hold of the config
        restoring = cfg.checkpoint
        if evaluating:  # the named checkpoint's weights alone; this run saves nothing
            restoring = dataclasses.replace(
                restoring, resume="never", load_weights=evaluating, evaluate=None, predict=None,
                load_optimizer=False, load_scheduler=False, load_scaler=False, load_epoch=False,
            )  # fmt: skip
        self._checkpointer = Checkpointer(
            restoring, self.run_dir / "checkpoints", saved, self.strategy, plain,
            self._progress.info, self.warn,
        )  # fmt: skip
        self._checkpointer.restore()
        if evaluating:
            return
        self._budget = Budget(loop, self._state, self._best_metric, cfg.checkpoint.best_mode,
                             cfg.preemption.epochs_per_job, self.warn)  # fmt: skip
        if checks.check_nans and checks.on_nan == "rollback" and self._state.global_step == 0:
            self._checkpointer.save(best=False)  # something to roll back to from step 1
        per_step = self._schedulers if self.scheduler_interval == "step" else ()
        self._start_monitor()
        timed = self._step_clock.timed(self.train_step)
        on_nan = lambda event: self._nan_checker.act(  # type: ignore[union-attr]  # noqa: E731
            event, checks.on_nan, self._progress.info, self._checkpointer.newest)  # fmt: skip
        before = tuple(partial(c, self) for c in self._events.on_before_optimizer_step)
        if self.manual_optimization:
            self._step = ManualStep(
                timed, self.model, self.optimizers, per_step, self._precision, self.strategy,
                self._state, self.device, loop.grad_clip, checks.detect_anomaly,
                self._nan_checker, on_nan, before,
            )  # fmt: skip
        else:
            self._step = OptimizerStep(
                timed, self.on_after_backward, self.model, self.optimizers, per_step,
                self._precision, self.strategy, self._state, self.device, loop.grad_clip,
                checks.detect_anomaly, self._nan_checker, on_nan, before_update=before,
            )  # fmt: skip
            check_first_forward(self._step, self.strategy.sync_wrapper(self.model))
        self._start_records(plain)

    def _setup_data(self) -> None:
        """prepare_data on one process per node, then every rank's datasets and loaders."""
        if self.dist.is_local_main:
            self.prepare_data()
        self.strategy.barrier()
        train_set, val_set = contract.datasets(self.create_datasets())
        if len(train_set) == 0:
            raise UserError("the training dataset is empty: check --data-dir")
        seed = self.config.loop.seed
        self.train_loader = self.create_dataloader(data.keyed(train_set, seed), train=True)
        self.val_loader = None
        if val_set is not None and len(val_set) == 0:
            raise UserError(
                "the validation dataset is empty: check --data-dir, or return None for it "
                "from create_datasets to train without validation"
            )
        if val_set is not None:
            self.val_loader = self.create_dataloader(data.keyed(val_set, seed), train=False)

    def _start_monitor(self) -> None:
        """The step clocks and what is made of them at each log interval (``monitor``)."""
        cfg, dist, me = self.config, self.dist, self._ranks[self.dist.rank]
        hint = monitor.workers_hint(me["threads"] + me["workers"], me["workers"])  # its own CPUs
        self._step_clock = StepClock(self.device, timing=cfg.tracking.monitor)
        self._watchdog = None
        if cfg.distributed.hang_watchdog:
            self._watchdog = Watchdog.for_run(
                self._step_clock, self.run_dir, dist, me["host"], cfg.distributed,
                self.strategy.flight_recorder(),
            )  # fmt: skip
            self._checkpointer.quiet = self._watchdog.paused
        self._monitor = Monitor(
            self._step_clock, self.strategy.max_over_ranks, dist.rank,
            [entry["host"] for entry in self._ranks], cfg.tracking.straggler_factor, self.warn,
            self.run_dir / "ranks.csv" if dist.is_main and dist.world_size > 1 else None,
            self.flops_per_sample(), peak_flops(self.device, cfg.numerics.precision), hint,
            dist.world_size * cfg.loop.batch_size * cfg.loop.grad_accum,
        )  # fmt: skip

    def _start_records(self, plain: dict[str, Any]) -> None:
        """config.yaml, diagnostics and the tracker (rank 0); the Slurm deadline (all ranks)."""
        deadline = None
        if self.dist.is_main:
            text = to_yaml(self.config, self.options, f"{self.name} options")
            self._progress.info(
                f"dmltrain: {self.name} -> {self.run_dir} (options: config.yaml there; "
                "--print-config prints them)"
            )
            strategy = self.strategy
            info = diagnostics.collect(self._ranks, self.dist, strategy.name, strategy.backend(),
                                       type(self), plain, self.environment)  # fmt: skip
            info["world_size_changes"] = self._state.world_size_changes
            info["training"] = diagnostics.training(
                unwrap(self.model), self.train_loader, self.val_loader, self.config.loop,
                self.dist.world_size, self.config.numerics.precision,
            )  # fmt: skip
            self._progress.info(rundir.write_records(self.run_dir, text, info))
            self._steps_log = StepsLog(
                self.run_dir / "steps.csv", self._state.global_step, self.warn
            )
            self._tracker = create_trackers(
                self.config.tracking, self.environment.wandb_mode, self.run_dir,
                self._state.tracker_run_ids, self._state.global_step, self.name, plain,
                self._progress.info,
            )  # fmt: skip
            self._state.tracking_run_id = self._tracker.run_id
            self._state.tracker_run_ids = self._tracker.run_ids
            minutes = self.config.preemption.stop_before_end_minutes  # rank 0 asks Slurm, once
            deadline = preemption.stop_deadline(self.dist.job_id, minutes, self.warn)
        self._watcher.deadline = self.strategy.broadcast_object(deadline)

    def _spawn_workers(self) -> list[dict[str, Any]]:
        """``--nprocs N``: start N workers here and wait (``processes.spawn_fits``)."""
        evaluating = self.config.checkpoint.evaluating
        name = self.name + ("-eval" if evaluating else "")
        run_dir = Path(self.config.run_dir or rundir.default_path(name, self.dist.job_id))
        rundir.check(run_dir)
        config = self.config.replace(
            run_dir=str(run_dir), progress=progress.for_workers(self.config.loop.progress)
        )
        processes.spawn_fits(type(self), self.name, config, self.options, self.dist)
        if self.config.checkpoint.predict:
            return [{"predictions": str(run_dir / "predictions" / "predictions.pt")}]
        if evaluating:
            return [json.loads((run_dir / "eval_metrics.json").read_text())]
        return read_training_log(run_dir / "training_log.csv")

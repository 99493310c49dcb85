"""The training loop: epochs of steps, each epoch's row, and the stops the ranks agree on.

``_train`` runs the epochs until a budget is spent (``budget``), ``_train_epoch`` the
steps (``step``), ``_epoch_row`` and ``_close_epoch`` an epoch's end. What is optional
(EMA, profiler, watchdog, steps.csv) and the experiment's callbacks plug in through
the events (``callback``, ``features``); the loop names no feature.
"""

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from dmltrain.callback import Events
from dmltrain.checkpoint.checkpointer import Checkpointer
from dmltrain.data.streams import TrainFeed
from dmltrain.engine import evaluation
from dmltrain.engine.batches import chunks
from dmltrain.engine.budget import Budget, Done
from dmltrain.engine.nan import NanChecker, RollBack
from dmltrain.engine.precision import Precision
from dmltrain.engine.progress import Progress
from dmltrain.engine.state import TrainState
from dmltrain.engine.step import ManualStep, OptimizerStep
from dmltrain.errors import UserError
from dmltrain.features.builtin import Features
from dmltrain.features.monitor import Monitor, StepClock
from dmltrain.features.tracking import Tracker
from dmltrain.hooks import TrainerHooks
from dmltrain.records import rundir
from dmltrain.records.files import NotWritten
from dmltrain.records.training_log import StepsLog, write_training_log
from dmltrain.runtime import preemption
from dmltrain.runtime.launch import DistInfo


class TrainingLoop(TrainerHooks):
    """The loop of ``BaseTrainer``; its parts are made by ``TrainerSetup.setup``."""

    dist: DistInfo
    model: nn.Module
    optimizers: tuple[Any, ...]  # create_optimizer's, wrapped by the strategy
    optimizer: Any  # the first of them
    scheduler: Any  # create_scheduler's
    _schedulers: tuple[Any, ...]
    train_loader: DataLoader
    val_loader: DataLoader | None
    run_dir: Path
    _total_steps: int | None  # by --epochs and --max-steps; None: a stream's, unknown
    _feed: TrainFeed  # the training batches of each epoch
    _state: TrainState  # epoch, steps, best value, log rows (what a checkpoint holds)
    _progress: Progress
    _checkpointer: Checkpointer
    _watcher: preemption.PreemptionWatcher
    _agreement: preemption.AgreementSchedule
    _step_clock: StepClock  # each step's time in the loader and in train_step
    _monitor: Monitor  # throughput, data stalls, stragglers at each log interval
    _best_metric: str  # of the training log: best.pt and early stopping
    _budget: Budget  # when the run is done: epochs, steps, time, early stopping
    _precision: Precision
    _step: OptimizerStep | ManualStep  # one optimizer step (dmltrain.engine.step)
    _nan_checker: NanChecker | None  # --check-nans: settled with the metrics and at saves
    _evaluator: evaluation.Evaluator  # validation, --evaluate and --predict over a loader
    _events: Events  # the callbacks' listeners, built-in features first
    _features: Features  # the built-in features' own points
    _tracker: Tracker  # rank 0's trackers (an inactive one elsewhere)
    _steps_log: StepsLog | None  # rank 0's steps.csv (log_metrics writes there too)
    _epochs_this_job: int

    @property
    def total_steps(self) -> int:
        """Optimizer steps the run takes by --epochs and --max-steps, known before the
        first (for a schedule stepped each step)."""
        if self._total_steps is None:
            raise UserError(
                "total_steps is unknown: the training stream has no len(); give "
                "--steps-per-epoch N (or --max-steps N) to size a schedule by steps"
            )
        return self._total_steps

    def warn(self, message: str) -> None:
        """A warning on stderr; ranks other than 0 prefix theirs with their rank."""
        prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
        print(f"{prefix}WARNING: {message}", file=sys.stderr, flush=True)

    def _train(self) -> str | None:
        """The run, epoch by epoch, until it is done (``budget``). Returns why it stopped
        before that (to go on in a later job), or None when it is done."""
        epochs, s, budget = self.config.loop.epochs, self._state, self._budget
        self.on_train_start()
        self._fire(self._events.on_train_start)
        budget.start()
        # its first interval is timed from here: the setup before is no step
        self._agreement = preemption.AgreementSchedule(self.config.preemption.preempt_check_seconds)
        before = budget.reason(budget.time_done()) or budget.stopped_early()
        if s.epoch >= epochs or before:  # e.g. a later job of a chain
            self._progress.info(
                f"dmltrain: the run is done already ({before or f'{epochs} epoch(s)'}); "
                "nothing left to train (raise the limit to go on)"
            )
        done = before
        self._epochs_this_job = 0
        while s.epoch < epochs and done is None:
            epoch = s.epoch
            if s.step_in_epoch == 0:  # not resumed inside it
                s.epoch_began = s.seconds()
            self.on_epoch_start(epoch)
            self._fire(self._events.on_epoch_start)
            try:
                outcome = self._train_epoch()
                if isinstance(outcome, str):  # preempted; the checkpoint is saved
                    return outcome
                best, done = False, None
                if not (outcome and outcome.validated):
                    with self._features.quiet():
                        row, best, done = self._epoch_row(epoch, partial=outcome is not None)
                        if outcome is None:
                            self._close_epoch(epoch, row)
                timed = budget.time_agreed(self.strategy.max_over_ranks)
                done = done or (outcome and outcome.reason) or budget.reason(timed)
                stop = None if done else budget.job_done(self._epochs_this_job)
                last = s.epoch >= epochs or done is not None
                self._checkpointer.save(best, must=stop is not None or last)  # each epoch's end
            except RollBack as back:  # --on-nan rollback, settled in the epoch or at its end
                self._checkpointer.rollback(back.event.epoch, back.event.step)
                continue
            if stop is not None:
                return stop
        done = done or budget.epochs_ended()
        if done and not before:
            self._progress.info(f"dmltrain: done: {done}")
        self.on_train_end()
        self._fire(self._events.on_train_end)
        self._checkpointer.wait()
        return None

    def _train_epoch(self) -> str | Done | None:
        """The epoch's steps from where the run is. Returns why the run stops here
        (preempted), the budget that ended the run in the epoch, or None at the epoch's
        end."""
        loop, s, clock = self.config.loop, self._state, self._step_clock
        epoch = s.epoch + 1  # 1-based, as printed and logged
        self.model.train()
        steps = self._feed.steps  # None: a stream of unknown length, until it ends
        last = self._budget.last_step_in_epoch(steps)  # of --max-steps, when inside the epoch
        left = self._feed.epoch(s.epoch, s.step_in_epoch)  # the micro-batches from here on
        batches = chunks(clock.batches(left), loop.grad_accum)
        step_end, every, skips = self._events.on_step_end, loop.val_every_steps, s.skip_steps
        # bound once: each lookup of a bound method makes an object, at every step
        agree = functools.partial(
            preemption.agree,
            self._agreement,
            self._watcher,
            self.strategy.max_over_ranks,
            self._checkpointer.minutes_due,
            self._budget.time_done,
        )
        run, due = self._step.run, self._progress.due
        save_when_due = self._checkpointer.save_when_due
        clock.restart()
        calm = 0  # steps after which nothing below clock.step() is due (``_calm``)
        for step, micro_batches in enumerate(
            self._progress.epoch(batches, epoch, loop.epochs, steps, s.metrics.count),
            start=s.step_in_epoch + 1,
        ):
            if not skips or (epoch, step) not in skips:  # not dropped by a rollback
                run(micro_batches, epoch, step)
            s.global_step += 1
            s.step_in_epoch = step
            for call in step_end:  # the built-in features first (EMA first of all)
                call(self)
            clock.step()
            if calm:  # every test below would say no at this step
                calm -= 1
                continue
            if due(step):  # the log interval, and the epoch's last step
                self._log_interval(step, epoch)
            within = steps is None or step < steps  # not the epoch's last step
            if every and s.global_step % every == 0 and within and self.val_loader:
                with self._features.quiet():
                    _, best, stop_early = self._epoch_row(s.epoch, partial=True)
                self.model.train()
                clock.restart()
                if best:
                    self._checkpointer.save(best=True)
                if stop_early:
                    return Done(stop_early, validated=True)
            stopping, timed, finished = agree()
            save_when_due(timed, stopping)
            if stopping:
                return self._stop_for_preemption()
            if (finished and within) or step == last:  # a budget ends the run in the epoch
                return Done(self._budget.reason(finished) or "")
            calm = self._calm(step, last)
        return None

    def _calm(self, step: int, last: int) -> int:
        """How many of the steps after ``step`` end with nothing of the step's tail due (no
        log interval, validation, agreement, checkpoint by steps, budget's last step or
        epoch's end): the loop skips those tests there, each of which would say no. The
        agreement schedule counts them as passed now."""
        left = [self._progress.steps_to_due(step)]  # the log interval, the epoch's end
        every, save = self.config.loop.val_every_steps, self._checkpointer.steps_to_save()
        if every:
            left.append(every - self._state.global_step % every)
        if save is not None:
            left.append(save)
        if last > step:
            left.append(last - step)
        return self._agreement.skip(min(left) - 1)

    def _log_interval(self, step: int, epoch: int) -> None:
        """Every rank's clocks and metric sums (collectives), then rank 0 shows, records and
        tracks."""
        s = self._state
        monitored = self._monitor.interval(s.global_step)
        means = self._means()
        shown = self._progress.step(
            step, s.metrics.count, lambda: means, self.dist.is_main, monitored
        )
        if shown is None:  # not rank 0
            return
        values = {**shown, "lr": self._lr()}
        if self._step.grad_norm is not None:
            values["grad_norm"] = float(self._step.grad_norm)
        if self._precision.scale is not None:
            values["grad_scale"] = float(self._precision.scale)
            values["skipped_steps"] = int(self._precision.skipped)
        if self.dist.world_size > 1 and self._events.on_log:
            self._alone("on_log", values)
        else:
            self._fire(self._events.on_log, values)
        if self._tracker.active:
            self._tracker.log({f"train/{k}": v for k, v in values.items()}, s.global_step)

    def _epoch_row(self, epoch: int, partial: bool) -> tuple[dict[str, Any], bool, str | None]:
        """Training means and validation make the epoch's row of the training log (the
        epoch's so far when ``partial``: a validation inside it); it is written, shown and
        tracked. Returns the row, whether it is the best so far, and why the run stops
        early (``--early-stop-patience``) or None."""
        s, best_metric = self._state, self._best_metric
        train = self._means()
        val = self.validate() if self.val_loader is not None else {}
        if val:
            val.update(self._features.validation(self.validate))
        row: dict[str, Any] = {"epoch": epoch + 1, "step": s.global_step}
        row.update({f"train_{k}": v for k, v in train.items()})
        row.update({f"val_{k}": v for k, v in val.items()})
        # world_size changes when a run resumes on another number of processes
        row.update(lr=self._lr(), world_size=self.dist.world_size)
        row["epoch_time_s"] = round(s.epoch_seconds(), 3)  # with the part before a resume
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
        stop_early = self._budget.validated(row)  # counted against the best before it
        best = s.improves(row.get(best_metric), self.config.checkpoint.best_mode)
        self._tracker.log(row, s.global_step)
        if best:
            s.best_at = (epoch + 1, s.global_step)
            self._tracker.summary({f"best_{best_metric}": s.best_value, "best_epoch": epoch + 1})
        return row, best, self._budget.stopped_early() if stop_early else None

    def _means(self) -> dict[str, float]:
        """The epoch's running means over every rank's samples (one collective, one read),
        with the NaN checks' records read in the same and settled (--on-nan)."""
        checker = self._nan_checker
        rider = None if checker is None else checker.pending()
        means, seen = self._state.metrics.compute_with(self.strategy.all_reduce_sum, rider)
        if checker is not None:
            self._settle(seen)
        return means

    def _settle(self, seen: list[float] | None = None) -> None:
        """What the NaN checks recorded, read (or ``seen``, read already), acted on alike on
        every rank (collective)."""
        if self._nan_checker is not None:
            on_nan, info = self.config.numerics.on_nan, self._progress.info
            now, newest = self._state.global_step, self._checkpointer.newest
            self._nan_checker.settle(on_nan, now, self._where, info, newest, seen)

    def _before_save(self) -> None:
        """A checkpoint holds no step the NaN checks have not settled; then the callbacks'
        ``on_save_checkpoint``."""
        self._settle()
        self._fire(self._events.on_save_checkpoint)

    def _where(self, global_step: int) -> tuple[int, int]:
        """A global step of the epoch in progress as (epoch, step in it), 1-based."""
        s = self._state
        return s.epoch + 1, s.step_in_epoch - (s.global_step - global_step)

    def _close_epoch(self, epoch: int, row: dict[str, Any]) -> None:
        """The epoch is done: the scheduler's epoch step, ``on_epoch_end``, the counters."""
        if self.scheduler_interval == "epoch":
            for scheduler in self._schedulers:
                scheduler.step()
        self.on_epoch_end(epoch, row)
        self._fire(self._events.on_epoch_end, row)
        self._state.end_epoch()
        self._epochs_this_job += 1

    def _alone(self, event: str, *args: Any) -> None:
        """``event``, which rank 0 alone runs, marked as such while it runs (for the hang
        watchdog and for the ranks that find rank 0 gone: ``rundir.alone_in``)."""
        clock = self._step_clock
        clock.alone_in = event
        try:
            with rundir.alone_in(self.run_dir, event):
                self._fire(getattr(self._events, event), *args)
        finally:
            clock.alone_in = None

    def _lr(self) -> float:
        """The learning rate shown and logged: the first optimizer's first group's."""
        return float(self.optimizer.param_groups[0]["lr"])

    def _fire(self, listeners: tuple[Any, ...], *args: Any) -> None:
        """An event of the callbacks (``dmltrain.callback``) that is not per step."""
        for call in listeners:
            call(self, *args)

    def _stop_for_preemption(self) -> str:
        """After the preemption checkpoint: ask Slurm to requeue; why the run stops."""
        if self.dist.is_main and self.config.preemption.requeue:
            preemption.requeue(self.dist.job_id, self._progress.info)
        why = self._watcher.why()
        return (
            f"preempted ({why}): checkpoint saved at epoch {self._state.epoch + 1}, step "
            f"{self._state.step_in_epoch}; exit status 3"
        )

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

"""The training loop: epochs of steps, each epoch's row, and the stops the ranks agree on.

``Loop.train`` runs the epochs of a ``Run`` until a budget is spent (``budget``),
``_train_epoch`` the steps (``step``), ``_epoch_row`` and ``_close_epoch`` an epoch's end.
What is optional (EMA, profiler, watchdog, steps.csv) and the experiment's callbacks plug
in through the events (``callback``, ``features``); the loop names no feature.
"""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from dmltrain.data.batches import chunks
from dmltrain.engine.budget import Done
from dmltrain.engine.nan import RollBack
from dmltrain.engine.run import Run
from dmltrain.errors import UserError
from dmltrain.records import rundir
from dmltrain.records.files import NotWritten
from dmltrain.records.training_log import write_training_log
from dmltrain.runtime import preemption


class Loop:
    """Runs a ``Run`` (made by ``assembly.assemble``): its epochs, steps and stops."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.trainer = run.trainer  # the experiment: its hooks, config, dist, strategy
        self.epochs_this_job = 0
        self.agreement: preemption.AgreementSchedule  # made when training starts (train)

    def train(self) -> str | None:
        """The run, epoch by epoch, until it is done (``budget``). Returns why it stopped
        before that (to go on in a later job), or None when it is done."""
        run, trainer = self.run, self.trainer
        epochs, s, budget = trainer.config.loop.epochs, run.state, run.budget
        trainer.on_train_start()
        fire(run, run.events.on_train_start)
        budget.start()
        # its first interval is timed from here: the setup before is no step
        self.agreement = preemption.AgreementSchedule(
            trainer.config.preemption.preempt_check_seconds
        )
        before = budget.reason(budget.time_done()) or budget.stopped_early()
        if s.epoch >= epochs or before:  # e.g. a later job of a chain
            run.progress.info(
                f"dmltrain: the run is done already ({before or f'{epochs} epoch(s)'}); "
                "nothing left to train (raise the limit to go on)"
            )
        done = before
        while s.epoch < epochs and done is None:
            epoch = s.epoch
            if s.step_in_epoch == 0:  # not resumed inside it
                s.epoch_began = s.seconds()
            trainer.on_epoch_start(epoch)
            fire(run, run.events.on_epoch_start)
            try:
                outcome = self._train_epoch()
                if isinstance(outcome, str):  # preempted; the checkpoint is saved
                    return outcome
                best, done = False, None
                if not (outcome and outcome.validated):
                    with run.events.around_long_work():
                        row, best, done = self._epoch_row(epoch, partial=outcome is not None)
                        if outcome is None:
                            self._close_epoch(epoch, row)
                timed = budget.time_agreed(trainer.strategy.max_over_ranks)
                done = done or (outcome and outcome.reason) or budget.reason(timed)
                stop = None if done else budget.job_done(self.epochs_this_job)
                last = s.epoch >= epochs or done is not None
                run.checkpointer.save(best, must=stop is not None or last)  # each epoch's end
            except RollBack as back:  # --on-nan rollback, settled in the epoch or at its end
                run.checkpointer.rollback(back.event.epoch, back.event.step)
                continue
            if stop is not None:
                return stop
        done = done or budget.epochs_ended()
        if done and not before:
            run.progress.info(f"dmltrain: done: {done}")
        trainer.on_train_end()
        fire(run, run.events.on_train_end)
        run.checkpointer.wait()
        return None

    def _train_epoch(self) -> str | Done | None:
        """The epoch's steps from where the run is. Returns why the run stops here
        (preempted), the budget that ended the run in the epoch, or None at the epoch's
        end."""
        run, trainer = self.run, self.trainer
        loop, s, clock = trainer.config.loop, run.state, run.step_clock
        epoch = s.epoch + 1  # 1-based, as printed and logged
        run.model.train()
        steps = run.feed.steps  # None: a stream of unknown length, until it ends
        last = run.budget.last_step_in_epoch(steps)  # of --max-steps, when inside the epoch
        left = run.feed.epoch(s.epoch, s.step_in_epoch)  # the micro-batches from here on
        batches = chunks(clock.batches(left), loop.grad_accum)
        step_end, every, skips = run.events.on_step_end, loop.val_every_steps, s.skip_steps
        # bound once: each lookup of a bound method makes an object, at every step
        agree = functools.partial(
            preemption.agree,
            self.agreement,
            run.watcher,
            trainer.strategy.max_over_ranks,
            run.checkpointer.minutes_due,
            run.budget.time_done,
        )
        take_step, due = run.step.run, run.progress.due
        save_when_due = run.checkpointer.save_when_due
        clock.restart()
        for step, micro_batches in enumerate(
            run.progress.epoch(batches, epoch, loop.epochs, steps, s.metrics.count),
            start=s.step_in_epoch + 1,
        ):
            if not skips or (epoch, step) not in skips:  # not dropped by a rollback
                take_step(micro_batches, epoch, step)
            s.global_step += 1
            s.step_in_epoch = step
            for call in step_end:  # the built-in features first (EMA first of all)
                call(trainer)
            clock.step()
            if due(step):  # the log interval, and the epoch's last step
                self._log_interval(step, epoch)
            within = steps is None or step < steps  # not the epoch's last step
            if every and s.global_step % every == 0 and within and run.val_loader:
                with run.events.around_long_work():
                    _, best, stop_early = self._epoch_row(s.epoch, partial=True)
                run.model.train()
                clock.restart()
                if best:
                    run.checkpointer.save(best=True)
                if stop_early:
                    return Done(stop_early, validated=True)
            stopping, timed, finished = agree()
            save_when_due(timed, stopping)
            if stopping:
                return self._stop_for_preemption()
            if (finished and within) or step == last:  # a budget ends the run in the epoch
                return Done(run.budget.reason(finished) or "")
        return None

    def _log_interval(self, step: int, epoch: int) -> None:
        """Every rank's clocks, metric sums and callbacks' ``scalars`` (collectives), then
        rank 0 shows them and hands the row to ``on_log`` (steps.csv, trackers, ...)."""
        run, dist = self.run, self.trainer.dist
        s = run.state
        monitored = run.monitor.interval(s.global_step)
        means = train_means(run)
        extra = run.events.scalars(self.trainer)
        shown = run.progress.step(step, s.metrics.count, lambda: means, dist.is_main, monitored)
        if shown is None:  # not rank 0
            return
        values = {**shown, **extra}
        if dist.world_size > 1 and run.events.on_log:
            self._alone("on_log", values)
        else:
            fire(run, run.events.on_log, values)

    def _epoch_row(self, epoch: int, partial: bool) -> tuple[dict[str, Any], bool, str | None]:
        """Training means and validation make the epoch's row of the training log (the
        epoch's so far when ``partial``: a validation inside it); it is written, shown and
        tracked. Returns the row, whether it is the best so far, and why the run stops
        early (a callback's ``Stop``, ``--early-stop-patience``) or None."""
        run, trainer = self.run, self.trainer
        s, best_metric = run.state, run.best_metric
        train = train_means(run)
        val = {}
        if run.val_loader is not None:
            trainer.on_validation_start()
            fire(run, run.events.on_validation_start)
            val = validate(run)
        if val:
            val.update(run.events.validation(trainer, functools.partial(validate, run)))
        row: dict[str, Any] = {"epoch": epoch + 1, "step": s.global_step}
        row.update({f"train_{k}": v for k, v in train.items()})
        row.update({f"val_{k}": v for k, v in val.items()})
        # world_size changes when a run resumes on another number of processes
        row.update(lr=_lr(run), world_size=trainer.dist.world_size)
        row["epoch_time_s"] = round(s.epoch_seconds(), 3)  # with the part before a resume
        if run.precision.scaler is not None:  # fp16 steps dropped on overflow, in all
            row["skipped_steps"] = int(run.precision.skipped)
        s.log_rows.append(row)
        if trainer.dist.is_main:
            try:  # the rows are kept (and checkpointed): the next epoch writes them all
                write_training_log(run.run_dir / "training_log.csv", s.log_rows)
            except NotWritten as exc:
                trainer.warn(f"{exc}; training goes on and writes it again at the next epoch")
        run.progress.epoch_summary(row, partial)
        asked = None
        if val:
            trainer.on_validation_end(row)
            fire(run, run.events.on_validation_end, row)
            _step_plateaus(run, row)
            asked = run.events.should_stop(trainer, row)  # a search's pruner, ...
        stop_early = run.budget.validated(row)  # counted against the best before it
        best = s.improves(row.get(best_metric), trainer.config.checkpoint.best_mode)
        run.tracker.log(row, s.global_step)
        if best:
            s.best_at = (epoch + 1, s.global_step)
            run.tracker.summary({f"best_{best_metric}": s.best_value, "best_epoch": epoch + 1})
        if asked is not None:
            run.outcome = asked.outcome
            return row, best, asked.why
        return row, best, run.budget.stopped_early() if stop_early else None

    def _close_epoch(self, epoch: int, row: dict[str, Any]) -> None:
        """The epoch is done: the scheduler's epoch step, ``on_epoch_end``, the counters."""
        run = self.run
        if self.trainer.scheduler_interval == "epoch":
            for scheduler in run.stepped:
                scheduler.step()
        self.trainer.on_epoch_end(epoch, row)
        fire(run, run.events.on_epoch_end, row)
        run.state.end_epoch()
        self.epochs_this_job += 1

    def _alone(self, event: str, *args: Any) -> None:
        """``event``, which rank 0 alone runs, marked as such while it runs (for the hang
        watchdog and for the ranks that find rank 0 gone: ``rundir.alone_in``)."""
        run = self.run
        clock = run.step_clock
        clock.alone_in = event
        try:
            with rundir.alone_in(run.run_dir, event):
                fire(run, getattr(run.events, event), *args)
        finally:
            clock.alone_in = None

    def _stop_for_preemption(self) -> str:
        """After the preemption checkpoint: ask Slurm to requeue; why the run stops."""
        run, dist, s = self.run, self.trainer.dist, self.run.state
        if dist.is_main and self.trainer.config.preemption.requeue:
            preemption.requeue(dist.job_id, run.progress.info)
        why = run.watcher.why()
        return (
            f"preempted ({why}): checkpoint saved at epoch {s.epoch + 1}, step "
            f"{s.step_in_epoch}; exit status 3"
        )


def fire(run: Run, listeners: tuple[Any, ...], *args: Any) -> None:
    """An event of the callbacks (``dmltrain.callback``) that is not per step: each gets
    the trainer."""
    for call in listeners:
        call(run.trainer, *args)


def train_means(run: Run) -> dict[str, float]:
    """The epoch's running means over every rank's samples (one collective, one read),
    with the NaN checks' records read in the same and settled (--on-nan)."""
    checker = run.nan_checker
    rider = None if checker is None else checker.pending()
    means, seen = run.state.metrics.compute_with(run.trainer.strategy.all_reduce_sum, rider)
    if checker is not None:
        settle(run, seen)
    return means


def settle(run: Run, seen: list[float] | None = None) -> None:
    """What the NaN checks recorded, read (or ``seen``, read already), acted on alike on
    every rank (collective)."""
    if run.nan_checker is not None:
        on_nan, info = run.trainer.config.numerics.on_nan, run.progress.info
        now, newest = run.state.global_step, run.checkpointer.newest
        run.nan_checker.settle(on_nan, now, functools.partial(_where, run), info, newest, seen)


def before_save(run: Run) -> None:
    """A checkpoint holds no step the NaN checks have not settled; then the callbacks'
    ``on_save_checkpoint``."""
    settle(run)
    fire(run, run.events.on_save_checkpoint)


def _where(run: Run, global_step: int) -> tuple[int, int]:
    """A global step of the epoch in progress as (epoch, step in it), 1-based."""
    s = run.state
    return s.epoch + 1, s.step_in_epoch - (s.global_step - global_step)


def _lr(run: Run) -> float:
    """The learning rate shown and logged: the first optimizer's first group's."""
    return float(run.optimizer.param_groups[0]["lr"])


def validate(run: Run) -> dict[str, float]:
    """Validation over the ranks' shards, every sample counted once."""
    assert run.val_loader is not None
    with evaluating_model(run):
        return run.evaluator.metrics(run.val_loader, run.trainer.val_step)[0]


@contextlib.contextmanager
def evaluating_model(run: Run) -> Iterator[None]:
    """``run.model`` in eval mode, bypassing the DDP wrapper (no collectives)."""
    wrapped, run.model = run.model, run.trainer.strategy.eval_model(run.model)
    try:
        run.model.eval()
        yield
    finally:
        run.model = wrapped


def _step_plateaus(run: Run, row: dict[str, Any]) -> None:
    """ReduceLROnPlateau steps on each validation's --best-metric (every rank's alike)."""
    if not run.plateaus:
        return
    value = row.get(run.best_metric)
    if value is None:
        shown = ", ".join(k for k in row if k.startswith(("val_", "train_")))
        raise UserError(
            f"ReduceLROnPlateau steps on --best-metric {run.best_metric}, which this "
            f"validation did not report ({shown}); give --best-metric one of them"
        )
    for scheduler in run.plateaus:
        scheduler.step(value)

"""When a run is done: ``--epochs``, ``--max-steps``, ``--max-time`` and early stopping
(``--early-stop-patience``), whichever comes first.

Steps are counted alike on every rank, so ``--max-steps`` needs no agreement. Time is
not: each rank reads its own clock, so the time budget rides in the preemption agreement
(``preemption.agree``), and all ranks end at the same step boundary. The time counted is
the run's over all its jobs (``TrainState.train_seconds``, in every checkpoint). Early
stopping reads the validation metrics, which are reduced over the ranks, so every rank
holds the same value and takes the same decision; its count is in every checkpoint.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dmltrain.config import LoopConfig, time_limit_seconds
from dmltrain.engine.state import TrainState

DEFAULT_EPOCHS = 10  # --epochs 0, without --max-steps


def epochs_to_run(loop: LoopConfig, steps_per_epoch: int | None, say: Callable[[str], None]) -> int:
    """--epochs as given; else (0) as many as --max-steps takes, or ``DEFAULT_EPOCHS``. A
    --max-steps that --epochs ends first is said here, before training."""
    epochs, most = loop.epochs, loop.max_steps
    if not most:
        return epochs or DEFAULT_EPOCHS
    if steps_per_epoch is None:  # a stream of unknown length: an epoch is a pass
        if not epochs:
            say(
                f"--max-steps {most} over a stream of unknown length: the run ends "
                f"after {DEFAULT_EPOCHS} passes of it if that comes first; give --epochs N "
                "(or --steps-per-epoch N) to say otherwise"
            )
        return epochs or DEFAULT_EPOCHS
    if not epochs:
        return -(-most // steps_per_epoch)
    if epochs * steps_per_epoch < most:
        say(
            f"--epochs {epochs} ({epochs * steps_per_epoch} steps of "
            f"{steps_per_epoch}) ends the run before --max-steps {most}; leave out --epochs to "
            "let --max-steps set the length"
        )
    return epochs


def total_steps(loop: LoopConfig, steps_per_epoch: int | None) -> int | None:
    """Optimizer steps the run takes, by --epochs and --max-steps (a time budget or early
    stopping may end it sooner); None when neither says (a stream of unknown length)."""
    if steps_per_epoch is None:
        return loop.max_steps or None
    total = loop.epochs * steps_per_epoch
    return min(total, loop.max_steps) if loop.max_steps else total


@dataclass(frozen=True)
class Done:
    """A budget (or early stopping at a validation inside an epoch) ended the run inside
    an epoch; ``validated``: that validation's row is written already."""

    reason: str
    validated: bool = False


class Budget:
    """The run's limits, read from ``state``; ``epochs_per_job`` (--epochs-per-job) ends a
    job, not the run."""

    def __init__(
        self,
        loop: LoopConfig,
        state: TrainState,
        best_metric: str,
        mode: str,
        epochs_per_job: int = 0,
        warn: Callable[[str], None] = print,
    ) -> None:
        self.loop, self.state, self.epochs_per_job = loop, state, epochs_per_job
        self.best_metric, self.mode = best_metric, mode
        self.warn = warn
        self.metric_seen = False  # --best-metric found in a row (else one warning, once)
        self.max_seconds = time_limit_seconds(loop.max_time) if loop.max_time else None

    def start(self) -> None:
        """The job's training starts now (after a resume has set ``train_seconds``)."""
        self.state.start_clock()

    def steps_done(self) -> bool:
        return bool(self.loop.max_steps) and self.state.global_step >= self.loop.max_steps

    def last_step_in_epoch(self, steps: int | None) -> int:
        """The step of the epoch in progress (1-based, of ``steps``) at which ``--max-steps``
        ends the run before the epoch's end; 0 when it does not (checked once an epoch,
        not at every step)."""
        s, most = self.state, self.loop.max_steps
        last = s.step_in_epoch + most - s.global_step if most else 0
        return last if last > 0 and (steps is None or last < steps) else 0

    def time_done(self) -> bool:
        """This rank's view (agree before acting on it)."""
        return self.max_seconds is not None and self.state.seconds() >= self.max_seconds

    def time_agreed(self, max_over_ranks: Callable[[list[int]], list[int]]) -> bool:
        """Whether any rank's clock says the --max-time budget is spent (a collective,
        only with a time budget)."""
        if self.max_seconds is None:
            return False
        return bool(max_over_ranks([self.time_done()])[0])

    def job_done(self, epochs_this_job: int) -> str | None:
        """Why this job stops after its epoch, to go on in a later job, or None."""
        done, epochs = self.state.epoch, self.loop.epochs
        if self.epochs_per_job and epochs_this_job >= self.epochs_per_job and done < epochs:
            return (
                f"{epochs_this_job} epoch(s) done in this job (--epochs-per-job), "
                f"{done}/{epochs} in all; exit status 3: requeue to go on"
            )
        return None

    def epochs_ended(self) -> str | None:
        """Why the run ended at its last epoch's end when --max-steps was not reached."""
        s, loop = self.state, self.loop
        if not loop.max_steps or self.steps_done():
            return None
        return (
            f"--epochs {loop.epochs} reached at global step {s.global_step}, before "
            f"--max-steps {loop.max_steps}"
        )

    def reason(self, time_agreed: bool) -> str | None:
        """Why the run is done by a budget, or None."""
        s = self.state
        where = f"epoch {s.epoch + (s.step_in_epoch > 0)}, global step {s.global_step}"
        if self.steps_done():
            return f"--max-steps {self.loop.max_steps} reached ({where})"
        if time_agreed:
            return f"--max-time {self.loop.max_time} of training reached ({where})"
        return None

    def validated(self, row: dict[str, Any]) -> bool:
        """After a validation's row: count it for early stopping (call before the best
        value is updated); whether the run stops early (``stopped_early`` says why)."""
        patience, s = self.loop.early_stop_patience, self.state
        value = row.get(self.best_metric)
        if not self.metric_seen:
            self._check_metric(row, patience)
        if not patience or value is None or value != value:
            return False
        delta, best = self.loop.early_stop_min_delta, s.best_value
        better = best is None or (
            value < best - delta if self.mode == "min" else value > best + delta
        )
        s.bad_validations = 0 if better else s.bad_validations + 1
        return s.bad_validations >= patience

    def _check_metric(self, row: dict[str, Any], patience: int) -> None:
        """A --best-metric that is not a column (a typo) would keep no best.pt and never
        stop early: said once, at the first validated row."""
        if self.best_metric in row:
            self.metric_seen = True
        elif patience or any(key.startswith("val_") for key in row):
            self.metric_seen = True
            columns = ", ".join(k for k in row if k not in ("epoch", "step", "epoch_time_s"))
            self.warn(
                f"--best-metric {self.best_metric} is not in the training log (it has "
                f"{columns}): no best.pt is kept and early stopping cannot fire; give one of "
                "those (the run resumes with the new flag)"
            )

    def stopped_early(self) -> str | None:
        """Why early stopping ends the run (now, or in an earlier job of it), or None."""
        patience, s = self.loop.early_stop_patience, self.state
        if not patience or s.bad_validations < patience:
            return None
        at = "" if s.best_at is None else f" at epoch {s.best_at[0]}, global step {s.best_at[1]}"
        return (
            f"early stop: {self.best_metric} did not improve by more than "
            f"{self.loop.early_stop_min_delta} in {patience} validation(s); the best was "
            f"{s.best_value:.6g}{at}"
        )

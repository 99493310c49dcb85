"""``TrainState``: where a run is, what it has logged, and its best value so far.

Together with the model, optimizer, scheduler, precision and RNG states it is what a
checkpoint holds (``dmltrain.checkpoint.checkpointer``). Every rank keeps the same values, except
``metrics``: each rank's sums of the epoch in progress.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dmltrain.engine.metrics import MetricAccumulator, merge_states


@dataclass
class TrainState:
    device: torch.device
    epoch: int = 0  # epochs completed (the one in progress, 0-based)
    step_in_epoch: int = 0  # optimizer steps done in the epoch in progress
    global_step: int = 0
    best_value: float | None = None  # of --best-metric
    best_at: tuple[int, int] | None = None  # (epoch, global step) of the best validation
    bad_validations: int = 0  # in a row without improvement (--early-stop-patience)
    train_seconds: float = 0.0  # the run's training time over all its jobs, as last loaded
    epoch_began: float = 0.0  # ``seconds()`` when the epoch in progress began
    tracking_run_id: str | None = None  # the first tracker's (wandb's), as older runs kept
    tracker_run_ids: dict[str, str] = field(default_factory=dict)  # by --tracker name
    skip_steps: set[tuple[int, int]] = field(default_factory=set)  # (epoch, step) known bad
    log_rows: list[dict[str, Any]] = field(default_factory=list)  # training_log.csv
    # resumes at another number of processes or global batch: epoch, step, global_step,
    # world_size [old, new], global_batch [old, new]
    world_size_changes: list[dict[str, Any]] = field(default_factory=list)
    metrics: MetricAccumulator = field(init=False)  # this rank's sums of the epoch in progress
    # (train_seconds, time.monotonic()) when this job's training started (start_clock)
    _clock: tuple[float, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.metrics = MetricAccumulator(self.device)

    def start_clock(self) -> None:
        """This job's training starts now: ``seconds()`` counts on from ``train_seconds``."""
        self._clock = (self.train_seconds, time.monotonic())

    @property
    def training(self) -> bool:
        """Whether this job's training has started (``start_clock``)."""
        return self._clock is not None

    def seconds(self) -> float:
        """The run's training time so far, over all its jobs (``--max-time``); read when
        needed, not at every step."""
        if self._clock is None:
            return self.train_seconds
        base, started = self._clock
        return base + time.monotonic() - started

    def epoch_seconds(self) -> float:
        """The epoch in progress' training time so far, the part before a resume included."""
        return self.seconds() - self.epoch_began

    def end_epoch(self) -> None:
        """The epoch in progress is done (its row is in ``log_rows``)."""
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.metrics = MetricAccumulator(self.device)

    def improves(self, value: float | None, mode: Literal["min", "max"]) -> bool:
        """Whether ``value`` beats the best so far (then it becomes the best)."""
        if value is None or value != value:  # missing or NaN
            return False
        best = self.best_value
        if best is not None and not (value < best if mode == "min" else value > best):
            return False
        self.best_value = value
        return True

    def state_dict(self) -> dict[str, Any]:
        """What every rank shares (``metrics`` is per rank: ``metrics.state_dict()``)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "best_value": self.best_value,
            "best_at": self.best_at,
            "bad_validations": self.bad_validations,
            "train_seconds": self.seconds(),
            "epoch_began": self.epoch_began,
            "tracking_run_id": self.tracking_run_id,
            "tracker_run_ids": dict(self.tracker_run_ids),
            "skip_steps": sorted(self.skip_steps),
            "training_log": list(self.log_rows),
            "world_size_changes": list(self.world_size_changes),
        }

    def load_ranks(
        self, state: dict[str, Any], per_rank: list[dict[str, Any] | None], rank: int, same: bool
    ) -> None:
        """A checkpoint's counters and its ranks' partial-epoch sums (``per_rank``): this
        rank's own on as many processes (``same``); else all of them merged on rank 0."""
        if same:
            self.load_state_dict(state, per_rank[rank])
        else:
            self.load_state_dict(state, merge_states(per_rank) if rank == 0 else None)

    def load_state_dict(self, state: dict[str, Any], metrics: dict[str, Any] | None) -> None:
        """Counters and log from ``state``, this rank's partial-epoch sums from ``metrics``.
        Steps known to be bad stay known (a rollback loads a checkpoint saved before)."""
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = state["global_step"]
        self.best_value = state.get("best_value")
        best_at = state.get("best_at")
        self.best_at = None if best_at is None else (int(best_at[0]), int(best_at[1]))
        self.bad_validations = int(state.get("bad_validations", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        # older checkpoints: the epoch's time counts from the resume
        self.epoch_began = float(state.get("epoch_began", self.train_seconds))
        self.tracking_run_id = state.get("tracking_run_id")
        older = {"wandb": self.tracking_run_id} if self.tracking_run_id else {}
        self.tracker_run_ids = dict(state.get("tracker_run_ids", older))
        self.skip_steps |= {(int(e), int(s)) for e, s in state.get("skip_steps", [])}
        self.log_rows = list(state["training_log"])
        self.world_size_changes = list(state.get("world_size_changes", []))
        self.metrics = MetricAccumulator(self.device)
        if metrics is not None:
            self.metrics.load_state_dict(metrics)

"""``Run``: the parts of one run, which the trainer holds instead of being them.

``assembly.assemble`` makes the parts in the order the bitwise promise fixes and sets them
here; the loop (``loop.Loop``), ``fit`` (``fitting``) and the trainer's read-only properties
(``trainer.model``, ``trainer.global_step``, ...) read them. The experiment's own ``self``
keeps only its hooks and the documented names, so none of its names meets the engine's.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from dmltrain.callback import Events
from dmltrain.engine.state import TrainState
from dmltrain.errors import UserError
from dmltrain.features.tracking import Tracker

if TYPE_CHECKING:
    from torch import nn

    from dmltrain.checkpoint.checkpointer import Checkpointer
    from dmltrain.checkpoint.storage import CheckpointStore
    from dmltrain.data.streams import TrainFeed
    from dmltrain.engine.budget import Budget
    from dmltrain.engine.evaluation import Evaluator
    from dmltrain.engine.nan import NanChecker
    from dmltrain.engine.precision import Precision
    from dmltrain.engine.progress import Progress
    from dmltrain.engine.step import ManualStep, OptimizerStep
    from dmltrain.features.monitor import Monitor, StepClock
    from dmltrain.records import rundir
    from dmltrain.runtime import preemption
    from dmltrain.trainer import BaseTrainer

# what a hook may read of the run, and from which hook on (the rest are the engine's own)
_MADE_BY = {
    "model": "create_model",
    "train_loader": "create_datasets",
    "val_loader": "create_datasets",
    "optimizers": "create_optimizer",
    "scheduler": "create_scheduler",
    "total_steps": "create_datasets",
    "run_dir": "fit",
}


class Run:
    """One run's parts; each is set by ``assemble`` when it is made (``_MADE_BY``)."""

    trainer: "BaseTrainer"  # the experiment: its hooks, config, dist, strategy
    watcher: "preemption.PreemptionWatcher"  # the signals fit catches from its start
    run_dir: Path
    run_dir_held: "rundir.Held"
    ranks: list[dict[str, Any]]  # what each rank reported at start (diagnostics.this_rank)
    progress: "Progress"
    precision: "Precision"
    model: "nn.Module"
    best_metric: str  # of the training log: best.pt and early stopping
    train_loader: DataLoader
    val_loader: DataLoader | None
    feed: "TrainFeed"  # the training batches of each epoch
    evaluator: "Evaluator"  # validation, --evaluate and --predict over a loader
    total_steps: int | None  # by --epochs and --max-steps; None: a stream's, unknown
    optimizers: tuple[Any, ...]  # create_optimizer's, wrapped by the strategy
    scheduler: Any  # create_scheduler's
    schedulers: tuple[Any, ...]  # all of them, as checkpoints keep them
    stepped: tuple[Any, ...]  # those stepped each epoch or step (scheduler_interval)
    plateaus: tuple[Any, ...]  # ReduceLROnPlateau: stepped on --best-metric's value
    state: TrainState  # epoch, steps, best value, log rows (what a checkpoint holds)
    nan_checker: "NanChecker | None"  # --check-nans: settled with the metrics and at saves
    store: "CheckpointStore"  # where checkpoints are (opened before the model: a resume?)
    checkpointer: "Checkpointer"
    budget: "Budget"  # when the run is done: epochs, steps, time, early stopping
    step_clock: "StepClock"  # each step's time in the loader and in train_step
    monitor: "Monitor"  # throughput, data stalls, stragglers at each log interval
    step: "OptimizerStep | ManualStep"  # one optimizer step (dmltrain.engine.step)
    events: Events  # the callbacks' listeners, built-in features first
    tracker: Tracker  # rank 0's trackers (an inactive one elsewhere)
    outcome: str  # outcome.json's status when training ends: done, or a callback's Stop

    def __init__(self, trainer: "BaseTrainer") -> None:
        self.trainer = trainer
        # what a trainer not yet fitted answers: step 0, no tracker, no listeners
        self.state = TrainState(trainer.device)
        self.tracker = Tracker()
        self.events = Events()
        self.outcome = "done"

    def __getattr__(self, name: str) -> Any:
        """A part asked for before it is made (only then is this called)."""
        if name in _MADE_BY:
            raise UserError(
                f"self.{name} is made by {_MADE_BY[name]}: read it in a hook called after "
                "that one (the order is in dmltrain.hooks)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def made(self, name: str) -> bool:
        """Whether the part ``name`` is made (a failed setup leaves some unmade)."""
        return name in vars(self)

    @property
    def optimizer(self) -> Any:
        """The first optimizer."""
        return self.optimizers[0]

"""``BaseTrainer``: the experiment supplies model, data and one step's loss; ``fit`` runs it.

The trainer holds its run (``engine.run.Run``) instead of being the engine: ``fit`` makes
one and hands it to ``engine.fitting``. What the experiment's own ``self`` carries is its
hooks (``dmltrain.hooks``), ``config``, ``options``, ``dist``, ``device``, ``strategy``,
``environment``, the read-only parts below, and the methods a subclass calls:
``backward`` and ``optimizer_step`` (``manual_optimization``), ``log_metrics``,
``log_image``, ``validate``, ``evaluate``, ``predict``, ``warn``.
"""

import contextlib
import functools
import sys
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from dmltrain.config import TrainConfig, per_process_batch
from dmltrain.engine import fitting, loop
from dmltrain.engine.precision import check_available
from dmltrain.engine.run import Run
from dmltrain.engine.step import ManualStep, OptimizerStep
from dmltrain.errors import UserError
from dmltrain.features import images, profiling
from dmltrain.hooks import TrainerHooks
from dmltrain.runtime import launch
from dmltrain.runtime.launch import DistInfo
from dmltrain.runtime.strategies import create_strategy, unwrap

Step = TypeVar("Step", OptimizerStep, ManualStep)

# the class attributes of TrainerHooks an experiment sets, beside its methods
_YOURS = frozenset({"name", "scheduler_interval", "manual_optimization"})


@functools.cache
def _engine_names() -> frozenset[str]:
    """The names the engine keeps on the trainer: its methods, properties and attributes
    (a subclass that defines one would replace a part of the engine); not the hooks."""
    hooks = {n for n, v in vars(TrainerHooks).items() if callable(v)} | _YOURS
    names: set[str] = set()
    for kind in BaseTrainer.__mro__:
        if kind is object or kind.__module__ == "abc":
            continue
        names |= set(vars(kind)) | set(getattr(kind, "__annotations__", {}))
    # _abc_impl: ABCMeta's own, in every subclass
    return frozenset(n for n in names - hooks if not n.startswith(("__", "_abc_")))


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
        clash = sorted(n for n in vars(cls) if n in _engine_names())
        if clash:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(clash)}: dmltrain's own name(s) on the "
                "trainer; rename yours (what a trainer may override is in dmltrain.hooks)"
            )
        if cls.name == "experiment":
            cls.name = cls.__name__.lower()

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
        per_process_batch(self.config.loop, dist.world_size)  # one that cannot be is refused
        self.environment = launch.run_environment()
        self.device = torch.device(self.dist.device)
        # Chosen (and checked) now, so bad settings fail before any process starts.
        self.strategy = create_strategy(self.dist, self.config.distributed, self.config.memory)
        check_available(self.config.numerics.precision, self.device)
        profiling.check_available(self.config.profiling, self.device, dist.world_size)
        self.__run = Run(self)  # made anew by each fit

    @property
    def epoch(self) -> int:
        """Epochs completed (the one in progress, 0-based)."""
        return self.__run.state.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.__run.state.step_in_epoch

    @property
    def model(self) -> nn.Module:
        """The model as the strategy wrapped it (DDP, FSDP, ``torch.compile``); in
        ``val_step`` and ``predict_step``, the one that evaluates (no DDP wrapper)."""
        return self.__run.model

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model as ``create_model`` made it, without the DDP or ``torch.compile``
        wrapper: its parameter names are the experiment's (under FSDP its parameters are
        the ranks' shards)."""
        return unwrap(self.__run.model)

    @property
    def optimizers(self) -> tuple[Any, ...]:
        """``create_optimizer``'s optimizers, as the strategy wrapped them."""
        return self.__run.optimizers

    @property
    def optimizer(self) -> Any:
        """The first of ``optimizers``."""
        return self.__run.optimizer

    @property
    def scheduler(self) -> Any:
        """What ``create_scheduler`` returned."""
        return self.__run.scheduler

    @property
    def train_loader(self) -> DataLoader:
        return self.__run.train_loader

    @property
    def val_loader(self) -> DataLoader | None:
        return self.__run.val_loader

    @property
    def run_dir(self) -> Path:
        """This run's directory (``--run-dir``, or the one chosen for it)."""
        return self.__run.run_dir

    @property
    def checkpoints_saved(self) -> int:
        """Checkpoints this job has written (0 before its first)."""
        run = self.__run
        return run.checkpointer.written if run.made("checkpointer") else 0

    @property
    def total_steps(self) -> int:
        """Optimizer steps the run takes by --epochs and --max-steps, known before the
        first (for a schedule stepped each step)."""
        total = self.__run.total_steps
        if total is None:
            raise UserError(
                "total_steps is unknown: the training stream has no len(); give "
                "--steps-per-epoch N (or --max-steps N) to size a schedule by steps"
            )
        return total

    @property
    def best_value(self) -> float | None:
        """The best --best-metric value of the run's validations so far (over all its jobs;
        None before the first)."""
        return self.__run.state.best_value

    @property
    def global_step(self) -> int:
        """Optimizer steps taken, over all epochs and resumes."""
        return self.__run.state.global_step

    def fit(self) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs; returns the training log's rows. Raises
        ``StopForRequeue`` (exit status 3) when the run stopped to go on in a later job."""
        if self.dist.starts_workers:
            return fitting.spawn_workers(self)
        self.__run = Run(self)
        return fitting.fit(self.__run)

    def log_metrics(self, values: dict[str, Any], step: int | None = None) -> None:
        """Scalars (numbers or one-element tensors) to the trackers and to steps.csv (in
        the row of their step), by the names given, at ``step`` (default ``global_step``:
        the steps done; inside a step, as in ``on_before_optimizer_step``, the one being
        taken is ``global_step + 1``). Rank 0 logs, other ranks do nothing. A tensor is
        read from the device here: log every N steps, not every step, to keep the steps
        asynchronous."""
        if not self.dist.is_main:
            return
        at = self.global_step if step is None else step
        scalars = {k: float(v) for k, v in values.items()}
        for call in self.__run.events.on_log_metrics:  # steps.csv, the trackers, ...
            call(self, scalars, at)

    def log_image(self, name: str, image: Any, step: int | None = None) -> None:
        """An image or a matplotlib Figure to the trackers (``features.images`` says what an
        image may be), at ``step`` as ``log_metrics``; e.g. a map of the predicted field in
        ``on_epoch_end`` or a callback's ``on_validation_end``. Rank 0 logs it; elsewhere,
        and with no tracker on, it does nothing (make it on rank 0 alone to save the work)."""
        if not self.dist.is_main:
            return
        image = images.checked(name, image)  # a bad image fails whether tracked or not
        if self.__run.tracker.active:
            self.__run.tracker.log_images({name: image}, self.global_step if step is None else step)

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

    def backward(self, loss: torch.Tensor, optimizer: Any = None) -> None:
        """In ``train_step`` with ``manual_optimization``: ``loss``'s gradients (scaled with
        fp16, shared among an accumulation's micro-batches). With ``optimizer``, only its
        parameters keep them (a generator's loss leaves the discriminator's gradients)."""
        self.__step(ManualStep, "backward()").backward(loss, optimizer)

    def backward_early(self, loss: torch.Tensor) -> None:
        """In ``train_step``: ``loss``, a part of the step's loss, backpropagated now
        without a gradient sync; the loss ``train_step`` returns is backpropagated after
        and syncs the sum once (a truncated rollout: ``dmltrain.weather.rollout``). Its
        forward must run in ``self.no_sync()``."""
        self.__step(OptimizerStep, "backward_early(loss)").backward_early(loss)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """In ``train_step``: a context whose forward passes leave gradients unsynchronised,
        for a step that runs the model several times (a rollout): run all but the last
        forward in it, and the gradients are synchronised once, by the last backward."""
        return self.__step(OptimizerStep, "no_sync()").no_sync()

    def optimizer_step(self, optimizer: Any, closure: Any = None) -> Any:
        """In ``train_step`` with ``manual_optimization``: ``optimizer``'s update, its
        gradients averaged over the ranks, unscaled, checked (--check-nans) and clipped
        (--grad-clip); at the last micro-batch of an accumulation, a no-op before it.
        ``closure`` is for an optimizer that evaluates the loss several times a step
        (LBFGS): it zeroes the gradients, runs the forward, calls ``self.backward(loss)``
        and returns the loss; each call's gradients are averaged over the ranks. Returns
        what ``optimizer.step(closure)`` returned (LBFGS: the step's first loss)."""
        return self.__step(ManualStep, "optimizer_step()").optimizer_step(optimizer, closure)

    def __step(self, kind: type[Step], what: str) -> Step:
        """The run's step, of the ``kind`` that ``self.WHAT`` is for; else one line."""
        step = vars(self.__run).get("step")
        if isinstance(step, kind):
            return step
        if kind is ManualStep:
            raise UserError(
                f"self.{what} needs manual_optimization = True on {type(self).__name__} "
                "(then train_step makes its own updates)"
            )
        raise UserError(
            f"self.{what} is for the automatic step; with manual_optimization, call "
            "self.backward(loss)"
        )

    def validate(self) -> dict[str, float]:
        """Validation over the ranks' shards, every sample counted once."""
        return loop.validate(self.__run)

    def warn(self, message: str) -> None:
        """A warning on stderr; ranks other than 0 prefix theirs with their rank."""
        prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
        print(f"{prefix}WARNING: {message}", file=sys.stderr, flush=True)

"""``BaseTrainer``: the experiment supplies model, data and one step's loss; ``fit`` runs it.

``fit`` starts the workers (``--nprocs``), or sets up (``assembly``) and runs the loop
(``loop``) or an evaluation (``evaluation``), maps a failure to what the job should do
(a lost peer, an out-of-memory), always closes the callbacks and records the outcome.
Its other public methods are what a subclass calls: ``backward`` and ``optimizer_step``
(``manual_optimization``), ``log_metrics``, ``validate``, ``evaluate``, ``predict``.
"""

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmltrain import compat
from dmltrain.callback import Events
from dmltrain.config import LoopConfig, TrainConfig, per_process_batch
from dmltrain.data import samples
from dmltrain.engine import contract, evaluation, progress
from dmltrain.engine.assembly import TrainerSetup
from dmltrain.engine.precision import check_available
from dmltrain.engine.state import TrainState
from dmltrain.engine.step import ManualStep
from dmltrain.errors import (
    NonFiniteError,
    PeerFailed,
    PeerLost,
    SharedError,
    StopForRequeue,
    UserError,
)
from dmltrain.features import images, profiling
from dmltrain.features.builtin import Features
from dmltrain.features.tracking import Tracker
from dmltrain.hooks import TrainerHooks
from dmltrain.records import rundir
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime import launch, preemption, processes
from dmltrain.runtime.distributed import create_strategy, unwrap
from dmltrain.runtime.launch import DistInfo

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


class BaseTrainer(TrainerSetup):
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
        batch = per_process_batch(self.config.loop, dist.world_size)
        given = self.config.loop.batch_size
        if batch != given and given != LoopConfig().batch_size and dist.is_main:
            self.warn(
                f"--global-batch-size {self.config.loop.global_batch_size} on "
                f"{dist.world_size} process(es) sets --batch-size {batch}, not the "
                f"{given} given"
            )
        self.config = self.config.replace(batch_size=batch)
        self.environment = launch.run_environment()
        self.device = torch.device(self.dist.device)
        # Chosen (and checked) now, so bad settings fail before any process starts.
        self.strategy = create_strategy(self.dist, self.config.distributed, self.config.memory)
        check_available(self.config.numerics.precision, self.device)
        profiling.check_available(self.config.profiling, self.device)
        self.config.profiling.profiled(dist.world_size)  # a rank beyond the job's is refused
        self._state = TrainState(self.device)
        self._tracker = Tracker()  # rank 0's real one is made in setup
        self._steps_log = None  # rank 0's steps.csv, made in setup
        self._features = Features()  # the built-in features, made in setup
        self._events = Events()  # the callbacks' listeners, made in setup

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
        self._record_outcome(None)  # first: the training is done whatever on_close does
        self._close(None)
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
        if self._tracker.active:
            self._tracker.log(scalars, at)
        if self._steps_log is not None:  # steps.csv, in the row of its step
            self._steps_log.add(at, self.epoch + 1, scalars)

    def log_image(self, name: str, image: Any, step: int | None = None) -> None:
        """An image or a matplotlib Figure to the trackers (``features.images`` says what an
        image may be), at ``step`` as ``log_metrics``; e.g. a map of the predicted field in
        ``on_epoch_end`` or a callback's ``on_validation_end``. Rank 0 logs it; elsewhere,
        and with no tracker on, it does nothing (make it on rank 0 alone to save the work)."""
        if not self.dist.is_main:
            return
        image = images.checked(name, image)  # a bad image fails whether tracked or not
        if self._tracker.active:
            self._tracker.log_images({name: image}, self.global_step if step is None else step)

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
        evaluating, results, failed = self.config.checkpoint.evaluating, None, True
        try:
            self.setup()
            stopped, results = (None, [self._evaluate()]) if evaluating else (self._train(), None)
            self._tracker.finish(preempted=stopped is not None)
            failed = False
        except torch.OutOfMemoryError as exc:
            self._tracker.finish()
            raise profiling.out_of_memory(
                exc,
                self.run_dir / "profile",
                self.dist.rank,
                self.device,
                self._state.global_step,
                self.config,
                self.strategy.name,
                profiling.training_state_bytes(self.model, self.optimizers),
            ) from exc
        except Exception as exc:
            self._tracker.finish()
            lost = self.strategy.lost_peer(exc)
            if lost is None:  # this rank's own failure (or every rank's at once)
                if not isinstance(exc, (SharedError, NonFiniteError)):  # every rank's own
                    self.strategy.announce_failure(exc)
                bad_data = contract.data(exc)
                if bad_data is not None:
                    raise bad_data from None
                raise
            alone = isinstance(lost, PeerLost) and hasattr(self, "run_dir")
            event = rundir.alone(self.run_dir) if alone else None  # rank 0 stopped inside it
            if event is not None:
                raise PeerFailed(
                    f"rank 0 stopped inside the callback event {event}, which only rank 0 "
                    "runs: a collective called there (a barrier, an all_reduce, ...) waits for "
                    "the other ranks, which never enter it, or meets their next one; call it "
                    "in an event every rank runs (on_step_end), or none there. A bug, not a "
                    "lost node: nothing is requeued"
                ) from exc
            if isinstance(lost, PeerLost):  # where a rank hangs, when the watchdog knows
                lost = self._features.explain(lost)
            raise lost from exc
        finally:
            self._features.stop()
            self._watcher.restore()
            for loader in (getattr(self, "train_loader", None), getattr(self, "val_loader", None)):
                compat.stop_loader_workers(loader)
            if hasattr(self, "_checkpointer"):
                self._checkpointer.close(failed)  # never exit with a write half done
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

    def _evaluate(self) -> dict[str, Any]:
        """--evaluate / --predict: the loaded checkpoint's weights over the validation and
        test data, no training (``evaluation``). Rank 0 writes and shows the results."""
        cfg, name = self.config.checkpoint, self.name
        test_set = self.create_test_dataset()
        test = None
        if test_set is not None:
            test = self.create_dataloader(samples.keyed(test_set, self.config.loop.seed), False)
        results: dict[str, Any] = {"checkpoint": cfg.evaluating, "ema": cfg.ema}
        signalled = self._watcher  # a preemption stops it, at the same batch on every rank
        self._evaluator = dataclasses.replace(
            self._evaluator,
            stop=lambda: bool(self.strategy.max_over_ranks([signalled.requested is not None])[0]),
        )
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

"""``Callback``: code that runs at the loop's points without subclassing the trainer, and
the state that callbacks and the experiment keep in checkpoints.

An experiment returns its callbacks from ``create_callbacks()`` (workers of ``--nprocs``
rebuild the trainer, so callbacks are made in each process and need not pickle);
``--callbacks NAME`` adds one installed under the entry-point group ``dmltrain.callbacks``.
Each event passes the trainer, typed as the read-only ``TrainerView``.

Dispatch is worked out once per run (``Events``): each event holds the bound methods of
the callbacks that override it, so an event nobody listens to costs an empty loop.

State: a callback that defines ``state_dict()`` and ``load_state_dict(state)`` is saved in
every checkpoint under its ``state_key`` (its class name unless set), as are the objects
the experiment returns from ``create_states()``. Every rank calls ``state_dict`` (it may
be a collective); rank 0's is written, and every rank loads it on resume.

The bitwise promise holds with callbacks only if they draw no random numbers from the
global generators (``torch``, ``numpy``, ``random``): use a ``torch.Generator`` of their own.
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

from dmltrain import plugins
from dmltrain.checkpoint.stateful import Stateful
from dmltrain.errors import PeerLost, UserError, first_line


class Stop(NamedTuple):
    """Why a callback ends the run after a validation: ``outcome`` is its status in
    ``outcome.json`` (``pruned``, ...; the job exits 0), ``why`` the line said."""

    outcome: str
    why: str


class TrainerView(Protocol):
    """What an event may read of the trainer: its settings and the run's parts, read-only
    (``BaseTrainer`` is one), and ``log_metrics``/``log_image``/``warn``."""

    @property
    def config(self) -> Any: ...  # TrainConfig
    @property
    def options(self) -> Any: ...  # the experiment's own settings
    @property
    def dist(self) -> Any: ...  # DistInfo: rank, world_size, ...
    @property
    def device(self) -> Any: ...  # torch.device
    @property
    def model(self) -> Any: ...
    @property
    def unwrapped_model(self) -> Any: ...
    @property
    def optimizers(self) -> tuple[Any, ...]: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def epoch(self) -> int: ...
    @property
    def step_in_epoch(self) -> int: ...
    @property
    def global_step(self) -> int: ...
    @property
    def best_value(self) -> float | None: ...

    def log_metrics(self, values: dict[str, Any], step: int | None = None) -> None: ...

    def log_image(self, name: str, image: Any, step: int | None = None) -> None: ...

    def warn(self, message: str) -> None: ...


class Callback:
    """Override the events you need; each gets the trainer (a ``TrainerView``).

    In a run's order: ``on_setup``, ``on_load_checkpoint`` (when one is loaded),
    ``on_train_start``, then per epoch ``on_epoch_start``, per step
    ``on_before_optimizer_step`` and ``on_step_end`` (``scalars`` and ``on_log`` at each
    log interval), ``on_validation_start`` and ``on_validation_end``, ``on_epoch_end``;
    ``on_save_checkpoint`` before each checkpoint; at the end ``on_train_end``, ``on_stop``
    and ``on_close`` however the run ends. Every event runs on every rank except ``on_log``
    (rank 0). A collective may be called only in an event every rank fires in step: not
    ``on_log``.

    The advanced events (``scalars``, ``validation``, ``around_long_work``, ``explain``,
    ``on_stop``) are how the built-in features (EMA, profiler, watchdog, steps.csv) plug in.
    """

    state_key: ClassVar[str | None] = None  # its key in checkpoints (default: class name)

    def on_setup(self, trainer: TrainerView) -> None:
        """Model, optimizer and data are made; the checkpoint is not yet restored."""

    def on_train_start(self, trainer: TrainerView) -> None:
        """This job's training starts: after the restore, before its first epoch."""

    def on_epoch_start(self, trainer: TrainerView) -> None:
        """Before each epoch's first step (``trainer.epoch`` is 0-based)."""

    def on_before_optimizer_step(self, trainer: TrainerView) -> None:
        """The gradients are final: summed over the ranks, unscaled (fp16), found finite
        (``--check-nans``), not yet clipped (``--grad-clip``)."""

    def on_step_end(self, trainer: TrainerView) -> None:
        """After an optimizer step; ``trainer.global_step`` counts it."""

    def scalars(self, trainer: TrainerView) -> Mapping[str, Any]:
        """Every rank, at each log interval: values to add to the interval's row (numbers
        or one-element tensors; rank 0's are kept). The row goes to
        steps.csv, the trackers and ``on_log``. A collective may be called here."""
        return {}

    def on_log(self, trainer: TrainerView, values: Mapping[str, float]) -> None:
        """Rank 0, at each log interval: the step's scalars as steps.csv gets them."""

    def on_log_metrics(self, trainer: TrainerView, values: Mapping[str, float], step: int) -> None:
        """Rank 0: what a ``log_metrics`` call gave, at its ``step``. Sinks write it here
        (steps.csv in that step's row, the trackers under the names given)."""

    def validation(
        self, trainer: TrainerView, validate: Callable[[], dict[str, float]]
    ) -> Mapping[str, float]:
        """More ``val_*`` columns for a validation's row (``validate`` runs it again, e.g.
        with other weights swapped in); every rank."""
        return {}

    def on_validation_start(self, trainer: TrainerView) -> None:
        """Before a validation (at the epoch's end, and within it with --val-every-steps)."""

    def on_validation_end(self, trainer: TrainerView, row: Mapping[str, Any]) -> None:
        """After a validation (at the epoch's end, and within it with --val-every-steps):
        the training log's row, ``val_*`` included."""

    def should_stop(self, trainer: TrainerView, row: Mapping[str, Any]) -> Stop | None:
        """Every rank, after ``on_validation_end``: a ``Stop`` to end the run here (saved,
        not requeued), or None. Every rank must answer alike: decide on rank 0 and
        broadcast it."""
        return None

    def on_epoch_end(self, trainer: TrainerView, row: Mapping[str, Any]) -> None:
        """After each epoch, with its row of the training log."""

    def around_long_work(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around work that is not a step (validation, checkpoint writes), e.g. to
        pause a watchdog of step times."""
        return contextlib.nullcontext()

    def on_save_checkpoint(self, trainer: TrainerView) -> None:
        """A checkpoint is about to be taken, at a step boundary: the states'
        ``state_dict()`` are read next (every rank, in step)."""

    def on_load_checkpoint(self, trainer: TrainerView, path: Path) -> None:
        """A checkpoint was loaded: on resume and ``--on-nan rollback`` model, optimizers,
        counters and states hold its values; with ``--load-weights``, what the --load-*
        flags asked for."""

    def on_train_end(self, trainer: TrainerView) -> None:
        """The run is done (not called when a job stops to be requeued)."""

    def explain(self, lost: PeerLost) -> PeerLost:
        """A lost peer, said better where this callback knows more (where a rank hangs)."""
        return lost

    def on_stop(self) -> None:
        """The run's processes are ending (success or not), before the process group goes:
        let go of threads and files."""

    def on_close(self, trainer: TrainerView, error: BaseException | None) -> None:
        """Always, last: ``error`` is None on success, else why the job ended
        (``StopForRequeue`` when it will go on in a later job)."""


EVENTS = tuple(
    name for name, value in vars(Callback).items() if callable(value) and name != "__init__"
)


class Events:
    """Each event's listeners, bound once: ``for call in events.on_step_end: call(trainer)``;
    and the events whose answers are combined (``scalars``, ``validation``, ...)."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = tuple(callbacks)
        listeners = {name: _listeners(self.callbacks, name) for name in EVENTS}
        self.on_setup = listeners["on_setup"]
        self.on_train_start = listeners["on_train_start"]
        self.on_epoch_start = listeners["on_epoch_start"]
        self.on_before_optimizer_step = listeners["on_before_optimizer_step"]
        self.on_step_end = listeners["on_step_end"]
        self._scalars = listeners["scalars"]
        self.on_log = listeners["on_log"]
        self.on_log_metrics = listeners["on_log_metrics"]
        self._validation = listeners["validation"]
        self.on_validation_start = listeners["on_validation_start"]
        self.on_validation_end = listeners["on_validation_end"]
        self._should_stop = listeners["should_stop"]
        self.on_epoch_end = listeners["on_epoch_end"]
        self._around_long_work = listeners["around_long_work"]
        self.on_save_checkpoint = listeners["on_save_checkpoint"]
        self.on_load_checkpoint = listeners["on_load_checkpoint"]
        self.on_train_end = listeners["on_train_end"]
        self._explain = listeners["explain"]
        self._on_stop = listeners["on_stop"]
        self.on_close = listeners["on_close"]

    def scalars(self, trainer: TrainerView) -> dict[str, float]:
        """Every contributor's values of a log interval, read (a tensor is read here)."""
        found: dict[str, float] = {}
        for call in self._scalars:
            found.update((k, float(v)) for k, v in call(trainer).items())
        return found

    def validation(
        self, trainer: TrainerView, validate: Callable[[], dict[str, float]]
    ) -> dict[str, float]:
        extra: dict[str, float] = {}
        for call in self._validation:
            extra.update(call(trainer, validate))
        return extra

    def should_stop(self, trainer: TrainerView, row: Mapping[str, Any]) -> Stop | None:
        """The first listener's ``Stop``; every listener is asked (each may call a
        collective)."""
        asked = [call(trainer, row) for call in self._should_stop]
        return next((stop for stop in asked if stop is not None), None)

    @contextlib.contextmanager
    def around_long_work(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for call in self._around_long_work:
                stack.enter_context(call())
            yield

    def explain(self, lost: PeerLost) -> PeerLost:
        for call in self._explain:
            lost = call(lost)
        return lost

    def on_stop(self) -> None:
        for call in self._on_stop:
            call()


def _listeners(callbacks: Sequence[Callback], name: str) -> tuple[Callable[..., Any], ...]:
    """The bound ``name`` methods of the callbacks whose class overrides it."""
    base = getattr(Callback, name)
    return tuple(getattr(c, name) for c in callbacks if getattr(type(c), name, base) is not base)


def create(own: Iterable[Any], names: Iterable[str]) -> list[Callback]:
    """The experiment's callbacks (``create_callbacks()``), then the installed ones named
    (``--callbacks``), each checked to be a ``Callback``."""
    if own is None or isinstance(own, Callback) or not isinstance(own, Iterable):
        raise UserError(
            f"create_callbacks returned {own!r}; return a list of callbacks ([] for none), "
            "e.g. return [MyCallback()]"
        )
    made = list(own)
    found = plugins.installed(plugins.CALLBACKS) if names else {}
    for name in names:
        if name not in found:
            have = ", ".join(sorted(found)) or "none"
            raise UserError(
                f"--callbacks: no callback named {name!r} is installed under the entry-point "
                f"group {plugins.CALLBACKS} (installed: {have})"
            )
        try:
            made.append(found[name].load()())
        except Exception as exc:
            raise UserError(
                f"--callbacks: the callback {name!r} ({found[name].value}) could not be made: "
                f"{first_line(exc)}"
            ) from exc
    for item in made:
        if not isinstance(item, Callback):
            raise UserError(
                f"create_callbacks: {item!r} is not a dmltrain.Callback; subclass it and "
                "override the events you need"
            )
    return made


def states(callbacks: Iterable[Callback], own: Mapping[str, Any]) -> dict[str, Stateful]:
    """What checkpoints keep beside the core: the callbacks that have state, under their
    ``state_key``, and the experiment's ``create_states()``; keys must be unique."""
    found: dict[str, Stateful] = {}

    def add(key: Any, item: Any, where: str) -> None:
        if not isinstance(key, str) or not key:
            raise UserError(f"{where}: the key {key!r} of a state is not a non-empty string")
        if not isinstance(item, Stateful):
            raise UserError(
                f"{where}: {key!r} ({type(item).__name__}) has no state_dict() and "
                "load_state_dict(state); add both to keep it in checkpoints"
            )
        if key in found:
            raise UserError(
                f"{where}: two states are kept under {key!r}; give one of them another key "
                "(a callback's state_key)"
            )
        found[key] = item

    for callback in callbacks:
        if isinstance(callback, Stateful):
            add(callback.state_key or type(callback).__name__, callback, "create_callbacks")
    for key, item in own.items():
        add(key, item, "create_states")
    return found

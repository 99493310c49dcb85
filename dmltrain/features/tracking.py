"""Experiment tracking: a small interface, its Weights & Biases and TensorBoard backends
(``--tracker wandb,tensorboard``, any combination).

Only rank 0 tracks; other ranks get ``Tracker()``, which does nothing. A backend is one
subclass of ``Tracker`` (the training log, ``training_log.csv``, is written by the trainer
whatever the tracker); one installed under the entry-point group ``dmltrain.trackers`` is
named by ``--tracker NAME``, its factory given a ``TrackerStart``, and its failures are
reported once and end it, as the built-in ones'. Metrics are logged against
``global_step`` (a logged value that wandb uses as the x axis), so a resumed run
continues the same curves, and a step logged again after a resume from an earlier
checkpoint overwrites nothing.

``--wandb-mode``: ``auto`` (default) follows ``WANDB_MODE`` when it is set and is
``disabled`` otherwise, so nothing is sent anywhere unless asked for. The run id is kept
in every checkpoint; a resumed or requeued job continues the same wandb run
(``resume="allow"``). Online without credentials, or with the server unreachable: one
line, then the run is logged offline under the run directory (``wandb sync`` uploads it
later); if even that fails, or wandb is not installed: one line, and tracking is off.
Training never stops for tracking.

TensorBoard (``--tensorboard``; the ``tensorboard`` package) writes the same scalars
against the same x axis to ``RUN_DIR/tensorboard`` through ``torch.utils.tensorboard``,
for compute nodes without internet (a wandb offline run cannot be resumed). A resumed
run writes to the same directory and purges what the earlier job logged after the
checkpoint's step, so the curves continue without doubled steps.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain import plugins
from dmltrain.config import TrackingConfig
from dmltrain.errors import first_line


class Tracker:
    """Tracking that does nothing: the interface a tracker implements, and what ranks
    other than 0 use. ``run_id``: the id a later job of the run is given back (in
    ``TrackerStart.run_id``) to continue the same run; None if it has none."""

    run_id: str | None = None
    active = False  # False: nothing is logged (e.g. after a failure it reported)

    def log(self, metrics: dict[str, Any], global_step: int) -> None:
        """Metrics at ``global_step`` (training steps, validation, epoch rows)."""

    def log_images(self, images: dict[str, Any], global_step: int) -> None:
        """Images at ``global_step``, by name: HWC uint8 numpy arrays or matplotlib Figures
        (``dmltrain.features.images``); a tracker without images ignores them."""

    def summary(self, values: dict[str, Any]) -> None:
        """Values that describe the whole run (best metric and its epoch)."""

    def finish(self, preempted: bool = False) -> None:
        """Close the run; ``preempted``: it will be resumed by a later job."""


class _Guarded(Tracker):
    """A backend whose failing call is reported once and ends it, never the training."""

    active = True
    say: Callable[[str], None]
    failed = "{what} failed"  # the line, with {what} and {why}

    def _safely(self, what: str, call: Callable[[], object]) -> None:
        if not self.active:
            return
        try:
            call()
        except Exception as exc:
            self.active = False
            self.say("dmltrain: " + self.failed.format(what=what, why=first_line(exc)))


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(4)  # wandb's own ids are 8 lowercase letters and digits


class WandbTracker(_Guarded):
    """A wandb run on rank 0. A failing call is reported once and ends tracking, never
    the training."""

    failed = "wandb failed to {what} ({why}): tracking is off"

    def __init__(self, run: Any, say: Callable[[str], None]) -> None:
        self.run = run
        self.run_id = run.id
        self.say = say
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step")

    def log(self, metrics: dict[str, Any], global_step: int) -> None:
        self._safely("log", lambda: self.run.log({**metrics, "global_step": global_step}))

    def log_images(self, images: dict[str, Any], global_step: int) -> None:
        import wandb

        def log() -> None:
            made = {name: wandb.Image(image) for name, image in images.items()}
            self.run.log({**made, "global_step": global_step})

        self._safely("log an image", log)

    def summary(self, values: dict[str, Any]) -> None:
        self._safely("update the summary", lambda: self.run.summary.update(values))

    def finish(self, preempted: bool = False) -> None:
        if preempted:
            self._safely("mark the run preempted", self.run.mark_preempting)
        self._safely("finish", lambda: self.run.finish(exit_code=3 if preempted else 0))
        self.active = False


class TensorBoardTracker(_Guarded):
    """TensorBoard event files on rank 0; a failing call is reported once and ends it."""

    failed = "tensorboard failed to {what} ({why}): it is off"

    def __init__(self, writer: Any, say: Callable[[str], None]) -> None:
        self.writer, self.say = writer, say
        self.step = 0

    def log(self, metrics: dict[str, Any], global_step: int) -> None:
        self.step = global_step

        def write() -> None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(name, value, global_step)

        self._safely("log", write)

    def log_images(self, images: dict[str, Any], global_step: int) -> None:
        from dmltrain.features.images import is_figure

        def write() -> None:
            for name, image in images.items():
                if is_figure(image):
                    self.writer.add_figure(name, image, global_step, close=False)
                else:
                    self.writer.add_image(name, image, global_step, dataformats="HWC")

        self._safely("log an image", write)

    def summary(self, values: dict[str, Any]) -> None:
        self.log({f"summary/{k}": v for k, v in values.items()}, self.step)

    def finish(self, preempted: bool = False) -> None:
        self._safely("close", self.writer.close)
        self.active = False


class Trackers(Tracker):
    """Several trackers as one, by their ``--tracker`` names."""

    def __init__(self, trackers: dict[str, Tracker]) -> None:
        self.trackers = trackers
        self.run_ids = {name: t.run_id for name, t in trackers.items() if t.run_id}
        self.run_id = next(iter(self.run_ids.values()), None)

    @property
    def active(self) -> bool:  # type: ignore[override]
        return any(t.active for t in self.trackers.values())

    def log(self, metrics: dict[str, Any], global_step: int) -> None:
        for tracker in self.trackers.values():
            tracker.log(metrics, global_step)

    def log_images(self, images: dict[str, Any], global_step: int) -> None:
        for tracker in self.trackers.values():
            tracker.log_images(images, global_step)

    def summary(self, values: dict[str, Any]) -> None:
        for tracker in self.trackers.values():
            tracker.summary(values)

    def finish(self, preempted: bool = False) -> None:
        for tracker in self.trackers.values():
            tracker.finish(preempted)


class _Installed(_Guarded):
    """An installed tracker, guarded: its first failing call is one line and ends it."""

    def __init__(self, inner: Tracker, name: str, say: Callable[[str], None]) -> None:
        self.inner, self.say, self.run_id = inner, say, inner.run_id
        self.failed = f"the tracker {name} failed to {{what}} ({{why}}): it is off"

    def log(self, metrics: dict[str, Any], global_step: int) -> None:
        self._safely("log", lambda: self.inner.log(metrics, global_step))

    def log_images(self, images: dict[str, Any], global_step: int) -> None:
        self._safely("log an image", lambda: self.inner.log_images(images, global_step))

    def summary(self, values: dict[str, Any]) -> None:
        self._safely("update the summary", lambda: self.inner.summary(values))

    def finish(self, preempted: bool = False) -> None:
        self._safely("finish", lambda: self.inner.finish(preempted))
        self.active = False


@dataclass(frozen=True)
class TrackerStart:
    """What a tracker is made from, on rank 0 once a job: an installed tracker's factory
    (entry-point group ``dmltrain.trackers``) takes this and returns a ``Tracker``."""

    settings: TrackingConfig  # --wandb-mode resolved: never "auto"
    run_dir: Path
    run_id: str | None  # the id this tracker gave the run in an earlier job: continue it
    global_step: int  # where the run is (0: a new run; else continue the curves from here)
    experiment: str
    config: dict[str, Any]  # the resolved config, plain values (as config.yaml)
    say: Callable[[str], None]  # one line on rank 0's output (why a tracker is off)
    # this job's: job id, world size, launcher, code commit (diagnostics.json has more)
    tags: dict[str, str] = field(default_factory=dict)


def _wandb(start: TrackerStart) -> Tracker:
    return create_tracker(
        start.settings, start.run_dir, start.run_id, start.experiment, start.config, start.say
    )


def _tensorboard(start: TrackerStart) -> Tracker:
    return create_tensorboard(start.run_dir / "tensorboard", start.global_step, start.say)


BUILT_IN: dict[str, Callable[[TrackerStart], Tracker]] = {
    "wandb": _wandb,
    "tensorboard": _tensorboard,
}


def create_trackers(
    settings: TrackingConfig,
    env_mode: str | None,
    run_dir: Path,
    run_ids: dict[str, str],
    global_step: int,
    experiment: str,
    config: dict[str, Any],
    say: Callable[[str], None],
    tags: dict[str, str] | None = None,
) -> Trackers:
    """Rank 0's trackers (``--tracker``), as one; ``run_ids``: each one's id of the run
    from an earlier job (kept in checkpoints)."""
    mode: str = settings.wandb_mode
    if mode == "auto":
        mode = env_mode if env_mode in ("disabled", "offline", "online") else "disabled"
    settings = dataclasses.replace(settings, wandb_mode=mode)  # type: ignore[arg-type]
    names = settings.trackers()
    found = plugins.installed(plugins.TRACKERS) if set(names) - set(BUILT_IN) else {}
    made: dict[str, Tracker] = {}
    for name in names:
        start = TrackerStart(
            settings, run_dir, run_ids.get(name), global_step, experiment, config, say, tags or {}
        )
        if name in BUILT_IN:
            made[name] = BUILT_IN[name](start)
            continue
        try:
            tracker = found[name].load()(start)
        except Exception as exc:
            say(f"dmltrain: the tracker {name} could not start ({first_line(exc)}): it is off")
            continue
        if not isinstance(tracker, Tracker):
            say(
                f"dmltrain: the tracker {name} made a {type(tracker).__name__}, not a "
                "dmltrain.Tracker: it is off"
            )
            continue
        made[name] = _Installed(tracker, name, say)
    return Trackers(made)


def create_tensorboard(directory: Path, global_step: int, say: Callable[[str], None]) -> Tracker:
    """A TensorBoard writer in ``directory``; a resumed run (``global_step`` > 0) purges the
    events an earlier job wrote after it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        say("dmltrain: tensorboard is not installed (pip install tensorboard): it is off")
        return Tracker()
    try:
        purge = global_step + 1 if global_step else None
        writer = SummaryWriter(str(directory), purge_step=purge, flush_secs=30)
    except Exception as exc:
        say(f"dmltrain: tensorboard could not start ({first_line(exc)}): it is off")
        return Tracker()
    return TensorBoardTracker(writer, say)


def create_tracker(
    settings: TrackingConfig,
    run_dir: Path,
    run_id: str | None,
    experiment: str,
    config: dict[str, Any],
    say: Callable[[str], None],
) -> Tracker:
    """wandb's tracker (``--wandb-mode`` resolved); ``say`` prints the one line that
    explains a fallback."""
    mode: str = settings.wandb_mode
    if mode == "disabled":
        return Tracker()
    try:
        import wandb
    except ImportError:
        say("dmltrain: wandb is not installed (pip install wandb): tracking is off")
        return Tracker()
    options: dict[str, Any] = {
        "project": settings.wandb_project or experiment,
        "entity": settings.wandb_entity,
        "name": settings.wandb_name or run_dir.name,
        "group": settings.wandb_group or settings.group,
        "tags": [t.strip() for t in settings.wandb_tags.split(",") if t.strip()] or None,
        "id": run_id or new_run_id(),
        "resume": "allow",
        "dir": str(run_dir),
        "config": config,
    }

    def start(mode: str) -> Any:
        return wandb.init(
            mode=mode,  # type: ignore[arg-type]
            settings=wandb.Settings(init_timeout=settings.wandb_init_timeout, quiet=True),
            **options,
        )

    try:
        return WandbTracker(start(mode), say)
    except Exception as exc:
        why = first_line(exc)
        if mode != "online":
            say(f"dmltrain: wandb could not start ({why}): tracking is off")
            return Tracker()
        say(
            f"dmltrain: wandb could not start online ({why}); logging offline to "
            f"{run_dir / 'wandb'} instead (upload later with 'wandb sync')"
        )
    try:
        wandb.teardown()  # a half-started online run would block the next init
        return WandbTracker(start("offline"), say)
    except Exception as exc:
        say(f"dmltrain: wandb could not start offline either ({first_line(exc)}): tracking off")
        return Tracker()

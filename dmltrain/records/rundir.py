"""The run directory: which one a run uses, whether it can, and the records written into
it at start (``config.yaml``, ``diagnostics.json``).

Everything a run writes goes there: checkpoints, ``training_log.csv``, the records, the
tracker's files. A directory already holding a run resumes it (``--resume auto``); one
holding a finished run with no checkpoint, a file, or a path that cannot be created is
refused with one line.
"""

import contextlib
import fcntl
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dmltrain.checkpoint import objects
from dmltrain.checkpoint.storage import list_checkpoints
from dmltrain.errors import (
    NonFiniteError,
    PeerLost,
    SharedError,
    StopForRequeue,
    UserError,
    first_line,
)
from dmltrain.records.files import NotWritten, write_atomic
from dmltrain.runtime import diagnostics

OUTCOME = "outcome.json"  # how the run's last job ended (write_outcome)

# What a run directory may hold, each entry's meaning (docs/reference.md is written from
# this; a test holds a real run's entries to it).
FILES: dict[str, str] = {
    "config.yaml": "the resolved options (a valid --config file for a new run), and what "
    "was built (optimizers, schedulers) as comments",
    "diagnostics.json": "hosts, devices, versions, git commit, command, config, environment",
    OUTCOME: "how the run's last job ended: status, global step, error",
    "training_log.csv": "a row per validation: epoch, step, train_loss, val_* metrics, lr, "
    "world_size, epoch_time_s",
    "steps.csv": "step scalars every --log-every steps (loss, steps_per_s, data_wait, "
    "samples_per_s, lr, ...), and what log_metrics gives, at its step",
    "ranks.csv": (
        "each rank's time a step, data wait and train_step, in the log intervals where one "
        "rank was slow"
    ),
    "checkpoints/": "ckpt-<epoch>-<global step>.pt, latest.pt, best.pt (.dcp folders when sharded)",
    "tensorboard/": "with --tracker tensorboard",
    "wandb/": "with --tracker wandb",
    "mlflow/": "with --tracker mlflow: the journal of what was sent (journal.jsonl, runs.json)",
    "profile/": "with --profile-steps: the torch profiler's traces; memory-rank-N.pickle "
    "with --memory-snapshot",
    "hang/": "after a hang: rank-N.txt (where each rank was, its stacks) and report.txt; "
    "an earlier job's, once the run resumed: hang-TIME/",
    "nan_report.txt": "when --check-nans found a NaN or Inf",
    "load_report.json": "from --load-weights: each key loaded, skipped, misshapen, missing "
    "or unexpected",
    "base.safetensors": "with --lora-targets: the frozen weights, written once at the start",
    "model.safetensors": "after dmltrain export RUN_DIR: the run's weights",
    "eval_metrics.json": "from --evaluate CKPT: the val_* and test_* metrics",
    "predictions/": "from --predict CKPT: rank-N.pt and predictions.pt (in dataset order)",
    "training_curves.png": "after dmltrain plot RUN_DIR",
    "submit-slurm.sh": "from dmltrain submit slurm: the batch script (submit it again to go on)",
    "submit-pbs.sh": "from dmltrain submit pbs: the batch script",
    "slurm-<job>.out": "the output of a job dmltrain submit slurm started",
    "pbs.out": "the output of a job dmltrain submit pbs started",
}


def default_path(name: str, job_id: str | None) -> str:
    """``runs/<experiment>-<job id>`` (the same for every job of a requeued run), else
    ``runs/<experiment>-<the time>``, made here: a run started in the same second as another
    gets the next free ``-2``, ``-3``..."""
    if job_id:
        return f"runs/{name}-{job_id}"
    base = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path("runs").mkdir(exist_ok=True)
    for n in itertools.count(1):
        path = base if n == 1 else f"{base}-{n}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
            return path
    raise AssertionError("unreachable")


class Held:
    """The run directory, held by this run's rank 0 while it runs (``choose``): an
    advisory lock (flock) on the directory itself, which the system drops when the process
    ends, however it ends, so a crashed run leaves nothing to clean up."""

    def __init__(self, fd: int | None, remote: objects.RunLock | None = None) -> None:
        self.fd, self.remote = fd, remote

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def release_remote(self) -> None:
        """A run in object storage: its lock there, released once the run's last records
        are copied up (``objects.RunLock``)."""
        if self.remote is not None:
            self.remote.release()
            self.remote = None


def _hold(path: Path, wait: float) -> tuple[Held, str | None]:
    """Lock ``path`` within ``wait`` seconds, or say why not. A file system without flock
    (some parallel ones) is not locked."""
    fd = os.open(path, os.O_RDONLY)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return Held(fd), None
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return Held(None), (
                    f"run directory {path} is in use by another run; wait for it to end, "
                    "or pass another --run-dir"
                )
            time.sleep(0.5)
        except OSError:
            os.close(fd)
            return Held(None), None


def hold(path: Path) -> Held | None:
    """``path`` (a folder, made here) held by this process until ``release``; None where
    another process holds it (``Held``)."""
    path.mkdir(parents=True, exist_ok=True)
    held, why = _hold(path, 0)
    return None if why else held


def in_use(path: Path) -> bool:
    """Whether a running job holds the run directory ``path`` (``Held``)."""
    if not path.is_dir():
        return False
    held, why = _hold(path, 0)
    held.release()
    return why is not None


def problem(path: Path) -> str | None:
    """Why ``path`` cannot be the run directory (it is created here if missing), or None."""
    if path.exists() and not path.is_dir():
        return f"--run-dir {path} is a file, not a directory; pass a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the run directory {path}: {exc.strerror}; pass another --run-dir"
    probe = path / f".dmltrain-write-test-{os.getpid()}"
    try:  # here, where every rank learns the verdict, not at its first record (rank 0's)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        return f"cannot write in the run directory {path}: {exc.strerror}; pass another --run-dir"
    return None


def check(path: Path) -> None:
    """``problem`` as a ``UserError``."""
    error = problem(path)
    if error:
        raise UserError(error)


def choose(
    requested: str | None,
    default: Callable[[], str],
    resume: str,
    is_main: bool,
    broadcast: Callable[[Any], Any],
    evaluating: bool = False,
    wait: float = 0.0,
    owner: str = "",
) -> tuple[Path, Held]:
    """Rank 0 decides (``requested``, else ``default``), checks the directory, creating
    it, and holds it (``Held``, waiting up to ``wait`` seconds for a run that is ending);
    every rank gets its decision: the path, or the ``UserError`` saying why not. An
    evaluation (``evaluating``) may write into any run's directory: it adds its own files
    and holds nothing. A run in object storage is held there too, by ``owner`` (the job)."""
    decision: tuple[str, str | None] = ("", None)
    held = Held(None)
    if is_main:
        remote = requested if objects.is_uri(requested) else None
        # a run in object storage keeps its records in a local folder (objects)
        path = objects.mirror(remote) if remote else Path(objects.local(requested or default()))
        error = problem(path)
        if error is None and remote:
            error = objects.unreachable(remote)
        if error is None and not evaluating:
            held, error = _hold(path, wait)
            if error is None and remote:  # one job at a time, whatever its machine
                held.remote = objects.RunLock(remote, owner)
                error = held.remote.take()
            if error is None and remote:  # an earlier job's, written on another machine
                error = objects.fetch_records(remote, path)
            if error is None:
                error = _taken(path, remote or str(path), resume, _checkpoints(path, remote))
            if error is None:  # a job whose rank 0 stopped inside such an event left it
                (path / ALONE).unlink(missing_ok=True)
        decision = (str(path), error)
    chosen, error = broadcast(decision)
    if error:
        held.release()
        held.release_remote()
        raise SharedError(error)
    return Path(chosen), held


def _checkpoints(path: Path, remote: str | None) -> list[Any]:
    """The run's checkpoints: in the run directory, or in its object store (with those
    kept here when their upload failed, which the store uploads first)."""
    if remote is None:
        return list_checkpoints(path / "checkpoints")
    store = objects.ObjectStore(remote, 0, path)
    return store.names() + [kept.name for kept in store.kept()]


def _taken(path: Path, shown: str, resume: str, checkpoints: list[Any]) -> str | None:
    """Why a run cannot start or go on in ``path`` (``shown``: as the user named it),
    which holds another, or None."""
    if resume == "never" and checkpoints:
        return (
            f"run directory {shown} already holds a run with checkpoints: --resume never "
            "starts a new run only in a new --run-dir (--resume auto goes on with this one)"
        )
    # a checkpoint to go on from: the directory's own, or a path given (--resume PATH)
    resumable = resume not in ("auto", "never") or (resume == "auto" and checkpoints)
    if (path / "training_log.csv").exists() and not resumable:
        return (
            f"run directory {shown} already holds a run (training_log.csv) with no "
            "checkpoint to resume; pass a new --run-dir to start another"
        )
    return None


SHOWN = ("lr", "momentum", "betas", "eps", "weight_decay", "nesterov")  # of an optimizer


def built(optimizers: tuple[Any, ...], schedulers: tuple[Any, ...], own: bool) -> str:
    """config.yaml's last part: the optimizers and schedulers the run built, as comments
    (``own``: by the experiment's ``create_optimizer``, which may ignore the flags)."""
    lines = ["# what was built"]
    if own:
        lines.append(
            "# (by the experiment's own create_optimizer: --optimizer, --lr and --weight-decay\n"
            "# above apply only as far as it reads them)"
        )
    for optimizer in optimizers:
        group = optimizer.param_groups[0]
        values = {k: group[k] for k in SHOWN if k in group}
        if "initial_lr" in group:  # a scheduler's: the lr it started from
            values["lr"] = group["initial_lr"]
        shown = " ".join(f"{k}={v}" for k, v in values.items())
        lines.append(f"# optimizer: {type(optimizer).__name__} {shown}".rstrip())
    for scheduler in schedulers:
        state = scheduler.state_dict()
        values = {
            k: v
            for k, v in state.items()
            if not k.startswith("_")
            and k not in ("last_epoch", "verbose", "base_lrs")
            and isinstance(v, (int, float, str))
        }
        shown = " ".join(f"{k}={v}" for k, v in values.items())
        lines.append(f"# scheduler: {type(scheduler).__name__} {shown}".rstrip())
    return "\n".join(lines) + "\n"


def write_records(run_dir: Path, config_yaml: str, info: dict[str, Any]) -> str:
    """``config.yaml`` and ``diagnostics.json`` (rank 0); returns the startup summary."""
    write_atomic(run_dir / "config.yaml", config_yaml)
    path = run_dir / "diagnostics.json"
    write_atomic(path, json.dumps(info, indent=2, default=str) + "\n")
    return diagnostics.summary(info, path)


ALONE = ".alone-rank-0"  # rank 0 is inside an event only it runs (``alone_in``)


@contextlib.contextmanager
def alone_in(run_dir: Path, event: str) -> Iterator[None]:
    """Rank 0 inside ``event``, a callback event only it runs, said in ``RUN_DIR/ALONE``
    while it lasts: a collective called there waits for ranks that never enter it, or
    pairs with their next one (Gloo then aborts the process). The ranks that find rank 0
    gone read it (``alone``) and say so, instead of a lost node."""
    marker = run_dir / ALONE
    try:
        marker.write_text(event)
    except OSError:  # a full disk: the event runs all the same
        yield
        return
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def alone(run_dir: Path) -> str | None:
    """The event rank 0 was alone in when it stopped (``alone_in``), or None."""
    try:
        return (run_dir / ALONE).read_text().strip() or None
    except OSError:
        return None


def write_outcome(
    run_dir: Path, exc: BaseException | None, global_step: int, ended: str = "done"
) -> None:
    """``outcome.json``: ``ended`` (no exception: ``done``, or a callback's ``Stop`` such
    as ``pruned``), ``stopped`` (to go on in a later job), ``lost`` (a peer),
    ``nonfinite``, ``interrupted`` or ``failed``, with the message's first line, the
    global step and the time."""
    kinds = (
        (StopForRequeue, "stopped"),
        (PeerLost, "lost"),
        (NonFiniteError, "nonfinite"),
        (KeyboardInterrupt, "interrupted"),
    )
    status = ended if exc is None else next((k for t, k in kinds if isinstance(exc, t)), "failed")
    record = {
        "status": status,
        "message": "" if exc is None else first_line(exc),
        "global_step": global_step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    with contextlib.suppress(NotWritten):  # a full disk: the exit status still says it
        write_atomic(run_dir / OUTCOME, json.dumps(record) + "\n")


def holds_run(run_dir: Path) -> bool:
    """Whether an earlier job of a run left its record or checkpoints in ``run_dir``."""
    return read_outcome(run_dir) is not None or bool(list_checkpoints(run_dir / "checkpoints"))


def read_outcome(run_dir: Path) -> dict[str, Any] | None:
    """``outcome.json`` of ``run_dir``, or None when its run has not ended a job yet; one
    that is there but cannot be read (empty, not JSON) has the status ``unreadable``."""
    path = run_dir / OUTCOME
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        record = json.loads(text)
        if isinstance(record, dict) and isinstance(record.get("status"), str):
            return record
    except ValueError:
        pass
    return {"status": "unreadable", "message": f"{path} is empty or not an outcome record"}

"""The run directory: which one a run uses, whether it can, and the records written into
it at start (``config.yaml``, ``diagnostics.json``).

Everything a run writes goes there: checkpoints, ``training_log.csv``, the records, the
tracker's files. A directory already holding a run resumes it (``--resume auto``); one
holding a finished run with no checkpoint, a file, or a path that cannot be created is
refused with one line.
"""

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dmltrain import diagnostics
from dmltrain.checkpoint import list_checkpoints
from dmltrain.errors import NonFiniteError, PeerLost, StopForRequeue, UserError, first_line

OUTCOME = "outcome.json"  # how the run's last job ended (write_outcome)


def default_path(name: str, job_id: str | None) -> str:
    """``runs/<experiment>-<job id or the time>``."""
    return f"runs/{name}-{job_id or time.strftime('%Y%m%d-%H%M%S')}"


def problem(path: Path) -> str | None:
    """Why ``path`` cannot be the run directory (it is created here if missing), or None."""
    if path.exists() and not path.is_dir():
        return f"--run-dir {path} is a file, not a directory; pass a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the run directory {path}: {exc.strerror}; pass another --run-dir"
    return None


def check(path: Path) -> None:
    """``problem`` as a ``UserError``."""
    error = problem(path)
    if error:
        raise UserError(error)


def choose(
    requested: str | None,
    default: str,
    resume: str,
    is_main: bool,
    broadcast: Callable[[Any], Any],
    evaluating: bool = False,
) -> Path:
    """Rank 0 decides (``requested``, else ``default``) and checks the directory, creating
    it; every rank gets its decision: the path, or the ``UserError`` saying why not. An
    evaluation (``evaluating``) may write into any run's directory: it adds its own files."""
    decision: tuple[str, str | None] = ("", None)
    if is_main:
        path = Path(requested or default)
        error = problem(path)
        # a checkpoint to go on from: the directory's own, or a path given (--resume PATH)
        resumable = resume not in ("auto", "never") or (
            resume == "auto" and list_checkpoints(path / "checkpoints")
        )
        if error is None and (path / "training_log.csv").exists() and not (resumable or evaluating):
            error = (
                f"run directory {path} already holds a run (training_log.csv) with no "
                "checkpoint to resume; pass a new --run-dir to start another"
            )
        decision = (str(path), error)
    chosen, error = broadcast(decision)
    if error:
        raise UserError(error)
    return Path(chosen)


def write_records(run_dir: Path, config_yaml: str, info: dict[str, Any]) -> str:
    """``config.yaml`` and ``diagnostics.json`` (rank 0); returns the startup summary."""
    (run_dir / "config.yaml").write_text(config_yaml)
    path = run_dir / "diagnostics.json"
    diagnostics.write(info, path)
    return diagnostics.summary(info, path)


def write_outcome(run_dir: Path, exc: BaseException | None, global_step: int) -> None:
    """``outcome.json``: ``done`` (no exception), ``stopped`` (to go on in a later job),
    ``lost`` (a peer), ``nonfinite``, ``interrupted`` or ``failed``, with the message's
    first line, the global step and the time."""
    kinds = ((StopForRequeue, "stopped"), (PeerLost, "lost"), (NonFiniteError, "nonfinite"),
             (KeyboardInterrupt, "interrupted"))  # fmt: skip
    status = "done" if exc is None else next((k for t, k in kinds if isinstance(exc, t)), "failed")
    record = {"status": status, "message": "" if exc is None else first_line(exc),
              "global_step": global_step, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    with contextlib.suppress(OSError):  # a full disk: the exit status still says it
        (run_dir / OUTCOME).write_text(json.dumps(record) + "\n")


def read_outcome(run_dir: Path) -> dict[str, Any] | None:
    """``outcome.json`` of ``run_dir``, or None when its run has not ended a job yet."""
    try:
        return dict(json.loads((run_dir / OUTCOME).read_text()))
    except (OSError, ValueError):
        return None

"""Errors that mean "the user's input is wrong", as opposed to a bug.

The CLI turns a ``UserError`` into one line on stderr and exit code 2; library code
raises it with a message that says what is wrong and what to do instead.
"""

import sys
import traceback
from collections.abc import Callable


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (its type name if it has none), cut to
    ``limit`` characters: how a wrapped error is quoted in a one-line message."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if limit is None else line[:limit]


def own_words(exc: BaseException) -> str:
    """``exc``'s message. One that a DataLoader worker raised comes back in the training
    process with the worker's traceback before its own words: those words alone."""
    text = str(exc)
    mark = f"{type(exc).__name__}: "
    if text.startswith("Caught ") and "Original Traceback" in text and mark in text:
        return text.rsplit(mark, 1)[1].strip()
    return text


class OneLine(Exception):
    """An outcome dmltrain explains in its message: IPython (a notebook cell) shows that
    one line instead of a traceback, as the ``dmltrain`` command does."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook for custom tracebacks
        return [f"dmltrain: {self}"]


class UserError(OneLine):
    """Bad input (flag, config file, data, checkpoint, environment) with a fix in its message."""


class ConfigError(UserError, ValueError):
    """A configuration value or file that cannot be used."""


class SharedError(UserError):
    """Bad input that every rank raises at once, with rank 0's words (a verdict it handed
    to all: a checkpoint that does not load, a run directory it cannot use): rank 0 says
    it, once; the others leave with the same status and say nothing. (Preflight's verdict
    is every rank's own line: each node's log names what is wrong there.)"""


EXIT_BAD_INPUT = 2  # one line says what to fix
EXIT_REQUEUE = 3  # "checkpoint saved, more to do": slurm/run.sh requeues the job
EXIT_NONFINITE = 4  # stopped on a NaN/Inf (--check-nans --on-nan raise); checkpoints kept
EXIT_PEER_LOST = 5  # another rank or host was lost; the checkpoints are intact: resume

# Every exit status of the command: (what it means, what the batch scripts do on it).
# docs/reference.md is written from this table (docs/make_reference.py).
EXIT_STATUSES: dict[int, tuple[str, str]] = {
    0: ("done", "end the job"),
    1: (
        "a failure in the code: the failing rank prints its traceback, every other rank one "
        "line naming it",
        "end the job, no requeue: the same code would fail again",
    ),
    EXIT_BAD_INPUT: (
        "bad input (a flag, config file, data, checkpoint, a run directory in use or whose "
        "checkpoints do not load): one line, nothing in the run directory changed",
        "end the job",
    ),
    EXIT_REQUEUE: (
        "a checkpoint was saved and there is more to do (preemption, time limit, "
        "--epochs-per-job); ranks started by a launcher exit 0 instead when --status-file "
        "holds it",
        "requeue (Slurm) or resubmit (PBS); in a chain.sh chain the next job goes on",
    ),
    EXIT_NONFINITE: (
        "stopped on a NaN or Inf (--check-nans --on-nan raise); the checkpoints are kept",
        "end the job",
    ),
    EXIT_PEER_LOST: (
        "another rank or node was lost; the checkpoints are intact: run the same command to resume",
        "requeue, up to DMLTRAIN_MAX_LOST_REQUEUES (3) times in a row with no checkpoint "
        "saved in between, then end the job with 5",
    ),
    130: (
        "interrupted (Ctrl-C) while starting, before the run catches signals; after that, "
        "Ctrl-C is a preemption (3)",
        "end the job",
    ),
}


class StopForRequeue(OneLine):
    """A checkpoint was saved and the run must continue in a later job (exit status 3)."""


class NonFiniteError(OneLine):
    """A NaN/Inf was found and ``--on-nan raise`` stops every rank (exit status 4)."""


class PeerLost(OneLine):
    """A collective failed because another rank died or stopped answering."""


class PeerFailed(OneLine):
    """Another rank failed in its own code (a bug, not a lost node): this rank stops too,
    with exit status 1, so the batch scripts do not requeue the job."""


class RankFailed(OneLine):
    """A worker process failed; the others were stopped. ``exit_code`` is the worker's;
    ``said``: the workers said why themselves, and this process has nothing to add."""

    def __init__(self, message: str, exit_code: int, said: bool = False) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.said = said


def forget_interrupt() -> None:
    """Let a Ctrl-C that was caught end the process with the status its catcher returns.

    CPython (3.11 at least) marks a KeyboardInterrupt that leaves code run by ``exec`` of a
    string (dataclasses build their methods so, at import) as unhandled even when a caller
    catches it, and at exit kills the process by SIGINT instead; each such ``exec`` clears the
    mark as it starts.
    """
    exec("", {})


def run_reporting_errors(fn: Callable[[], object], rank: int, world_size: int) -> int:
    """Run ``fn``; turn failures into one clear message on stderr and an exit code.

    Bad input: exit 2. Requeue wanted: 3. A NaN/Inf with ``--on-nan raise``: 4. A lost
    peer (another rank or its host went away): 5, with a line naming it; a peer that
    failed in its own code: 1, with a line naming it and its error.
    Anything else is a bug: the traceback, then a line naming this rank, exit 1.
    """
    who = f"[rank {rank}] " if world_size > 1 else ""
    try:
        fn()
    except SharedError as exc:
        if rank == 0:
            print(f"dmltrain: error: {own_words(exc)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except UserError as exc:
        print(f"dmltrain: error: {who}{own_words(exc)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except RankFailed as exc:
        if not exc.said:
            print(f"dmltrain: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code or 1
    except KeyboardInterrupt:
        forget_interrupt()
        print(f"dmltrain: {who}interrupted", file=sys.stderr, flush=True)
        return 130
    except StopForRequeue as exc:
        if rank == 0:
            print(f"dmltrain: {exc}", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except NonFiniteError as exc:
        if rank == 0:  # every rank stops in the same step with the same message
            print(f"dmltrain: stopped: {exc}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except PeerFailed as exc:
        print(f"dmltrain: {who}stopping: {exc} (exit status 1)", file=sys.stderr, flush=True)
        return 1
    except PeerLost as exc:
        resume = "the checkpoints are intact: run the same command to resume"
        print(
            f"dmltrain: {who}stopping: {exc}; {resume} (exit status {EXIT_PEER_LOST})",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PEER_LOST
    except Exception as exc:
        traceback.print_exc()
        print(f"dmltrain: {who}failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0

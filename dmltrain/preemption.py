"""Preemption: signals set a flag; the loop acts at a step boundary once all ranks agree.

Nothing is done inside a signal handler except setting the flag: saving a checkpoint
from a handler can fail at random (it may interrupt a collective or a write). After each
step the loop puts ``local_request()`` into one small agreement across ranks
(``Strategy.any_rank``), so all ranks stop in the same step.

Exit status 3 (``EXIT_REQUEUE``) means "a checkpoint was saved and there is more to do":
``slurm/run.sh`` turns it into a requeue. Under Slurm, rank 0 also runs
``scontrol requeue <job>`` itself after a preemption save (array tasks as
``<array job id>_<task id>``); where ``scontrol`` is missing it says so and leaves the
requeue to the exit status.
"""

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from types import FrameType

from dmltrain.errors import EXIT_REQUEUE


class PreemptionWatcher:
    """Turns the given signals (and an optional deadline) into a flag."""

    def __init__(self, signal_names: list[str], deadline: float | None = None) -> None:
        self.requested: str | None = None
        self.deadline = deadline
        self._received: list[int] = []  # signal numbers not yet taken by ``take_received``
        self._previous: dict[int, object] = {}
        for name in signal_names:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # only flags: the loop (or the --nprocs parent, which forwards) does the work
        self.requested = self.requested or signal.Signals(signum).name
        self._received.append(signum)

    def take_received(self) -> list[int]:
        """The signals received since the last call, oldest first."""
        taken, self._received = self._received, []
        return taken

    def local_request(self) -> bool:
        if self.requested is None and self.deadline is not None and time.time() >= self.deadline:
            self.requested = "time limit"
        return self.requested is not None

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]


def requeue(job_id: str | None, say: Callable[[str], None]) -> None:
    """Ask Slurm to requeue this job (rank 0 only); explain when that is impossible."""
    if job_id is None:
        return
    if shutil.which("scontrol") is None:
        say(
            f"scontrol is not available here: not requeueing job {job_id}; exiting with "
            f"status {EXIT_REQUEUE} so the batch script can requeue or resubmit"
        )
        return
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if done.returncode == 0:
        say(f"requeued Slurm job {job_id}")
    else:
        say(
            f"scontrol requeue {job_id} failed ({done.stderr.strip()}); exiting with status "
            f"{EXIT_REQUEUE}"
        )


def slurm_end_time(job_id: str | None) -> float | None:
    """The job's end time (seconds since the epoch) as Slurm reports it, or None."""
    if job_id is None or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None  # unlimited, unknown, or not a Slurm job


def stop_deadline(
    job_id: str | None, minutes_before: float, warn: Callable[[str], None]
) -> float | None:
    """When to checkpoint and stop: ``minutes_before`` the Slurm job's time limit; None
    outside Slurm, without a limit, or when that moment has passed already."""
    end = slurm_end_time(job_id)
    if end is None:
        return None
    deadline = end - 60 * minutes_before
    if deadline <= time.time():  # stopping now would only requeue forever
        warn(
            f"--stop-before-end-minutes {minutes_before} is more than the time left in job "
            f"{job_id}; not stopping early"
        )
        return None
    return deadline

"""Preemption: signals set a flag; the loop acts at a step boundary once all ranks agree.

Nothing is done inside a signal handler except setting the flag: saving a checkpoint
from a handler can fail at random (it may interrupt a collective or a write). At a step
boundary the loop puts ``local_request()`` into one small agreement across ranks
(``Strategy.max_over_ranks``), so all ranks stop in the same step. ``AgreementSchedule``
says at which boundaries: about every ``--preempt-check-seconds`` (0.5) of training, not
at every step, and less often when the agreement itself would take more than 1% of it.

Exit status 3 (``EXIT_REQUEUE``) means "a checkpoint was saved and there is more to do":
``slurm/run.sh`` turns it into a requeue. Under Slurm, rank 0 also runs
``scontrol requeue <job>`` itself after a preemption save (array tasks as
``<array job id>_<task id>``); where ``scontrol`` is missing it says so and leaves the
requeue to the exit status.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from dmltrain.config import AGREEMENT_MOST_SECONDS, AGREEMENT_SHARE
from dmltrain.errors import EXIT_REQUEUE


class StartupSignals:
    """The handler of SIGINT, SIGTERM and SIGUSR1 from the command's start until the run
    takes them over (``PreemptionWatcher``), which acts on those that came.

    SIGINT raises ``KeyboardInterrupt`` as Python's own handler does, so a long start-up
    stops at once; but Python drops an exception raised in a weakref callback or a
    destructor ("Exception ignored in ..."), where a Ctrl-C would be lost. SIGTERM and
    SIGUSR1 are only kept: by their default action they would end the process, and Slurm
    sends a job shorter than the batch script's notice its USR1 at the very start."""

    NAMES = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.received: list[str] = []
        self.defer = False  # inside ``deferring``

    def __call__(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        if name == "SIGINT" and not self.defer:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """A Ctrl-C inside the block is raised when it ends: raised inside torch's import,
        in a Python callback of its C++ code, it aborts the process (std::terminate)."""
        self.defer = True
        try:
            yield
        finally:
            self.defer = False
        if "SIGINT" in self.received:
            raise KeyboardInterrupt

    @classmethod
    def install(cls) -> "StartupSignals":
        """In a process of the command's own; a signal it was started ignoring (a shell's
        background job ignores SIGINT) stays ignored."""
        handler = cls()
        for name in cls.NAMES:
            number = signal.Signals[name]
            if signal.getsignal(number) is _default(number):
                signal.signal(number, handler)
        return handler


def _default(number: int) -> object:
    return signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL


class PreemptionWatcher:
    """Turns the given signals (and an optional deadline) into a flag."""

    def __init__(
        self, signal_names: list[str], deadline: float | None = None, worker: bool = False
    ) -> None:
        self.requested: str | None = None
        self.deadline = deadline
        self.parent = os.getppid()  # a --nprocs worker's parent: gone, it sends SIGINT
        self.worker = worker  # a --nprocs worker (its parent's end is told apart)
        self._received: list[int] = []  # signal numbers not yet taken by ``take_received``
        self._previous: dict[int, object] = {}
        self._defer: str | None = None  # a signal that waits for the deadline (Deadline)
        self._noticed: str | None = None  # the deferred signal came: said at the next boundary
        self._say: Callable[[str], None] = lambda line: None
        early: list[str] = []  # what came during start-up (StartupSignals)
        for name in StartupSignals.NAMES:
            number = signal.Signals[name]
            held = signal.getsignal(number)
            if isinstance(held, StartupSignals):
                early += held.received
                if name not in signal_names:  # not a preemption signal: as before the start
                    signal.signal(number, _default(number))  # type: ignore[arg-type]
        if "SIGINT" in early:
            raise KeyboardInterrupt  # a Ctrl-C during start-up that Python dropped
        for name in signal_names:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._handle)
        for name in dict.fromkeys(early):
            if name in signal_names:
                self._handle(signal.Signals[name], None)
            else:
                signal.raise_signal(signal.Signals[name])  # its default action, now

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # only flags: the loop (or the --nprocs parent, which forwards) does the work
        name = signal.Signals(signum).name
        if name == self._defer:  # the first: a short job's early notice (Deadline)
            self._defer, self._noticed = None, name
        else:
            self.requested = self.requested or name
        self._received.append(signum)

    def take_received(self) -> list[int]:
        """The signals received since the last call, oldest first."""
        taken, self._received = self._received, []
        return taken

    def stop_at(self, stop: "Deadline | None", say: Callable[[str], None]) -> None:
        """The job's own deadline (every rank the same); ``say``: rank 0's printer."""
        self.deadline = None if stop is None else stop.at
        self._defer = None if stop is None else stop.defer
        self._say = say
        if self._defer is not None and self.requested == self._defer:  # came during setup
            self._defer, self._noticed, self.requested = None, self.requested, None

    def local_request(self) -> bool:
        if self._noticed is not None:
            noticed, self._noticed = self._noticed, None
            self._say(
                f"dmltrain: {noticed} now is the batch script's time-limit notice, "
                "sized for longer jobs: this job checkpoints and stops at its own deadline"
            )
        if self.requested is None and self.deadline is not None and time.time() >= self.deadline:
            self.requested = "time limit"
        return self.requested is not None

    def why(self) -> str:
        """Why the run stops: the signal, the time limit, or a --nprocs worker's parent that
        ended (torch's workers get SIGINT when their parent dies)."""
        if self.requested == "SIGINT" and self.worker:
            # The SIGINT comes as the parent's threads end; the worker is handed to another
            # parent only once the last of them has (a moment later on a loaded machine).
            for _ in range(20):
                if os.getppid() != self.parent:
                    return "the --nprocs parent process ended"
                time.sleep(0.05)
        return self.requested or "another rank was signalled"

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]


class AgreementSchedule:
    """Which step boundaries the ranks agree at on stopping (a preemption, a timed
    checkpoint).

    The agreement is a collective: at every step it would add a round trip between the
    ranks and make each wait for the slowest (a large part of a small step:
    benchmarks/findings.md). So the ranks agree about every ``seconds`` of training: at an
    agreement each rank proposes how many steps that is by its own clock, and the smallest
    proposal, agreed in the same collective, is the count to the next one. Every rank
    counts the same boundaries, so all stop at the same one.

    The agreement's cost grows with the number of ranks (``control.over_ranks``: about
    log2 N rounds), so the interval grows with it: each agreement also carries the
    duration of the rank's previous one, and the shortest over ranks (the last rank to
    arrive waits only for the collective itself) is the cost. The interval is
    ``seconds``, or ``cost / share`` when that is longer, so the agreements take at most
    ``share`` of training time, up to ``most_seconds`` (a signal must still be acted on
    well within a scheduler's grace, which is minutes for dmltrain's batch scripts).
    ``seconds=0`` agrees at every step, whatever the cost."""

    def __init__(
        self,
        seconds: float = 0.5,
        most_steps: int = 10_000,
        share: float = AGREEMENT_SHARE,
        most_seconds: float = AGREEMENT_MOST_SECONDS,
    ) -> None:
        self.seconds, self.most_steps = seconds, most_steps
        self.share, self.most_seconds = share, most_seconds
        self.cost = 0.0  # the agreed cost of one agreement, in seconds
        self.took = 0.0  # this rank's duration of its last agreement, in seconds
        self._every = 1  # boundaries from the last agreement to the next (the first: 1)
        self._left = 1  # boundaries until the next agreement
        self._since = time.monotonic()  # the last agreement (at first: the start)

    def interval(self) -> float:
        """The seconds of training from one agreement to the next."""
        if self.seconds <= 0:
            return 0.0
        return min(max(self.seconds, self.cost / self.share), max(self.seconds, self.most_seconds))

    def due(self) -> bool:
        """Called at every step boundary, on every rank: whether to agree at this one."""
        self._left -= 1
        return self._left <= 0

    def proposal(self) -> int:
        """This rank's number of steps that take about ``interval()`` (at least 1)."""
        now = time.monotonic()
        per_step = (now - self._since) / self._every
        self._since = now
        if per_step <= 0:
            return self.most_steps
        return max(1, min(self.most_steps, int(self.interval() / per_step)))

    def agreed(self, steps: int, cost: float) -> None:
        """What all ranks agreed on: the next agreement is ``steps`` boundaries on, and one
        agreement costs ``cost`` seconds."""
        self._every = self._left = steps
        self.cost = cost


def agree(
    schedule: AgreementSchedule,
    watcher: PreemptionWatcher,
    max_over_ranks: Callable[[list[int]], list[int]],
    save_due: Callable[[], bool],
    finish_due: Callable[[], bool] = lambda: False,
) -> tuple[bool, bool, bool]:
    """At a step boundary, on every rank: whether all ranks stop here (any rank was
    signalled or reached the deadline), whether a timed checkpoint is due and whether the
    run is done (``--max-time``; both on any rank), agreed in one collective when
    ``schedule`` says it is time; else all False."""
    if not schedule.due():
        return False, False, False
    request, wait = watcher.local_request(), schedule.proposal()
    took_us = min(int(schedule.took * 1e6), 2**31 - 1)  # the collective is of int32
    began = time.perf_counter()
    stop, save, smallest, shortest, finish = max_over_ranks(
        [request, save_due(), -wait, -took_us, finish_due()]
    )
    schedule.took = time.perf_counter() - began
    schedule.agreed(-smallest, -shortest / 1e6)
    return bool(stop), bool(save), bool(finish)


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


def slurm_times(job_id: str | None) -> tuple[float, float] | None:
    """The job's start and end time (seconds since the epoch) as Slurm reports them, or
    None."""
    if job_id is None or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%S %e"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split()
        start, end = (time.mktime(time.strptime(t, "%Y-%m-%dT%H:%M:%S")) for t in out)
        return start, end
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None  # unlimited, unknown, or not a Slurm job


def pbs_times(job_id: str | None) -> tuple[float, float] | None:
    """The job's start and end time (seconds since the epoch) from PBS's ``qstat -f``: its
    walltime limit and the walltime it has used, or None."""
    if job_id is None or shutil.which("qstat") is None:
        return None
    try:
        out = subprocess.run(
            ["qstat", "-f", job_id], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    limit = re.search(r"^\s*Resource_List\.walltime = (\d+):(\d+):(\d+)\s*$", out, re.M)
    used = re.search(r"^\s*resources_used\.walltime = (\d+):(\d+):(\d+)\s*$", out, re.M)
    if limit is None:
        return None  # not a PBS job, or no walltime
    seconds = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in
               (limit.groups(), used.groups() if used else ("0", "0", "0"))]  # fmt: skip
    start = time.time() - seconds[1]
    return start, start + seconds[0]


# A job shorter than --stop-before-end-minutes stops this share of its length before its end.
SHORT_JOB_SHARE = 0.25
# The batch scripts' time-limit notice (#SBATCH --signal=USR1@300) comes at once in such a
# job; the job takes it for its own deadline (``Deadline.defer``).
NOTICE_SIGNAL = "SIGUSR1"


@dataclass(frozen=True)
class Deadline:
    """When the job checkpoints and stops by itself (seconds since the epoch), and a signal
    that, coming before then, means only that (a short job's early time-limit notice)."""

    at: float
    defer: str | None = None


def stop_deadline(
    job_id: str | None, minutes_before: float, warn: Callable[[str], None]
) -> Deadline | None:
    """When to checkpoint and stop: ``minutes_before`` the Slurm or PBS job's time limit,
    or in a job too short for that, ``SHORT_JOB_SHARE`` of its length before it; None
    outside a batch job, without a limit, or when that moment has passed already."""
    times = slurm_times(job_id) or pbs_times(job_id)
    if times is None:
        return None
    start, end = times
    now = time.time()
    if end - 60 * minutes_before > now:
        return Deadline(end - 60 * minutes_before)
    margin = SHORT_JOB_SHARE * (end - start)
    if end - margin <= now:  # stopping now would only requeue forever
        warn(
            f"--stop-before-end-minutes {minutes_before} is more than the time left in job "
            f"{job_id}, and so is a quarter of its length; not stopping early: a checkpoint "
            "is saved only at the usual points before the time limit ends the job"
        )
        return None
    warn(
        f"--stop-before-end-minutes {minutes_before} is more than the time left in job "
        f"{job_id}: it checkpoints and stops {margin:.0f} s before its time limit instead, and "
        f"a {NOTICE_SIGNAL} before then (the batch script's notice) waits for that"
    )
    return Deadline(end - margin, defer=NOTICE_SIGNAL)

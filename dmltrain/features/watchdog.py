"""Hangs: a watchdog thread on every rank that notices when no step completes.

A job that hangs burns its allocation in silence, and the collective timeout that ends it
says only which rank did not answer, not where it is. Every rank runs a thread that reads
the step clock (``monitor.StepClock``: when the last step ended, the slowest step so far,
whether the rank is inside ``train_step`` and since when). When no step has ended for the
timeout (``--hang-timeout`` seconds, or 20 times the slowest step so far if that is
longer; in auto mode below ``--dist-timeout``, so before a collective gives up), every
rank's thread writes ``RUN_DIR/hang/rank-N.txt``: a first line of JSON (rank, host, steps
done, how long it has been inside ``train_step`` if it is, its innermost frame of user
code), then its main thread's stack and every thread's (``faulthandler``); with NCCL,
also the flight recorder's dump (``nccl-rank-N.pkl``).

Then the run ends with the lost-peer exit status (5), which the batch scripts requeue:

- where the stacks name a culprit (a rank inside ``train_step`` or at another step than
  the others, or one that wrote no stack: stopped, or its node gone), at once: rank 0
  reads the stacks (up to ``GATHER_SECONDS``), prints the line that names it and every
  rank leaves with status 5. The run ends at the timeout plus that gathering, not after
  a collective gives up (``--dist-timeout``, minutes). When rank 0 is the silent one, the
  lowest rank that wrote its stack reports in its place;
- where every rank waits in the same place (a network fault: a collective cannot
  complete), the collective gives up (``--dist-timeout``) and its roll call names the
  ranks that stopped answering (``explain`` adds where the ranks stand); where none
  gives up (every rank stuck outside one), after a grace period rank 0 prints the line
  itself and every rank leaves with status 5.

The thread only reads: the loop does not wait for it, and it costs nothing per step.
The watch starts after the first step (which may compile) and pauses around validation
and checkpoints (``paused``). A step that ends after the stacks were written was a long
one: the watch goes on.
"""

import contextlib
import faulthandler
import json
import os
import re
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dmltrain import compat
from dmltrain.config import HANG_AUTO_FLOOR, HANG_AUTO_SHARE, HANG_MULTIPLE, HangConfig
from dmltrain.errors import EXIT_PEER_LOST, PeerLost
from dmltrain.features.monitor import StepClock
from dmltrain.runtime.launch import DistInfo
from dmltrain.runtime.peers import named


def limits(hang_timeout: float, dist_timeout: float) -> tuple[float, float]:
    """(the shortest timeout, the longest): ``--hang-timeout`` and no limit; for 0 (auto)
    180 s and below ``--dist-timeout``, so the stacks are written before a collective
    waiting for the hung rank gives up."""
    if hang_timeout:
        return hang_timeout, float("inf")
    ceiling = HANG_AUTO_SHARE * dist_timeout
    return min(HANG_AUTO_FLOOR, ceiling), ceiling


# Rank 0 waits this long for the other ranks' files. Every rank's watch fires within a
# step of the others' (the timeout is at least 20 steps), so a rank whose file is still
# missing after this wrote none.
GATHER_SECONDS = 15.0
SILENT_NAMED = 8  # the silent ranks a line names, then a count
GRACE = 30.0  # after --dist-timeout: for a collective to give up (and its roll call)


class Watchdog:
    def __init__(
        self,
        clock: StepClock,
        run_dir: Path,
        rank: int,
        world_size: int,
        host: str,
        timeout: float,
        ceiling: float,
        dist_timeout: float,
        say: Callable[[str], None],
        nccl_dump: Callable[[], bytes] | None = None,
        leave: Callable[[int], Any] = os._exit,
        peers: Sequence[tuple[str, int]] = (),
    ) -> None:
        """``dist_timeout``: when a collective waiting for a hung rank gives up (infinite
        where there is none: one process)."""
        self.clock, self.directory = clock, run_dir / "hang"
        self.rank, self.world_size, self.host = rank, world_size, host
        self.minimum, self.ceiling, self.dist_timeout = timeout, ceiling, dist_timeout
        # for a collective to give up (and its roll call to report) before this rank does
        self.grace = dist_timeout + GRACE if dist_timeout != float("inf") else 0.0
        self.say, self.nccl_dump, self.leave = say, nccl_dump, leave
        self.peers = peers  # (host, pid) of every rank: where a silent rank is
        self.fired = False  # this rank's stack is written
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dmltrain-watchdog", daemon=True)

    @classmethod
    def for_run(
        cls,
        clock: StepClock,
        run_dir: Path,
        dist: DistInfo,
        host: str,
        config: HangConfig,
        dist_timeout: float,
        nccl_dump: Callable[[], bytes] | None,
        peers: Sequence[tuple[str, int]] = (),
        leave: Callable[[int], Any] = os._exit,
    ) -> "Watchdog":
        """A rank's watchdog by the run's --hang-timeout and --dist-timeout; a hang's
        line goes to stderr; ``leave`` ends the process (with the job's status recorded)."""
        shortest, longest = limits(config.hang_timeout, dist_timeout)
        return cls(
            clock,
            run_dir,
            dist.rank,
            dist.world_size,
            host,
            shortest,
            longest,
            dist_timeout if dist.world_size > 1 else float("inf"),  # no collective
            lambda line: print(line, file=sys.stderr, flush=True),
            nccl_dump,
            leave,
            peers,
        )

    def start(self) -> None:
        """Watch from here. Rank 0 first moves an earlier job's ``hang/`` (a hang that was
        requeued) to ``hang-TIME/``: its stacks and report are kept, and not read as this
        job's. (The other ranks write theirs a timeout after a step at the earliest.)"""
        if self.rank == 0 and self.directory.is_dir():
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.directory.stat().st_mtime))
            kept = self.directory.with_name(f"hang-{stamp}")
            with contextlib.suppress(OSError):  # another job's clean-up got there first
                self.directory.rename(kept if not kept.exists() else kept.with_name(
                    f"{kept.name}-{os.getpid()}"))  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def timeout(self) -> float:
        """The minimum, or the slowest step so far times ``HANG_MULTIPLE`` if longer; in auto
        mode never past the collectives' own timeout (``ceiling``)."""
        return min(max(self.minimum, HANG_MULTIPLE * self.clock.slowest), self.ceiling)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No watch inside (validation, checkpoints); the wait restarts afterwards."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.clock.last_end = time.perf_counter()

    def _watch(self) -> None:
        stalled_at = None  # the step boundary the stacks were written after
        while not self._stop.wait(min(1.0, self.minimum / 4)):
            clock = self.clock
            if self._paused or not clock.slowest:  # not before the first step has ended
                continue
            waited = time.perf_counter() - clock.last_end
            if stalled_at is not None and clock.last_end != stalled_at:
                stalled_at = None  # steps go on: a long step after all
            elif stalled_at is None and waited > self.timeout():
                self._write_stack()
                stalled_at = clock.last_end
                if self._report_a_culprit(waited):
                    return
            elif stalled_at is not None and (self.directory / "report.txt").exists():
                self.leave(_reported(self.directory / "report.txt"))  # in rank 0's place
                return
            elif stalled_at is not None and waited > self.timeout() + self.grace:
                # no collective gave up (that path reports, in ``explain``): stop here
                self._stop_run(waited)
                return

    def _write_stack(self) -> None:
        """``hang/rank-N.txt``: where this rank is, then its threads' stacks."""
        self.directory.mkdir(parents=True, exist_ok=True)
        inside = self.clock.inside_since
        where: dict[str, Any] = {
            "rank": self.rank,
            "host": self.host,
            "steps": self.clock.steps_done,
            "in_train_step_s": None if inside is None else time.perf_counter() - inside,
            "alone_in": self.clock.alone_in,  # a callback event only this rank runs
            "written_at": time.time(),  # the wall clock: the files are read on other hosts
        }
        main = compat.main_thread_frame()
        stack = traceback.format_stack(main) if main is not None else []
        where["frame"] = _user_frame(traceback.extract_stack(main) if main is not None else [])
        path = self.directory / f"rank-{self.rank}.txt"
        with open(path, "w") as handle:
            handle.write(json.dumps(where) + "\nMain thread (most recent call last):\n")
            handle.write("".join(stack) + "\nEvery thread (faulthandler):\n")
            handle.flush()
            faulthandler.dump_traceback(handle, all_threads=True)
        if self.nccl_dump is not None:
            with contextlib.suppress(Exception):  # best effort: the recorder may be off
                (self.directory / f"nccl-rank-{self.rank}.pkl").write_bytes(self.nccl_dump())
        self.fired = True

    def _report_a_culprit(self, waited: float) -> bool:
        """Where the stacks name a rank that is not where the others are, rank 0 says so
        and every rank leaves with status 5 (then this does not return); False when every
        rank waits in the same place, for the collective's roll call to name who is lost,
        and when the collective would give up before the stacks are gathered.

        The other ranks only look for rank 0's report (and, if rank 0 wrote no stack, for
        the stacks of the ranks below them): no rank but the reporter reads every file."""
        if waited + GATHER_SECONDS >= self.dist_timeout:
            return False  # the collective gives up first, and its line names the same
        report = self.directory / "report.txt"
        if self.rank != 0:
            deadline = time.monotonic() + GATHER_SECONDS + 5.0
            while not report.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if report.exists():
                self.leave(_reported(report))
                return True
            below = (self.directory / f"rank-{r}.txt" for r in range(self.rank))
            if any(path.exists() for path in below):
                return False  # rank 0 (or one below this) found no culprit: it reports
        where, steps, named = self._where(GATHER_SECONDS)
        if not named:
            return False
        self._leave_with(report, waited, where, steps)
        return True

    def _leave_with(self, report: Path, waited: float, where: str, steps: int) -> None:
        bug = "which only it runs" in where  # a rank alone in a callback event: not requeued
        status = 1 if bug else EXIT_PEER_LOST
        then = "fix the callback" if bug else "requeue to resume from the last checkpoint"
        line = (
            f"dmltrain: hang: no step ended for {waited:.0f} s (timeout "
            f"{self.timeout():.0f} s, after {steps} step(s)): {where}; exit status "
            f"{status}: {then}"
        )
        report.write_text(line + "\n")
        self.say(line)
        time.sleep(1.0)  # the others see the report and leave first: no rank is killed
        self.leave(status)

    def _stop_run(self, waited: float) -> None:
        """Every rank stuck outside collectives: rank 0 says where, all leave with 5."""
        report = self.directory / "report.txt"
        if self.rank == 0:
            where, steps, _ = self._where(GATHER_SECONDS)
            self._leave_with(report, waited, where, steps)
        else:  # leave after rank 0 has read this rank's file (or gave up waiting)
            deadline = time.monotonic() + 2 * GATHER_SECONDS
            while not report.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        self.leave(_reported(report))

    def explain(self, lost: PeerLost) -> PeerLost:
        """A collective gave up waiting for a peer: after a hang's stacks were written, the
        line also says where the ranks that are not where the others are stand."""
        if not self.fired:
            return lost
        where, _, _ = self._where(5.0)
        return PeerLost(f"{lost}; {where}")

    def _where(self, patience: float) -> tuple[str, int, bool]:
        """Who is not where the others are (inside ``train_step`` while the others wait in
        the step's collectives, at another step, or silent: no file), the others' step
        count, and whether any rank is so named, from the ranks' files (waiting up to
        ``patience`` seconds for them)."""
        deadline = time.monotonic() + patience
        found: dict[int, dict[str, Any]] = {}
        while True:
            for rank in range(self.world_size):
                if rank not in found:
                    with contextlib.suppress(OSError, ValueError):
                        text = (self.directory / f"rank-{rank}.txt").read_text()
                        if "Every thread" in text:  # written whole
                            found[rank] = json.loads(text.splitlines()[0])
            if len(found) == self.world_size or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        most = Counter(r["steps"] for r in found.values()).most_common(1)[0][0]
        now = time.time()
        odd = [
            r
            for r in found.values()
            if r["steps"] != most or r["in_train_step_s"] is not None or r.get("alone_in")
        ]
        parts = [
            f"rank {r['rank']} on {r['host']} {_state(r, now)} at {r['frame']}"
            for r in sorted(odd, key=lambda r: r["rank"])
        ]
        silent = [rank for rank in range(self.world_size) if rank not in found]
        if silent:
            parts.append(f"no stack from {self._silent(silent)}")
        who = "; ".join(parts) or "every rank waits in the same place"
        return f"{who} (every rank's stack: {self.directory})", most, bool(parts)

    def _silent(self, ranks: list[int]) -> str:
        """The ranks that wrote no stack, with their hosts, and how a rank of this host is
        (stopped, gone): the first few, then a count."""
        shown = [
            named(rank, self.peers, self.host) if rank < len(self.peers) else f"rank {rank}"
            for rank in ranks[:SILENT_NAMED]
        ]
        more = len(ranks) - SILENT_NAMED
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _state(rank: dict[str, Any], now: float) -> str:
    """Where a rank that is not where the others are stands, from its file's first line."""
    if rank.get("alone_in"):
        return (
            f"is inside the callback event {rank['alone_in']}, which only it runs (a "
            "collective there waits for ranks that never enter it: a bug, not requeued)"
        )
    if rank["in_train_step_s"] is not None:
        inside = rank["in_train_step_s"] + now - rank["written_at"]
        return f"is inside train_step for {inside:.0f} s"
    return f"is after {rank['steps']} step(s)"


def _reported(report: Path) -> int:
    """The exit status the reporting rank's line in ``report`` names; a lost peer's if none."""
    with contextlib.suppress(OSError):
        found = re.search(r"; exit status (\d+):", report.read_text())
        if found:
            return int(found.group(1))
    return EXIT_PEER_LOST


def _user_frame(frames: Iterable[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch, dmltrain and the standard library's threading
    and multiprocessing: the experiment's code the rank is in (or where it called in)."""
    library = (
        f"{os.sep}torch{os.sep}",
        f"{os.sep}dmltrain{os.sep}",
        "threading.py",
        f"{os.sep}multiprocessing{os.sep}",
    )
    for frame in reversed(list(frames)):
        if not any(part in frame.filename for part in library):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "(no frame outside torch and dmltrain)"

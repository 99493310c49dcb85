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

- where the other ranks wait in a collective for a hung rank, the collective gives up
  (``--dist-timeout``), and their one line (``PeerLost``) names the ranks that are not
  where the others are, and where they are (``explain``);
- where no collective gives up (every rank stuck outside one), after a grace period
  rank 0 prints that line itself and every rank leaves with status 5.

The thread only reads: the loop does not wait for it, and it costs nothing per step.
The watch starts after the first step (which may compile) and pauses around validation
and checkpoints (``paused``). A step that ends after the stacks were written was a long
one: the watch goes on.
"""

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dmltrain import compat
from dmltrain.config import HANG_AUTO_FLOOR, HANG_AUTO_SHARE, HANG_MULTIPLE, HangConfig
from dmltrain.errors import EXIT_PEER_LOST, PeerLost
from dmltrain.features.monitor import StepClock
from dmltrain.runtime.launch import DistInfo


def limits(hang_timeout: float, dist_timeout: float) -> tuple[float, float]:
    """(the shortest timeout, the longest): ``--hang-timeout`` and no limit; for 0 (auto)
    180 s and below ``--dist-timeout``, so the stacks are written before a collective
    waiting for the hung rank gives up."""
    if hang_timeout:
        return hang_timeout, float("inf")
    ceiling = HANG_AUTO_SHARE * dist_timeout
    return min(HANG_AUTO_FLOOR, ceiling), ceiling


GATHER_SECONDS = 30.0  # rank 0 waits this long for the other ranks' files
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
        grace: float,
        say: Callable[[str], None],
        nccl_dump: Callable[[], bytes] | None = None,
        leave: Callable[[int], Any] = os._exit,
    ) -> None:
        self.clock, self.directory = clock, run_dir / "hang"
        self.rank, self.world_size, self.host = rank, world_size, host
        self.minimum, self.ceiling, self.grace = timeout, ceiling, grace
        self.say, self.nccl_dump, self.leave = say, nccl_dump, leave
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
    ) -> "Watchdog":
        """A rank's watchdog by the run's --hang-timeout and --dist-timeout; a hang's
        line goes to stderr."""
        shortest, longest = limits(config.hang_timeout, dist_timeout)
        grace = dist_timeout + GRACE if dist.world_size > 1 else 0.0  # no collective
        return cls(
            clock,
            run_dir,
            dist.rank,
            dist.world_size,
            host,
            shortest,
            longest,
            grace,
            lambda line: print(line, file=sys.stderr, flush=True),
            nccl_dump,
        )

    def start(self) -> None:
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

    def _stop_run(self, waited: float) -> None:
        """Every rank stuck outside collectives: rank 0 says where, all leave with 5."""
        report = self.directory / "report.txt"
        if self.rank == 0:
            where, steps = self.where(GATHER_SECONDS)
            line = (
                f"dmltrain: hang: no step ended for {waited:.0f} s (timeout "
                f"{self.timeout():.0f} s, after {steps} step(s)): {where}; exit status "
                f"{EXIT_PEER_LOST}: requeue to resume from the last checkpoint"
            )
            report.write_text(line + "\n")
            self.say(line)
            time.sleep(1.0)  # the others see the report and leave first: no rank is killed
        else:  # leave after rank 0 has read this rank's file (or gave up waiting)
            deadline = time.monotonic() + 2 * GATHER_SECONDS
            while not report.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        self.leave(EXIT_PEER_LOST)

    def explain(self, lost: PeerLost) -> PeerLost:
        """A collective gave up waiting for a peer: after a hang's stacks were written, the
        line also says where the ranks that are not where the others are stand."""
        if not self.fired:
            return lost
        where, _ = self.where(5.0)
        return PeerLost(f"{lost}; {where}")

    def where(self, patience: float) -> tuple[str, int]:
        """Who is not where the others are (inside ``train_step`` while the others wait in
        the step's collectives, or at another step), and the others' step count, from the
        ranks' files (waiting up to ``patience`` seconds for them)."""
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
        odd = [r for r in found.values() if r["steps"] != most or r["in_train_step_s"] is not None]
        parts = [
            f"rank {r['rank']} on {r['host']} "
            + (
                f"is inside train_step for {r['in_train_step_s'] + now - r['written_at']:.0f} s"
                if r["in_train_step_s"] is not None
                else f"is after {r['steps']} step(s)"
            )
            + f" at {r['frame']}"
            for r in sorted(odd, key=lambda r: r["rank"])
        ]
        silent = [str(rank) for rank in range(self.world_size) if rank not in found]
        if silent:
            parts.append(f"no stack from rank(s) {', '.join(silent)}")
        who = "; ".join(parts) or "every rank waits in the same place"
        return f"{who} (every rank's stack: {self.directory})", most


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

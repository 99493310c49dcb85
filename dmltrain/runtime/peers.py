"""Who stopped answering when a collective failed: the surviving ranks' roll call.

A failed collective says little: Gloo reports a closed connection or a timeout, not which
rank is gone. So each surviving rank checks in through the job's key-value store (the
TCPStore that rank 0 holds for the process group) and waits a few seconds for the others;
the ranks that never check in are named, with their hosts. A rank on this host is also
looked up in ``/proc``: gone, or stopped (SIGSTOP). When the store itself does not
answer, rank 0, which holds it, is the one this rank lost contact with.
"""

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dmltrain.errors import UserError, first_line

# What a collective's error says when another rank died, hangs or cannot be reached.
_LOST = (
    "connection closed by peer",
    "connection reset",
    "timed out",
    "broken pipe",
    "connection refused",
    "no route to host",
)


def means_lost(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a collective, means that another rank went away (not a
    UserError, which says what is wrong itself)."""
    if isinstance(exc, UserError):
        return False
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(s in text for s in _LOST)


@dataclass(frozen=True)
class Rank0Busy:
    """Rank 0's store answers the roll call, rank 0 itself does not: it is alive and works
    alone (a save that outlasts --dist-timeout, a callback). It will find the others gone
    at its next collective and report the job's status itself."""


def roll_call(
    store: Any, rank: int, world_size: int, window: float
) -> list[int] | str | Rank0Busy | None:
    """The line a rank that failed in its own code left (``announce_failure``), if one did;
    else check in as alive and wait up to ``window`` seconds for every rank to do the same,
    and return the ranks that did not. None when the store does not answer; ``Rank0Busy``
    when it answers but rank 0 does not call the roll.

    Given up after ``window`` and a few seconds (``_within``)."""
    return _within(
        window + 6.0,
        lambda: _failure_announced(store) or _roll_call(store, rank, world_size, window),
    )


def _within(seconds: float, ask: Callable[[], Any]) -> Any:
    """``ask()``, in a thread of its own, or None when it has not answered in ``seconds``:
    on a link that is down, a store request waits for TCP to give up (many minutes),
    whatever its timeout."""
    result: list[Any] = [None]
    thread = threading.Thread(
        target=lambda: result.__setitem__(0, ask()), name="dmltrain-store-request", daemon=True
    )
    thread.start()
    thread.join(seconds)
    return result[0]


def _roll_call(
    store: Any, rank: int, world_size: int, window: float
) -> list[int] | Rank0Busy | None:
    """Each rank checks in; rank 0, which holds the store, waits for them, finds who did
    not and posts that, which the others read: a few requests a rank, not one a peer."""
    try:
        store.set_timeout(timedelta(seconds=5))
        store.set(f"{_ALIVE}/{rank}", "1")
        if rank != 0:
            store.add(_ALIVE, 1)  # a count for rank 0 to poll, not world_size keys
            store.set_timeout(timedelta(seconds=window + 4))
            try:
                return list(json.loads(store.get(_MISSING)))
            except Exception:  # no finding: is the store (rank 0's process) still there?
                store.set_timeout(timedelta(seconds=3))
                store.add(_ALIVE, 0)
                return Rank0Busy()
        deadline = time.monotonic() + window
        while store.add(_ALIVE, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        missing = [r for r in range(1, world_size) if not store.check([f"{_ALIVE}/{r}"])]
        store.set(_MISSING, json.dumps(missing))
        time.sleep(1.0)  # the store lives in this process: the others may still be reading
        # Ranks that check in meanwhile were alive, waiting in a collective that failed only
        # when a survivor left: not lost, though they may have left by now too.
        return [r for r in missing if not store.check([f"{_ALIVE}/{r}"])]
    except Exception:  # a store that cannot be reached raises whatever its transport does
        return None


_ALIVE = "dmltrain/alive"  # each rank's check-in, under its rank; their count
_MISSING = "dmltrain/missing"  # rank 0's finding: the ranks that did not check in


# A rank that fails in its own code says so here before it leaves; the others, whose
# collectives then fail, read it before calling the roll: one key, not one per rank. (Rank 0
# holds the store: when rank 0 fails, the store goes with it, and its exit status, in the
# batch scripts' --status-file, tells the job's outcome.)
_FAILED = "dmltrain/failed"


def announce_failure(store: Any, line: str) -> None:
    """Leave ``line`` in the store, unless a rank that failed earlier left its own."""
    _within(6.0, lambda: _announce(store, line))


def _announce(store: Any, line: str) -> None:
    try:
        store.set_timeout(timedelta(seconds=5))
        store.compare_set(_FAILED, "", line)  # set only where no line is yet
    except Exception:  # a store out of reach: the others will report a lost peer
        pass


def _failure_announced(store: Any) -> str | None:
    try:
        store.set_timeout(timedelta(seconds=5))
        if not store.check([_FAILED]):
            return None
        return str(store.get(_FAILED).decode())
    except Exception:
        return None


def local_state(pid: int) -> str:
    """How process ``pid`` of this host is: 'running', 'stopped' (SIGSTOP) or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return "gone"
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "running")


def _gone(missing: list[int], peers: Sequence[tuple[str, int]], here: str) -> list[int]:
    """Of ``missing``, the ranks on this host that are not running and those on hosts
    from which no rank checked in."""
    absent = set(missing)
    answered = {host for r, (host, _) in enumerate(peers) if r not in absent}
    return [
        r
        for r in missing
        if r < len(peers)
        and (
            local_state(peers[r][1]) != "running"
            if peers[r][0] == here
            else peers[r][0] not in answered
        )
    ]


def named(rank: int, peers: Sequence[tuple[str, int]], here: str) -> str:
    """'rank R on HOST (state)': a rank of this host as ``/proc`` says it is (gone,
    stopped), another host's as not answering."""
    host, pid = peers[rank]
    state = local_state(pid) if host == here else "not answering"
    return f"rank {rank} on {host} ({state})"


def describe(
    exc: BaseException,
    missing: list[int] | Rank0Busy | None,
    peers: Sequence[tuple[str, int]],
    rank: int,
    here: str,
) -> str:
    """One line: which ranks on which hosts this rank lost contact with, and the error.

    Of the ranks that did not check in, those named are the ones that are gone: a rank of
    this host whose process is not running, a rank of a host none of whose ranks checked
    in. A survivor still waiting in a collective that has not failed yet (its neighbours
    are alive; it gives up at --dist-timeout) misses the roll call too, and is not named
    while another rank explains the loss; where none does, every rank missing is named."""
    busy = isinstance(missing, Rank0Busy)
    # the store is rank 0's: where it does not answer, or rank 0 does not, it is rank 0
    lost = (_gone(missing, peers, here) or missing) if isinstance(missing, list) else [0]
    parts = []
    for r in lost:
        if r == rank or r >= len(peers):
            continue
        if busy:
            busy_state = "alive, busy: its store answers, it does not; it reports the job's status"
            parts.append(f"rank {r} on {peers[r][0]} ({busy_state})")
        else:
            parts.append(named(r, peers, here))
    if not parts:  # every rank checked in (one may have left since): this host's, looked up
        gone = ((r, local_state(pid)) for r, (host, pid) in enumerate(peers) if host == here)
        parts = [f"rank {r} on {here} ({state})" for r, state in gone if state != "running"]
    who = ", ".join(parts) if parts else "another rank"
    error = re.sub(r"^\[[^\]]*\]\s*", "", first_line(exc, None))  # no "[file.cc:78]"
    if len(error) > 160:
        error = error[:160] + "..."
    return f"lost contact with {who}: {error}"

"""The roll call after a failed collective (dmltrain/runtime/peers.py) with a real TCPStore; the
whole path, with real ranks on two hosts, is in test_two_nodes and test_distributed."""

import datetime
import signal
import socket
import subprocess
import threading
import time

import torch.distributed as dist

from dmltrain.runtime.launch import free_port
from dmltrain.runtime.peers import Rank0Busy, describe, local_state, means_lost, roll_call


def store(port: int, master: bool) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=10)
    return dist.TCPStore("127.0.0.1", port, 2, is_master=master, timeout=timeout,
                         wait_for_workers=False)  # fmt: skip


def test_collective_errors_that_mean_a_peer_is_lost():
    assert means_lost(RuntimeError("[gloo/x.cc:78] Timed out waiting 20000ms for recv"))
    assert means_lost(RuntimeError("Connection closed by peer [10.0.0.2]:1234"))
    assert not means_lost(RuntimeError("CUDA out of memory"))


def test_roll_call_names_the_rank_that_never_checks_in():
    port = free_port()
    master, other = store(port, True), store(port, False)
    found: list = []
    thread = threading.Thread(target=lambda: found.append(roll_call(other, 1, 2, window=5.0)))
    thread.start()
    assert roll_call(master, 0, 2, window=5.0) == []  # both checked in
    thread.join()
    assert found == [[]]
    lonely = store(free_port(), True)
    started = time.monotonic()
    assert roll_call(lonely, 0, 2, window=1.0) == [1]
    assert time.monotonic() - started < 5


def test_each_rank_sends_a_few_requests_whatever_the_number_of_ranks():
    """Rank 0 finds who did not check in and posts it; the others read that one key (each
    checked every rank's key before: N requests a rank, N² at the store)."""
    from helpers import Counted

    for world in (2, 4, 8):
        port = free_port()
        stores = [Counted(dist.TCPStore("127.0.0.1", port, world, is_master=r == 0,
                                        timeout=datetime.timedelta(seconds=10),
                                        wait_for_workers=False))
                  for r in range(world)]  # fmt: skip
        found: list = [None] * world
        late = world - 1  # never checks in

        def call(r, stores=stores, found=found, world=world):
            found[r] = roll_call(stores[r], r, world, window=2.0)

        threads = [threading.Thread(target=call, args=(r,)) for r in range(late)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        assert found[:late] == [[late]] * late, (world, found)
        # the failure key, check-in, count, the finding
        assert [s.requests for s in stores[1:late]] == [4] * (late - 1), world


def test_a_store_that_does_not_answer_gives_none_in_time():
    port = free_port()
    master = store(port, True)
    client = store(port, False)
    del master  # the server is gone: rank 0, which holds it, is the one lost
    started = time.monotonic()
    assert roll_call(client, 1, 2, window=1.0) is None
    assert time.monotonic() - started < 1.0 + 6.0 + 1.0


def test_a_rank_0_whose_store_answers_but_that_calls_no_roll_is_busy_not_lost():
    """Rank 0's process is there (its store answers) but its main thread works alone (a
    long save): the others' roll call says so, and rank 0 writes the job's status."""
    port = free_port()
    master, client = store(port, True), store(port, False)
    started = time.monotonic()
    found = roll_call(client, 1, 2, window=1.0)
    assert isinstance(found, Rank0Busy), found
    assert time.monotonic() - started < 1.0 + 6.0 + 1.0
    here = socket.gethostname()
    line = describe(RuntimeError("Timed out"), found, [(here, 1), (here, 2)], 1, here)
    assert line.startswith(f"lost contact with rank 0 on {here} (alive, busy: its store "), line
    del master


def test_local_state_and_the_line():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert local_state(child.pid) == "running"
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert local_state(child.pid) == "stopped"
        here = socket.gethostname()
        peers = [(here, 1), (here, child.pid), ("node2", 7)]
        line = describe(RuntimeError("[gloo/u.cc:78] Timed out waiting"), [1, 2], peers, 0, here)
        assert line == (f"lost contact with rank 1 on {here} (stopped), rank 2 on node2 "
                        "(not answering): Timed out waiting")  # fmt: skip
        assert describe(RuntimeError("x"), None, peers, 2, "node2").startswith(
            f"lost contact with rank 0 on {here} (not answering)"
        )  # no store to reach: rank 0 holds it
    finally:
        child.kill()
        child.wait()
    assert local_state(child.pid) == "gone"


def test_a_survivor_still_waiting_is_not_named_beside_a_lost_node():
    """8 ranks over two hosts lose node2's four; ranks 1 and 2 of this host, whose
    collectives have not failed yet, miss the roll call too: only node2's are named. With
    no rank gone by that rule, every rank that missed it is."""
    waiting = subprocess.Popen(["sleep", "30"])
    try:
        here = socket.gethostname()
        peers = [(here, 1), (here, waiting.pid), (here, waiting.pid), (here, 1),
                 *[("node2", 7)] * 4]  # fmt: skip
        line = describe(RuntimeError("Connection closed by peer"), [1, 2, 4, 5, 6, 7],
                        peers, 0, here)  # fmt: skip
        assert line == ("lost contact with " + ", ".join(
            f"rank {r} on node2 (not answering)" for r in (4, 5, 6, 7)
        ) + ": Connection closed by peer")  # fmt: skip
        line = describe(RuntimeError("Timed out"), [1, 5], peers, 0, here)
        assert line == (f"lost contact with rank 1 on {here} (running), rank 5 on node2 "
                        "(not answering): Timed out")  # fmt: skip
    finally:
        waiting.kill()
        waiting.wait()

"""The loop's control collectives (dmltrain.runtime.control) over real Gloo processes."""

import datetime
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmltrain.runtime import control, peers
from dmltrain.runtime.launch import free_port


def _compare(rank: int, world: int, port: int, trials: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for trial in range(trials):
            shared, own = random.Random(trial), random.Random(1000 * trial + rank)
            ops = [shared.choice(["max", "sum"]) for _ in range(shared.randint(1, 7))]
            values = [own.randint(-(2**40), 2**40) for _ in ops]
            got = control.over_ranks(values, ops, rank, world, datetime.timedelta(seconds=60))
            expected = []
            for value, op in zip(values, ops, strict=True):
                tensor = torch.tensor([value], dtype=torch.int64)
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
                expected.append(int(tensor))
            assert got == expected, (rank, trial, got, expected)
    finally:
        dist.destroy_process_group()


def test_pairwise_exchanges_give_every_rank_what_an_all_reduce_gives(monkeypatch):
    """6 ranks (4 in the exchanges, 2 more that hand theirs on and get the result back),
    mixed maxima and sums of random 41-bit integers: every rank's result equals Gloo's
    all-reduce, element by element."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")  # as dmltrain runs them
    mp.spawn(_compare, args=(6, free_port(), 20), nprocs=6)


def _silent_peer(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    minute = datetime.timedelta(seconds=60)
    assert control.over_ranks([rank], [control.MAX], rank, 2, minute) == [1]  # connected
    if rank == 1:  # alive, but never answers again
        time.sleep(30)
        return
    began = time.monotonic()
    try:
        control.over_ranks([1], [control.MAX], 0, 2, datetime.timedelta(seconds=3))
    except Exception as exc:  # what the loop gets from a collective that timed out
        out["error"] = (time.monotonic() - began, peers.means_lost(exc), str(exc)[:300])
    os._exit(0)  # without waiting for the silent peer


def test_a_silent_peer_raises_after_the_timeout_given_not_the_groups(monkeypatch):
    """The group was made with a 600 s timeout (``--init-timeout``); after one exchange
    the peer stops answering, and the next exchange, given 3 s (``--dist-timeout`` once
    the run has started), raises after those 3 s with an error that the loop takes for a
    lost peer."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")  # as dmltrain runs them
    with mp.Manager() as manager:
        out = manager.dict()
        context = mp.start_processes(
            _silent_peer, args=(free_port(), out), nprocs=2,
            start_method="spawn", join=False,
        )  # fmt: skip
        context.processes[0].join(60)
        for process in context.processes:
            process.kill()
        seconds, lost, text = out["error"]
    assert 3 <= seconds < 10, (seconds, text)
    assert lost, text


def test_the_rounds_grow_as_log2_of_the_ranks():
    assert [control.rounds(n) for n in (1, 2, 4, 6, 8, 1024, 1025)] == [0, 1, 2, 4, 3, 10, 12]

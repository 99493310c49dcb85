"""The loop's control collectives (dmltrain.runtime.control) over real Gloo processes."""

import os
import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmltrain.runtime import control


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
            got = control.over_ranks(values, ops, rank, world)
            expected = []
            for value, op in zip(values, ops, strict=True):
                tensor = torch.tensor([value], dtype=torch.int64)
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
                expected.append(int(tensor))
            assert got == expected, (rank, trial, got, expected)
    finally:
        dist.destroy_process_group()


def test_pairwise_exchanges_give_every_rank_what_an_all_reduce_gives():
    """6 ranks (4 in the exchanges, 2 more that hand theirs on and get the result back),
    mixed maxima and sums of random 41-bit integers: every rank's result equals Gloo's
    all-reduce, element by element."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # as dmltrain runs them
    mp.spawn(_compare, args=(6, 29000 + os.getpid() % 1000, 20), nprocs=6)


def test_the_rounds_grow_as_log2_of_the_ranks():
    assert [control.rounds(n) for n in (1, 2, 4, 6, 8, 1024, 1025)] == [0, 1, 2, 4, 3, 10, 12]

"""The loop's small control collectives (the stop agreement, the monitor's numbers) in
about log2 N rounds of pairwise exchanges.

torch's Gloo all-reduce is a ring whatever the size: 2(N-1) hops one after another, so a
few integers at 1,024 ranks wait for 2,046 hops. Here the ranks exchange with a partner
whose rank differs in one bit, one bit a round (recursive doubling): log2 N rounds, each
one hop, and a rank talks to log2 N peers, not all of them. With a number of ranks that is
not a power of two, each rank past the largest power of two hands its values to a rank
below it first and gets the result back last: two more rounds.

The values are integers, so the order in which they are combined changes nothing: every
rank gets the same result, as from ``all_reduce``.
"""

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

MAX, SUM = "max", "sum"


def rounds(world: int) -> int:
    """The exchanges one after another that ``over_ranks`` takes with ``world`` ranks."""
    power = 1 << (world.bit_length() - 1)
    return power.bit_length() - 1 + (2 if world > power else 0)


def over_ranks(
    values: list[int],
    ops: Sequence[str],
    rank: int,
    world: int,
    timeout: datetime.timedelta,
    group: Any = None,
) -> list[int]:
    """``values`` combined element-wise over the ranks of ``group`` (all ranks, in the same
    order as the default group's), by ``ops[i]`` (``MAX`` or ``SUM``) for element i;
    every rank calls it with as many values. A peer that does not answer within
    ``timeout`` raises, as a collective does (a point-to-point receive would otherwise wait
    for the timeout the group was made with, not the one it has now)."""
    if world == 1:
        return list(values)
    mine = torch.tensor(values, dtype=torch.int64)
    theirs = torch.empty_like(mine)
    maximum = torch.tensor([op == MAX for op in ops], dtype=torch.bool)

    def exchange(peer: int, send: bool = True, receive: bool = True) -> None:
        sent = dist.isend(mine, peer, group=group) if send else None
        if receive:
            _done(dist.irecv(theirs, peer, group=group), timeout)
        if sent is not None:
            _done(sent, timeout)

    def combine() -> torch.Tensor:
        return torch.where(maximum, torch.maximum(mine, theirs), mine + theirs)

    power = 1 << (world.bit_length() - 1)
    if rank >= power:  # hands its values to a rank below and waits for the result
        exchange(rank - power)
        return [int(v) for v in theirs.tolist()]
    if rank + power < world:
        exchange(rank + power, send=False)
        mine = combine()
    bit = 1
    while bit < power:
        exchange(rank ^ bit)
        mine = combine()
        bit <<= 1
    if rank + power < world:
        exchange(rank + power, receive=False)
    return [int(v) for v in mine.tolist()]


def _done(work: Any, timeout: datetime.timedelta) -> None:
    if work is not None:  # None only for a rank outside the group
        work.wait(timeout)

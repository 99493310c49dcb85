"""A checkpoint read by rank 0 alone and handed to every rank: one read of the file in all.

Every rank reading the file itself costs the file system N reads of it (once a node when
the pages are shared): 256 reads of a 16 GB file at 1,024 ranks. Here rank 0's load is
split into its tensors and the rest: the rest goes as one pickled object, the tensors as
their bytes in a few large broadcasts of the training backend (NCCL's, Gloo's, Horovod's),
so that what each rank loads is bitwise what rank 0 read. The buckets go one after
another while the next is read and the last unpacked, so a resume takes about as long as
its slowest stage: reading the file, where that is a parallel file system.
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

# Bytes a broadcast carries: few enough collectives, and one bucket's copy is all the
# memory a rank needs beyond the state itself.
BUCKET_BYTES = 256 * 2**20
# Each tensor starts at a multiple of this in its bucket, so that its bytes can be viewed
# as its own dtype whatever the dtype.
ALIGN = 64


class Slot(NamedTuple):
    """Where a tensor was in the state: its place in the list of tensors, and its form."""

    place: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def hand_out(strategy: Any, state: Any) -> Any:
    """Rank 0's ``state`` (nested dicts, lists and tuples of tensors and plain values) on
    every rank; the others pass None. One process: ``state`` itself."""
    if strategy.info.world_size == 1:
        return state
    tensors: list[Tensor] = []
    skeleton = _split(state, tensors) if strategy.info.is_main else None
    skeleton, slots = strategy.broadcast_object(
        (skeleton, [Slot(i, tuple(t.shape), t.dtype) for i, t in enumerate(tensors)])
    )
    received: list[Tensor] = []
    pending: tuple[Tensor, Callable[[], None], list[tuple[Slot, int]]] | None = None
    for bucket in [*_buckets(slots), None]:  # a bucket packed while the last one travels
        if bucket is not None:
            buffer = torch.empty(bucket[-1][1] + _nbytes(bucket[-1][0]), dtype=torch.uint8)
            if strategy.info.is_main:  # where the file is read: its pages, as they are copied
                for slot, offset in bucket:
                    buffer[offset : offset + _nbytes(slot)] = _bytes(tensors[slot.place])
            sent = strategy.broadcast_bytes(buffer)
        if pending is not None:
            last, wait, where = pending
            wait()
            if not strategy.info.is_main:  # copies: a view would keep the whole bucket alive
                received += [_tensor(last, slot, offset) for slot, offset in where]
        pending = None if bucket is None else (buffer, sent, bucket)
    return state if strategy.info.is_main else _join(skeleton, received)


def _split(obj: Any, tensors: list[Tensor]) -> Any:
    """``obj`` with each dense tensor replaced by its Slot; the tensors appended in order."""

    def slot(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.layout == torch.strided and type(leaf) is Tensor:
            tensors.append(leaf)
            return Slot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype)
        return leaf  # plain values, and anything else, go pickled

    return _walk(obj, slot)


def _join(obj: Any, tensors: list[Tensor]) -> Any:
    return _walk(obj, lambda leaf: tensors[leaf.place] if isinstance(leaf, Slot) else leaf)


def _walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt, its dicts, lists and tuples walked in order, ``leaf`` of the rest."""
    if isinstance(obj, dict):
        items = [(key, _walk(value, leaf)) for key, value in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [_walk(value, leaf) for value in obj]
    if type(obj) is tuple:
        return tuple(_walk(value, leaf) for value in obj)
    return leaf(obj)


def _nbytes(slot: Slot) -> int:
    count = 1
    for size in slot.shape:
        count *= size
    return count * slot.dtype.itemsize


def _buckets(slots: list[Slot]) -> list[list[tuple[Slot, int]]]:
    """The slots in order, each with its offset, in buckets of about BUCKET_BYTES (a
    larger tensor has one of its own); every rank works them out alike from the slots."""
    buckets: list[list[tuple[Slot, int]]] = []
    offset = BUCKET_BYTES
    for slot in slots:
        if offset > 0 and offset + _nbytes(slot) > BUCKET_BYTES:
            buckets.append([])
            offset = 0
        buckets[-1].append((slot, offset))
        offset += -(-_nbytes(slot) // ALIGN) * ALIGN
    return buckets


def _bytes(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _tensor(buffer: Tensor, slot: Slot, offset: int) -> Tensor:
    part = buffer[offset : offset + _nbytes(slot)]
    return part.view(slot.dtype).reshape(slot.shape).clone()

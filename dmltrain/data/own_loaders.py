"""An experiment's own ``DataLoader`` over map-style data (``create_dataloader``), resumed in
the middle of an epoch at the next batch, without loading the batches already trained.

A loader's order is made by its sampler from random numbers drawn as its epoch begins:
torch's, numpy's or Python's generators, or a ``torch.Generator`` given to the loader or
its sampler. ``begin`` keeps all their states at that moment (each rank its own, in the
checkpoint). ``resumed`` sets them back, draws what the loader's iterator drew (the seed
of its workers, then the sampler's order, consuming the trained batches' indices alone),
puts this process's generators back as they were, and returns a loader of the remaining
batches whose workers get the same seed. A sampler with ``set_epoch`` is told each epoch.
Each epoch's iterator is made as a script makes it: without a generator of its own, the
loader draws from torch's, and a port draws on from there as its script does.

Exact, except where a dataset draws random numbers in loader workers: each worker's
generators have moved by the samples it fetched, a place no checkpoint holds (``inexact``
says so). dmltrain's own loader seeds each sample instead (``samples``).
"""

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from dmltrain.data.rng import rng_state, set_rng_state
from dmltrain.data.samples import SeededSamples


def generators(loader: DataLoader) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the loader and its samplers draw from, each once."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """``set_epoch(epoch)`` of each of the loader's samplers that has one (a
    DistributedSampler shuffles by it)."""
    batch_sampler: Any = getattr(loader, "batch_sampler", None)
    samplers: list[Any] = [loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    for sampler in {id(s): s for s in samplers}.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def begin(loader: DataLoader) -> dict[str, Any]:
    """The generators' states as an epoch of ``loader`` begins (a checkpoint keeps them)."""
    return {"rng": rng_state(), "generators": [g.get_state() for g in generators(loader)]}


def resumed(loader: DataLoader, began: dict[str, Any], trained: int) -> DataLoader:
    """``loader``'s epoch that began with ``began``, from batch ``trained`` on."""
    now = rng_state()
    made = generators(loader)
    set_rng_state(began["rng"])
    for generator, state in zip(made, began["generators"], strict=True):
        generator.set_state(state)
    # as the epoch's iterator drew: its workers' seed (from the loader's generator, else
    # torch's), then the sampler's order, drawn as the iterator is made with workers,
    # else at its first batch
    seeds = torch.Generator()
    seeds.set_state((loader.generator or torch.default_generator).get_state())
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    order = iter(loader._index_sampler)
    for _ in range(trained):
        next(order, None)
    set_rng_state(now)  # this process's draws go on as the checkpoint left them
    rest = _Rest(order, len(loader) - trained)
    batched = loader.batch_sampler is not None
    return DataLoader(
        loader.dataset,
        batch_size=None if not batched else 1,
        batch_sampler=rest if batched else None,
        sampler=None if batched else rest,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=seeds,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=False,
        in_order=getattr(loader, "in_order", True),
    )


class _Rest(Sampler[Any]):
    """The rest of an epoch's order, already begun: iterated once."""

    def __init__(self, order: Iterator[Any], length: int) -> None:
        self.order, self.length = order, max(length, 0)

    def __iter__(self) -> Iterator[Any]:
        return self.order

    def __len__(self) -> int:
        return self.length


def _own_generator(loader: DataLoader) -> str | None:
    """``Sampler.attribute`` of a sampler of ``loader`` that holds a generator of its own
    other than a ``torch.Generator`` (Python's ``random.Random``, numpy's): no checkpoint
    keeps where it is."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        for attribute, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
            if isinstance(value, random.Random | np.random.Generator | np.random.RandomState):
                return f"{type(owner).__name__}.{attribute}"
    return None


def inexact(loader: DataLoader) -> str | None:
    """Why the rest of an epoch of ``loader`` cannot be drawn as it would have been, or
    None: a sampler that draws from a generator of its own that no checkpoint keeps, or a
    dataset that may draw random numbers, fetched in loader workers."""
    held = _own_generator(loader)
    if held is not None:
        return (
            f"create_dataloader's sampler draws from a generator of its own ({held}) that no "
            "checkpoint keeps: the rest of this epoch comes in another order. Give the "
            "sampler a torch.Generator, or let it draw from torch's, which resume exactly"
        )
    dataset = loader.dataset
    if loader.num_workers == 0 or not (isinstance(dataset, SeededSamples) and dataset.seeded):
        return None
    name = type(dataset.dataset).__name__
    return (
        f"create_dataloader's loader fetches {name} in {loader.num_workers} workers, whose "
        "random draws depend on the samples each fetched before: the rest of this epoch is "
        "trained with other draws. For an exact resume fetch in the training process "
        "(num_workers=0), or use dmltrain's loader (no create_dataloader), which seeds each "
        "sample"
    )

"""The data pipeline's randomness: which sample of which epoch, drawn with its own seeds.

A resumed run must draw the same random numbers as one never interrupted, in the model
(dropout) and in the data (augmentation). So the data pipeline never draws from the
streams the model uses, and never from a stream whose position a resume would lose:

- dmltrain's samplers yield ``(epoch, index)`` keys, and ``SeededSamples`` fetches sample
  ``index`` with torch, numpy and random seeded from (seed, epoch, index). The sample
  gets the same augmentation with any ``--num-workers``, any number of processes, and
  after any resume; in the training process the generators are put back afterwards, so
  the model's stream does not move.
  A dataset known to draw nothing (``TensorDataset``, and ``Subset``/``ConcatDataset``
  of those) is fetched without seeds, and the training sampler yields its plain indices:
  seeding has a cost per sample (``benchmarks/data_pipeline.py`` measures it).
- ``iterate`` creates a loader's iterator without moving the global torch generator
  (a DataLoader without a generator of its own draws its workers' base seed from it).

Training order: one permutation per epoch seeded by ``seed + epoch``; rank r of w takes
every w-th sample of it (``DistributedSampler``). Validation: rank r takes samples r,
r+w, ... in order.
"""

import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    ConcatDataset,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
    get_worker_info,
)

VALIDATION = -1  # the epoch part of validation keys: the same draws at every validation
_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in ``epoch`` (a 64-bit value)."""
    return _mix(_mix(_mix(seed & _MASK64) ^ (epoch & _MASK64)) ^ (index & _MASK64))


def _seed_generators(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds every GPU
    np.random.seed(seed >> 32)
    random.seed(seed)


def draws_nothing(dataset: Dataset) -> bool:
    """Whether fetching a sample of ``dataset`` is known to draw no random numbers."""
    if isinstance(dataset, Subset):
        return draws_nothing(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return all(draws_nothing(part) for part in dataset.datasets)
    return type(dataset) is TensorDataset


class SeededSamples(Dataset):
    """``dataset`` whose item ``(epoch, index)`` is ``dataset[index]`` drawn with torch's,
    numpy's and Python's generators seeded from (seed, epoch, index) (unseeded where the
    dataset draws nothing). A plain index is passed through unseeded (a sampler of your
    own). Other attributes are the dataset's."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.seeded = not draws_nothing(dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """A batch's samples (the DataLoader fetches a batch with one call)."""
        dataset = self.dataset  # looked up once, not once a sample
        if not keys or not isinstance(keys[0], tuple):
            return [dataset[key] for key in keys]
        if not self.seeded:
            return [dataset[index] for _, index in keys]
        # A worker's generators are its own; the training process's are the model's.
        saved = None if get_worker_info() is not None else _generator_states()
        try:
            items = []
            for epoch, index in keys:
                _seed_generators(sample_seed(self.seed, epoch, index))
                items.append(self.dataset[index])
            return items
        finally:
            if saved is not None:
                _set_generator_states(saved)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def keyed(dataset: Dataset, seed: int) -> Dataset:
    """``dataset`` as the loop's samplers read it: a map-style one that may draw random
    numbers in ``SeededSamples``; one known to draw nothing, or an ``IterableDataset`` (no
    sampler), as it is (a wrapper would be one more call a batch, for nothing)."""
    if isinstance(dataset, IterableDataset) or draws_nothing(dataset):
        return dataset
    return SeededSamples(dataset, seed)


def _keys(dataset: Dataset) -> bool:
    """Whether samplers of ``dataset`` yield ``(epoch, index)`` keys (it seeds them), or
    plain indices."""
    return isinstance(dataset, SeededSamples) and dataset.seeded


def _generator_states() -> tuple[Any, ...]:
    return torch.default_generator.get_state(), np.random.get_state(), random.getstate()


def _set_generator_states(states: tuple[Any, ...]) -> None:
    torch.default_generator.set_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def iterate(loader: Iterable[Any]) -> Iterator[Any]:
    """``iter(loader)`` with the global torch generator as it was before."""
    state = torch.default_generator.get_state()
    try:
        return iter(loader)
    finally:
        torch.default_generator.set_state(state)


class ResumableSampler(DistributedSampler):
    """The training order as ``(epoch, index)`` keys for a ``SeededSamples`` that draws
    (plain indices for any other dataset); can start an epoch part-way (after a mid-epoch
    resume)."""

    start = 0  # samples of this rank's shard already consumed in the current epoch

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def __iter__(self) -> Iterator[tuple[int, int] | int]:
        indices = list(super().__iter__())[self.start :]
        if not _keys(self.dataset):
            # nothing to seed: the index alone (a key is one more object a sample, made at
            # the epoch's start and read in its step)
            return iter(indices)
        return iter([(self.epoch, index) for index in indices])

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(Sampler[tuple[int, int] | int]):
    """Validation keys (plain indices where ``ResumableSampler`` gives them): rank r of w
    takes samples r, r+w, r+2w, ... With ``pad`` every rank gets as many (the first samples
    repeat, at the end of a shard), for models whose forward is collective (FSDP); ``real``
    says how many of a shard's samples are not padding (``evaluation.real_batches`` leaves
    the rest out of metrics)."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int, pad: bool = False) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        total = -(-n // world_size) * world_size if pad and n else n
        self.indices = [i % n for i in range(rank, total, world_size)]
        self.real = len(range(rank, n, world_size))  # the first ones; the rest is padding
        self.keys = _keys(dataset)

    def __iter__(self) -> Iterator[tuple[int, int] | int]:
        if not self.keys:
            return iter(self.indices)
        return iter([(VALIDATION, index) for index in self.indices])

    def __len__(self) -> int:
        return len(self.indices)

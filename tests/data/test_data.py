"""Per-sample seeds and the samplers' keys: the data pipeline never moves the model's
random streams, and a sample is drawn the same wherever and whenever it is fetched."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, DistributedSampler, Subset, TensorDataset

from dmltrain.data.samples import (
    ResumableSampler,
    SeededSamples,
    ShardSampler,
    iterate,
    keyed,
    sample_seed,
)
from tiny_streams import Augmented

DATA = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))


def states():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_states(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_a_sample_is_drawn_the_same_in_any_order_and_differs_by_epoch_and_index():
    seeded = SeededSamples(Augmented(DATA), seed=3)
    first = seeded[(1, 7)][0]
    seeded[(0, 2)]  # other samples in between change nothing
    assert torch.equal(seeded[(1, 7)][0], first)
    assert not torch.equal(seeded[(2, 7)][0], first)  # another epoch: other draws
    assert not torch.equal(SeededSamples(Augmented(DATA), seed=4)[(1, 7)][0], first)
    assert sample_seed(3, 1, 7) != sample_seed(3, 7, 1)


def test_the_training_process_generators_do_not_move():
    seeded = SeededSamples(Augmented(DATA), seed=0)
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    before = states()
    seeded.__getitems__([(0, i) for i in range(8)])
    assert same_states(before, states())


def test_plain_indices_pass_through_and_attributes_are_the_datasets():
    seeded = SeededSamples(DATA, seed=0)
    assert torch.equal(seeded[3][0], DATA[3][0]) and len(seeded) == 20
    assert seeded.tensors is DATA.tensors


def test_datasets_known_to_draw_nothing_are_fetched_without_seeds():
    """Seeding costs about 7 us a sample; a TensorDataset (or a Subset or ConcatDataset
    of them) draws nothing, so its keys are only unpacked. Anything else is seeded, a
    subclass of TensorDataset too (its __getitem__ may draw)."""

    class Noisy(TensorDataset):
        def __getitem__(self, index):
            return self.tensors[0][index] + torch.rand(2), self.tensors[1][index]

    keys = [(0, 3), (1, 5)]
    for plain in (DATA, Subset(DATA, range(10)), ConcatDataset([DATA, DATA])):
        seeded = SeededSamples(plain, seed=0)
        assert not seeded.seeded
        got = seeded.__getitems__(keys)
        assert all(torch.equal(g[0], plain[i][0]) for g, (_, i) in zip(got, keys, strict=True))
    for drawing in (Augmented(DATA), Subset(Augmented(DATA), range(10)), Noisy(*DATA.tensors)):
        assert SeededSamples(drawing, seed=0).seeded
    noisy = SeededSamples(Noisy(*DATA.tensors), seed=0)
    assert torch.equal(noisy[(0, 3)][0], noisy[(0, 3)][0])  # seeded: the same draws again


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_draw_what_the_training_process_draws(workers):
    seeded = SeededSamples(Augmented(DATA), 0)
    sampler = ResumableSampler(seeded, num_replicas=1, rank=0, seed=0)
    sampler.set_epoch(1)
    loader = DataLoader(seeded, batch_size=4, sampler=sampler, num_workers=workers)
    expected = [seeded[key][0] for key in sampler]
    got = torch.cat([x for x, _ in loader])
    assert torch.equal(got, torch.stack(expected))


def test_resuming_part_way_fetches_the_rest_of_the_epoch():
    sampler = ResumableSampler(SeededSamples(Augmented(DATA), 0), num_replicas=2, rank=1, seed=0)
    sampler.set_epoch(2)
    keys = list(sampler)
    assert all(epoch == 2 for epoch, _ in keys) and len(keys) == 10
    sampler.start = 4
    assert list(sampler) == keys[4:] and len(sampler) == 6


def test_where_nothing_is_drawn_the_dataset_is_read_as_it_is_in_the_same_order():
    """A dataset known to draw nothing reaches the DataLoader as it is (no wrapper's call
    a batch) and its samplers yield plain indices: the order of the keys of one that
    draws."""
    assert keyed(DATA, 0) is DATA and type(keyed(Augmented(DATA), 0)) is SeededSamples
    orders, loaders = [], []
    for dataset in (keyed(DATA, 0), keyed(Augmented(DATA), 0)):
        sampler = ResumableSampler(dataset, num_replicas=2, rank=1, seed=0)
        sampler.set_epoch(2)
        sampler.start = 3  # resumed part-way
        orders.append(list(sampler))
        loaders.append(DataLoader(dataset, batch_size=4, sampler=sampler))
    plain, keys = orders
    assert all(type(i) is int for i in plain) and len(plain) == len(keys) == 7
    assert keys == [(2, index) for index in plain]
    got = torch.cat([y for _, y in loaders[0]])  # the labels are the samples' indices
    assert got.tolist() == plain


def test_iterate_leaves_the_global_generator_alone():
    loader = DataLoader(DATA, batch_size=4)  # no generator: its iterator draws a base seed
    torch.manual_seed(1)
    before = torch.get_rng_state()
    next(iterate(loader))
    assert torch.equal(before, torch.get_rng_state())
    iter(loader)
    assert not torch.equal(before, torch.get_rng_state())  # what iterate prevents


@pytest.mark.parametrize("n", [20, 19, 1])
def test_padded_shards_match_distributed_samplers(n):
    data = TensorDataset(torch.zeros(n))
    for rank in range(3):
        ours = list(ShardSampler(data, rank, 3, pad=True))  # plain indices: nothing drawn
        theirs = list(DistributedSampler(data, num_replicas=3, rank=rank, shuffle=False))
        assert ours == theirs
    unpadded = [i for r in range(3) for i in ShardSampler(data, r, 3)]
    assert sorted(unpadded) == list(range(n))

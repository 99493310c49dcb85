"""An experiment's own DataLoader (dmltrain/data/own_loaders.py): a run stopped in the middle
of an epoch (SIGUSR1) resumes at the next batch, with the same order, the same worker
seeds and no batch trained twice; the epoch ends at its own last step."""

import random
from pathlib import Path

import pytest
import torch
from helpers import AT_ONCE, TINY, assert_same_run, run_cli
from torch.utils.data import DataLoader, TensorDataset

from dmltrain.data import own_loaders
from dmltrain.data.samples import keyed
from tiny_streams import Augmented


def recorded(run: Path, rank: int = 0) -> list[str]:
    """``EPOCH STEP INDEX...`` of each batch the run trained (--record-samples)."""
    return (run / f"samples.{rank}.txt").read_text().splitlines()


def stopped_and_resumed(tmp_path: Path, args: list[str], step: int) -> Path:
    stop = ["--signal-rank", "0", "--signal-at-step", str(step), *AT_ONCE]
    cut = run_cli(*args, "--run-dir", "cut", *stop, cwd=tmp_path)
    assert cut.returncode == 3, cut.stderr[-3000:]
    again = run_cli(*args, "--run-dir", "cut", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    return tmp_path / "cut"


def test_a_loader_in_order_resumes_at_the_next_batch_and_ends_its_epoch_in_place(tmp_path):
    """DataLoader(shuffle=False), 64 samples in batches of 8: stopped after step 3 of 8,
    the resume trains batches 3..7 as steps 4..8, and epoch 2 starts at batch 0.
    dmltrain's loader with --no-shuffle reads them in that order too."""
    args = [*TINY, "--epochs", "2", "--samples", "64", "--own-loader", "--record-samples"]
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = stopped_and_resumed(tmp_path, args, 3)
    first = [f"1 {s} " + " ".join(str(i) for i in range(8 * (s - 1), 8 * s)) for s in range(1, 9)]
    assert recorded(tmp_path / "whole")[:8] == first
    # --no-shuffle: dmltrain's own loader reads the same order, without a loader written
    plain = [*TINY, "--epochs", "1", "--samples", "64", "--no-shuffle", "--record-samples"]
    ordered = run_cli(*plain, "--run-dir", "ordered", cwd=tmp_path)
    assert ordered.returncode == 0, ordered.stderr[-3000:]
    assert recorded(tmp_path / "ordered") == first
    # the batch of step 4 was read before the stop took effect at step 3's end: it was not
    # trained (the log and weights say so below), and it is trained once after the resume
    lines = recorded(run)
    assert lines[:3] == first[:3] and lines[-16:] == recorded(tmp_path / "whole")
    assert_same_run(tmp_path / "whole", run)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_shuffled_loader_on_two_ranks_resumes_bitwise(tmp_path, workers):
    """shuffle=True (torch's global generator) and dropout, on 2 processes, with and
    without loader workers: stopped mid-epoch 2, resumed, the run is bitwise the one never
    stopped; each rank went on from its own generators' state."""
    args = [*TINY, "--epochs", "2", "--own-loader", "--own-shuffle", "--num-workers", workers,
            "--nprocs", "2", "--dropout", "0.2"]  # fmt: skip
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = stopped_and_resumed(tmp_path, args, 8)  # 2 steps into epoch 2 (6 an epoch)
    assert_same_run(tmp_path / "whole", run)


def test_a_dataset_that_draws_in_loader_workers_is_said_inexact():
    """Its workers' generators moved by the samples each fetched before: no checkpoint
    keeps that, so the resume says the rest of the epoch draws otherwise."""
    plain = TensorDataset(torch.zeros(8, 2))
    assert own_loaders.inexact(DataLoader(keyed(plain, 0), num_workers=2)) is None
    drawing = keyed(Augmented(plain), 0)
    assert own_loaders.inexact(DataLoader(drawing, num_workers=0)) is None
    said = own_loaders.inexact(DataLoader(drawing, num_workers=2))
    assert said is not None and said.startswith(
        "create_dataloader's loader fetches Augmented in 2 workers, whose random draws"
    )


class OwnRandom(torch.utils.data.Sampler):
    """A sampler that shuffles with a random.Random of its own: where it is in its stream
    of draws is in no checkpoint."""

    def __init__(self, n):
        self.n, self.rng = n, random.Random(0)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n


def test_a_sampler_with_a_generator_of_its_own_is_said_inexact():
    """A resumed epoch of it would come in another order, silently: the resume says so and
    what to give instead. A torch.Generator (kept) is exact and says nothing."""
    plain = TensorDataset(torch.zeros(8, 2))
    said = own_loaders.inexact(DataLoader(plain, sampler=OwnRandom(8)))
    assert said is not None and said.startswith(
        "create_dataloader's sampler draws from a generator of its own (OwnRandom.rng)"
    )
    kept = torch.utils.data.RandomSampler(plain, generator=torch.Generator().manual_seed(0))
    assert own_loaders.inexact(DataLoader(plain, sampler=kept)) is None
    assert own_loaders.inexact(DataLoader(plain, shuffle=True)) is None

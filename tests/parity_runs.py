"""One side of the parity test (tests/test_parity.py), run in a fresh process:

    python tests/parity_runs.py {plain,dmltrain} OUT_DIR

Both sides import the same modules first, train the MNIST CNN for 2 epochs (batch 64,
Adam lr 1e-3, seed 0, deterministic algorithms, 640 MNIST-shaped samples held in memory,
shuffled by a generator seeded with seed + epoch) and save a checkpoint (model and
optimizer) at the end of each epoch, as a careful hand-written loop would. Writes
OUT_DIR/weights.pt and prints the peak RSS in KiB.
"""

import random
import resource
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dmltrain  # noqa: F401  (both sides pay for the same imports)
from dmltrain import BaseTrainer, TrainConfig
from dmltrain.runtime.launch import detect
from dmltrain_experiments.mnist import Net

SEED, EPOCHS, BATCH, SAMPLES = 0, 2, 64, 640


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 1, 28, 28, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (SAMPLES,), generator=g))


def plain(out: Path) -> dict:
    torch.manual_seed(SEED)
    model = Net()
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # as the default
    data = dataset()
    for epoch in range(EPOCHS):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch))
        model.train()
        # A generator of its own: the iterator's seed draw leaves the dropout stream alone
        loader = DataLoader(data, BATCH, sampler=order.tolist(), generator=torch.Generator())
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, out / f"epoch-{epoch}.pt")
    return model.state_dict()


class Parity(BaseTrainer):
    def create_model(self):
        return Net()

    def create_datasets(self):
        return dataset(), None

    def train_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def with_dmltrain(out: Path) -> dict:
    config = TrainConfig(
        epochs=EPOCHS,
        batch_size=BATCH,
        seed=SEED,
        progress="off",
        wandb_mode="disabled",
        run_dir=str(out / "run"),
    )
    trainer = Parity(config, dist=detect("single", 1))
    trainer.fit()
    return trainer.model.state_dict()


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)
    side, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    weights = plain(out) if side == "plain" else with_dmltrain(out)
    torch.save(weights, out / "weights.pt")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

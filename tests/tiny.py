"""A tiny regression experiment: the fast stand-in for MNIST in mechanics tests."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, register_experiment


@dataclass(frozen=True)
class TinyOptions:
    samples: int = field(default=96, metadata={"help": "training samples"})
    features: int = field(default=4, metadata={"help": "input features"})


class TinyTrainer(BaseTrainer):
    name = "tiny"

    def create_model(self) -> nn.Module:
        options = self.options or TinyOptions()
        return nn.Sequential(nn.Linear(options.features, 8), nn.Tanh(), nn.Linear(8, 1))

    def create_datasets(self):
        options = self.options or TinyOptions()
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(options.samples + 32, options.features, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g)
        n = options.samples
        return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])

    def train_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)


EXPERIMENT = register_experiment("tiny", TinyTrainer, TinyOptions, help="tiny regression (tests)")

"""A user's own stream, as a researcher writes one in an experiment file: numbers with
their sums, a position kept in ``state_dict``. ``--numpy-position`` keeps it as a numpy
scalar (the usual mistake); ``--sized`` gives it a ``len()``."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from dmltrain import BaseTrainer, register_experiment


class Numbers(IterableDataset):
    def __init__(self, samples: int, numpy_position: bool, sized: bool) -> None:
        self.samples, self.numpy, self.sized = samples, numpy_position, sized
        self.position = 0

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream of unknown length")
        return self.samples

    def __iter__(self):
        x = torch.rand(self.samples, 4, generator=torch.Generator().manual_seed(0))
        while self.position < self.samples:
            i = self.position
            self.position = np.int64(i + 1) if self.numpy else i + 1
            yield x[i], x[i].sum(0, keepdim=True)
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@dataclass(frozen=True)
class Options:
    samples: int = 64
    numpy_position: bool = False
    sized: bool = False


class UserStream(BaseTrainer):
    def create_model(self):
        return nn.Linear(4, 1)

    def create_datasets(self):
        o = self.options
        return Numbers(o.samples, o.numpy_position, o.sized), None

    def train_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)


EXPERIMENT = register_experiment("user-stream", UserStream, Options)

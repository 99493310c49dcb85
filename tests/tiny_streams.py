"""The tiny experiment's data variants: augmentation drawn from every generator, and the
training set as a user's stream (stateful, stateless or without a length)."""

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, get_worker_info


@dataclass(frozen=True)
class StreamOptions:
    augment: bool = field(
        default=False,
        metadata={"help": "random augmentation in __getitem__ (torch, numpy and random)"},
    )
    stream: str = field(
        default="",
        metadata={"help": "the training set as an IterableDataset sharded by rank and worker: "
                  "stateful (state_dict/load_state_dict), stateless, or unsized (stateful, "
                  "no len)"},
    )  # fmt: skip
    own_loader: bool = field(
        default=False,
        metadata={"help": "create_dataloader returns torch's DataLoader (no place to save)"},
    )
    own_shuffle: bool = field(
        default=False, metadata={"help": "... shuffled by torch's generator (shuffle=True)"}
    )
    val_stream: bool = field(
        default=False, metadata={"help": "the validation set as a stream (stateful)"}
    )
    record_samples: bool = field(
        default=False,
        metadata={"help": "each rank appends 'EPOCH STEP INDEX...' of its batches to "
                  "RUN_DIR/samples.RANK.txt"},
    )  # fmt: skip


class Augmented(Dataset):
    """Noise drawn from all three generators a data pipeline uses, in ``__getitem__``
    (in a DataLoader worker when --num-workers > 0)."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        x, y = self.inner[index]
        noise = torch.randn(x.shape) + float(np.random.randn()) + random.gauss(0.0, 1.0)
        return x + 0.05 * noise, y


class Stream(IterableDataset):
    """A user's stream: this rank's samples (every world-th), dealt out to the loader's
    workers, in order; it says where it is (samples of this worker's shard yielded in the
    pass), and begins a pass at set_epoch."""

    def __init__(self, inner: Dataset, rank: int, world_size: int) -> None:
        self.inner, self.rank, self.world_size = inner, rank, world_size
        self.position = 0

    def _shard(self) -> range:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.world_size * workers
        return range(self.rank + worker * self.world_size, len(self.inner), step)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.inner), self.world_size))

    def __iter__(self):
        shard = self._shard()
        while self.position < len(shard):
            index = shard[self.position]
            self.position += 1
            yield self.inner[index]

    def set_epoch(self, epoch):
        self.position = 0  # a new pass (a pass read to its end stays there until then)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class UnsizedStream(Stream):
    __len__ = None  # type: ignore[assignment]


class StatelessStream(IterableDataset):
    """The same samples, with no position to save (a generator over the shard)."""

    def __init__(self, inner: Dataset, rank: int, world_size: int) -> None:
        self.stream = Stream(inner, rank, world_size)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self):
        shard = self.stream._shard()
        return (self.stream.inner[i] for i in shard)


def training(train: TensorDataset, o: StreamOptions, rank: int, world_size: int) -> Dataset:
    """The training set as --augment and --stream ask."""
    train = Augmented(train) if o.augment else train
    if o.stream:
        kind = {"stateful": Stream, "stateless": StatelessStream, "unsized": UnsizedStream}
        train = kind[o.stream](train, rank, world_size)
    return train

"""MNIST digits in WebDataset tar shards (``dmltrain mnist --shards 'DIR/train-*.tar'``),
the sharded format large vision and language corpora come in: a stream that shards
itself by rank and loader worker and says where it is, so a resume goes on from there.

Each sample is a ``.png`` (the digit) and a ``.cls`` (its label); ``write_shards`` makes
them from MNIST's arrays. Needs ``webdataset``.
"""

import glob
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dmltrain.errors import UserError, first_line

from .mnist_data import MEAN, STD


def _webdataset() -> Any:
    try:
        import webdataset
    except ImportError:
        raise UserError("--shards needs webdataset: pip install webdataset") from None
    return webdataset


def write_shards(images: np.ndarray, labels: np.ndarray, pattern: str, per_shard: int) -> int:
    """Digits (uint8, N x 28 x 28) and their labels as tar shards named by ``pattern``
    (``DIR/train-%06d.tar``), ``per_shard`` samples each, in an order drawn once (as a
    corpus is written: a shard's digits are not all one class); the shards written."""
    from PIL import Image

    wds = _webdataset()
    order = np.random.default_rng(0).permutation(len(images))
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for i in order:
            image, label = images[i], labels[i]
            sink.write({"__key__": f"{i:07d}", "png": Image.fromarray(image), "cls": int(label)})
    return len(glob.glob(pattern.replace("%06d", "*")))


class MnistShards(IterableDataset):
    """The digits of the shards ``pattern`` matches (a glob), in name order: rank ``rank``
    of ``world_size`` reads every ``world_size``-th shard and its loader workers take
    those in turn; each shard's digits come in an order drawn from (seed, pass, shard), a
    shard being the shuffle buffer. A pass begins at ``set_epoch``; ``state_dict`` is
    (pass, shard, sample)."""

    def __init__(self, pattern: str, rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise UserError(
                f"--shards {pattern} matches no file: check the path, and quote the glob "
                "(--shards 'DIR/train-*.tar') so that the shell leaves it to dmltrain"
            )
        bad = [f for f in self.files if not (Path(f).is_file() and tarfile.is_tarfile(f))]
        if bad:
            raise UserError(
                f"--shards {pattern}: {bad[0]} is not a tar file"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                + ": rewrite it, or leave it out of the glob"
            )
        if len(self.files) < world_size:
            raise UserError(
                f"--shards {pattern} matches {len(self.files)} file(s), fewer than the "
                f"{world_size} processes: each reads whole shards; write smaller ones"
            )
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch = self.shard = self.sample = 0  # where this worker is in its shards
        _webdataset()  # a clear error now, not in a loader worker

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.shard, self.sample = epoch, 0, 0

    def _mine(self) -> list[str]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return self.files[self.rank :: self.world_size][worker::workers]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        wds, mine = _webdataset(), self._mine()
        while self.shard < len(mine):
            digits = wds.WebDataset(
                [mine[self.shard]],
                shardshuffle=False,
                nodesplitter=None,
                workersplitter=None,
                empty_check=False,
            )
            name = Path(mine[self.shard]).name
            try:
                samples = list(digits.decode("l8").to_tuple("png", "cls"))
            except Exception as exc:  # tarfile's, webdataset's, PIL's: a shard that is not
                raise UserError(
                    f"--shards: {mine[self.shard]} is not a whole shard of digits (each a .png "
                    f"and a .cls): {first_line(exc)}; rewrite it, or leave it out of the glob"
                ) from None
            draw = np.random.default_rng([self.seed, self.epoch, zlib.crc32(name.encode())])
            order = draw.permutation(len(samples))
            while self.sample < len(samples):
                image, label = samples[order[self.sample]]
                self.sample += 1
                x = torch.from_numpy(image.astype(np.float32) / 255.0).sub_(MEAN).div_(STD)
                yield x.unsqueeze(0), int(label)
            self.shard, self.sample = self.shard + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.shard, self.sample = state["epoch"], state["shard"], state["sample"]

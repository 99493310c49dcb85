"""Per-channel statistics of an archive's period (a variable's level is a channel), computed
in one pass, kept in a JSON file and reused; the loader applies them, the model holds them
as buffers to put its outputs back in physical units.

A channel whose values are constant (a land-sea mask of one value) has a standard
deviation of 0: it is divided by 1 instead.
"""

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dmltrain.data.archive import Archive
from dmltrain.errors import UserError

# Steps read at once while computing statistics: whole chunks, a few at a time
READ_CHUNKS = 4


@dataclass(frozen=True)
class Stats:
    """Mean and standard deviation of each channel, over ``period`` (the time indices
    of ``source`` they were computed over)."""

    channels: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str = ""
    period: tuple[int, int] = (0, 0)

    @classmethod
    def compute(cls, archive: Archive) -> "Stats":
        """One pass over ``archive``'s period in whole chunks, the static fields too;
        float64 sums merged chunk by chunk (Chan et al.), so a long period loses nothing."""
        count, mean, m2 = 0, np.zeros(len(archive.channels)), np.zeros(len(archive.channels))
        step = archive.chunk * READ_CHUNKS
        first = archive.start - archive.start % archive.chunk  # on the chunks' grid
        for begin in range(first, archive.stop, step):
            lo, hi = (
                max(begin, archive.start) - archive.start,
                min(begin + step, archive.stop) - archive.start,
            )
            count, mean, m2 = _merge(count, mean, m2, archive.read(lo, hi))
        static = archive.read_static()
        channels = list(archive.channels)
        means, stds = [float(m) for m in mean], [float(s) for s in np.sqrt(m2 / count)]
        for name, field in zip(archive.static, static, strict=True):
            channels.append(name)
            means.append(float(field.mean(dtype=np.float64)))
            stds.append(float(field.std(dtype=np.float64)))
        return cls(tuple(channels), tuple(map(float, means)), tuple(map(float, stds)),
                   archive.name, (archive.start, archive.stop))  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> "Stats":
        try:
            saved = json.loads(Path(path).read_text())
            stats = cls(tuple(saved["channels"]), tuple(saved["mean"]), tuple(saved["std"]),
                        saved.get("source", ""), tuple(saved.get("period", (0, 0))))  # fmt: skip
            stats.check()
            return stats
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(
                f"{path} is not a statistics file dmltrain can read ({exc}); delete it and "
                "it is computed again"
            ) from None

    def check(self) -> None:
        """A ValueError unless there is a name, a mean and a std for each channel."""
        if not all(isinstance(c, str) for c in self.channels):
            raise ValueError("a channel's name is not a string")
        for which, values in (("mean", self.mean), ("std", self.std)):
            if len(values) != len(self.channels):
                raise ValueError(f"{len(values)} {which} values for {len(self.channels)} channels")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ValueError(f"a {which} value is not a number")

    def save(self, path: str | Path) -> None:
        """Written whole or not at all (a file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_text(json.dumps({"channels": list(self.channels), "mean": list(self.mean),
                                    "std": list(self.std), "source": self.source,
                                    "period": list(self.period)}, indent=1))  # fmt: skip
        os.replace(part, path)

    def of(self, channels: list[str], where: str = "") -> tuple[np.ndarray, np.ndarray]:
        """float32 mean and divisor (std, 1 where it is 0) of ``channels``, in order."""
        index = {name: i for i, name in enumerate(self.channels)}
        missing = [c for c in channels if c not in index]
        if missing:
            raise UserError(
                f"the statistics{where} have no channel {', '.join(missing)} (they have "
                f"{', '.join(self.channels)}): delete the file and it is computed again"
            )
        mean = np.array([self.mean[index[c]] for c in channels], np.float32)
        std = np.array([self.std[index[c]] for c in channels], np.float32)
        return mean, np.where(std > 0, std, 1).astype(np.float32)

    def module(self, channels: list[str], grid_dims: int = 2) -> "Normaliser":
        """An ``nn.Module`` with ``channels``' statistics as buffers (in the model, they
        are checkpointed with it and go where it goes)."""
        mean, std = self.of(channels)
        return Normaliser(torch.from_numpy(mean), torch.from_numpy(std), grid_dims)


def _merge(
    count: int, mean: np.ndarray, m2: np.ndarray, rows: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray]:
    """The running (count, mean, sum of squared deviations) with ``rows`` added:
    float32 (steps, channels, *grid)."""
    values = np.moveaxis(rows, 1, 0).reshape(rows.shape[1], -1).astype(np.float64)
    n = values.shape[1]
    here = values.mean(axis=1)
    here_m2 = ((values - here[:, None]) ** 2).sum(axis=1)
    total = count + n
    delta = here - mean
    return total, mean + delta * n / total, m2 + here_m2 + delta**2 * count * n / total


def statistics(archive: Archive, path: str | Path | None) -> Stats:
    """The statistics in ``path``; where there is none, computed over ``archive``'s period
    and written there (None: computed, not kept). Of the processes that ask at once, the
    first computes them while the others wait on a lock beside the file, then read it."""
    if path is None:
        return Stats.compute(archive)
    path = Path(path)
    if path.exists():
        return Stats.load(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f"{path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():  # another process wrote them while this one waited
                return Stats.load(path)
            stats = Stats.compute(archive)
            stats.save(path)
            return stats
    except OSError as exc:
        raise UserError(
            f"cannot keep the statistics at {path} ({exc.strerror or exc}): give a stats path "
            "in a folder you can write"
        ) from None


class Normaliser(nn.Module):
    """``normalise(x)`` and ``denormalise(x)`` over the channel axis of ``x`` (..., channels,
    *grid), with the mean and divisor as buffers."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, grid_dims: int = 2) -> None:
        super().__init__()
        shape = (-1, *([1] * grid_dims))
        self.register_buffer("mean", mean.reshape(shape))
        self.register_buffer("std", std.reshape(shape))

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalise(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def forward(self, x: Any) -> torch.Tensor:
        return self.denormalise(x)

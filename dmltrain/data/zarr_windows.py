"""Samples of a gridded archive in windows along time, as climate models read their
(time, level, lat, lon) archives: a stream that reads whole chunks, shards itself and says
where it is.

Sample ``t`` is ``(inputs, target)``: the channels at ``window`` consecutive time steps
from ``t`` (the static fields appended to each), and at ``lead`` steps after the last of
them. The archive (``data.archive``) is opened in the process that reads it.

Reading: the time axis is cut in blocks of ``chunks_per_read`` whole chunks. A pass reads
each block once and serves every window that starts in it (a block's read runs on into
the next chunk by the window's span). With a seed, the blocks come in a shuffled order
each pass and the samples of ``shuffle_buffer`` blocks at a time are shuffled together:
a sample's neighbours in a batch come from a few places in the archive, not from
anywhere in it as under a full shuffle. ``dmltrain[climate]``.
"""

import random
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dmltrain.data.archive import Archive, ChunkGone, Source
from dmltrain.data.normalise import Stats, statistics
from dmltrain.errors import UserError

__all__ = ["ChunkGone", "ZarrWindows"]

Piece = tuple[int, int]  # sample starts first..stop-1 of one block


class ZarrWindows(IterableDataset):
    """``(inputs, target)`` float32 tensors from ``variables`` of ``source`` (``Archive``:
    a zarr group, a netCDF/HDF5 file or glob, or a function that opens an xarray Dataset):
    inputs ``(window, channels + static, *grid)``, target ``(channels, *grid)``, or
    ``(leads, channels, *grid)`` where ``lead`` is a list.

    ``stats``: ``Stats``, or a JSON file of them (computed over this dataset's period and
    written there where there is none), applied to inputs and targets; None: raw values.

    Rank ``rank`` of ``world_size`` takes an equal share of each pass (the remainder left
    out; ``drop_remainder=False``: every sample, shares one apart, for validation); its
    loader workers split it. ``set_epoch`` begins a pass; ``state_dict`` says where this
    worker is in it. ``shuffle_buffer`` blocks of ``chunks_per_read`` chunks are read and
    shuffled together (by default, blocks long enough that a window's run into the next
    chunk adds at most a quarter).

    ``ensemble``: the ranks in groups of this many consecutive ranks read the same
    samples in the same order, as an ensemble whose members are ranks needs (the fair
    CRPS compares them on the same batch). ``follow`` sends each pass only the leads a
    rollout schedule uses in it.
    """

    def __init__(
        self,
        source: Source,
        variables: str | Sequence[str],
        window: int = 1,
        lead: int | Sequence[int] = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int | None = None,
        *,
        levels: Sequence[Any] | None = None,
        period: tuple[Any, Any] | None = None,
        static: Sequence[str] = (),
        stats: Stats | str | Path | None = None,
        shuffle_buffer: int = 4,
        chunks_per_read: int | None = None,
        drop_remainder: bool = True,
        ensemble: int = 1,
        time_dim: str = "time",
        level_dim: str = "level",
    ) -> None:
        self.leads = [lead] if isinstance(lead, int) else sorted(set(lead))
        if window < 1 or not self.leads or min(self.leads) < 1:
            raise UserError(f"ZarrWindows: window and lead must be >= 1 (got {window}, {lead})")
        if shuffle_buffer < 1 or (chunks_per_read is not None and chunks_per_read < 1):
            raise UserError("ZarrWindows: shuffle_buffer and chunks_per_read must be >= 1")
        self.archive = Archive(source, variables, levels, period, static, time_dim, level_dim)
        self.path = self.archive.name
        self.window, self.lead = window, lead
        if ensemble < 1 or world_size % ensemble:
            raise UserError(
                f"ZarrWindows: ensemble={ensemble} must divide the {world_size} processes"
            )
        # the ranks of an ensemble group read as one: rank and world size count groups
        self.rank, self.world_size = rank // ensemble, world_size // ensemble
        self.seed = seed
        self.schedule: Callable[[int], int] | None = None
        self.steps_per_pass = 0
        self.span = window + self.leads[-1]  # the steps one sample reads
        # a block's read decodes the chunks its last windows run on into: at most a
        # quarter more than the block by default
        chunk = self.archive.chunk
        chunks_per_read = chunks_per_read or 4 * -(-(self.span - 1) // chunk)
        self.shuffle_buffer, self.block = shuffle_buffer, chunk * chunks_per_read
        self.drop_remainder = drop_remainder
        self.channels = self.archive.channels + self.archive.static  # of the inputs
        self.target_channels = list(self.archive.channels)
        self.epoch = 0  # the pass, for the shuffle
        self.position = 0  # samples of this worker's share of the pass yielded
        self.samples = max(self.archive.steps - self.span + 1, 0)
        readers = f"{world_size} processes" if ensemble == 1 else f"{self.world_size} groups"
        if self.samples < self.world_size:
            raise UserError(
                f"{self.path}: {self.archive.steps} time steps make {self.samples} sample(s) "
                f"of window {window} and lead {max(self.leads)}, fewer than the {readers}"
            )
        self.stats = (
            statistics(self.archive, stats) if not isinstance(stats, Stats | None) else stats
        )
        self._scale = None if self.stats is None else self.stats.of(self.channels, f" ({stats})")
        self._static: np.ndarray | None = None
        self._slots: tuple[list[np.ndarray], ...] = ([], [])  # rows buffers are read into

    def __len__(self) -> int:
        """This rank's samples in a pass."""
        lo, hi = self._share(self.rank)
        return hi - lo

    def _share(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s part of a pass's samples laid end to end: equal parts, the
        remainder left out (``drop_remainder``), or all of them, parts one apart."""
        total = self.samples
        if self.drop_remainder:
            total -= total % self.world_size
        return total * rank // self.world_size, total * (rank + 1) // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Begin pass ``epoch`` (dmltrain's loop calls it before each pass). A pass read to
        its end stays there until then: a worker restored at its end yields nothing more."""
        self.epoch, self.position = epoch, 0

    def follow(self, schedule: Callable[[int], int], steps_per_pass: int) -> None:
        """Send each pass targets for the longest rollout ``schedule`` (global step ->
        forecast steps, as ``RolloutSchedule``) makes in it: the first that many leads.
        Pass ``e`` is taken to run global steps ``e * steps_per_pass`` to the next pass's
        first (the optimizer steps a pass makes: samples / batch / accumulation)."""
        if steps_per_pass < 1:
            raise UserError(f"ZarrWindows.follow: steps_per_pass must be >= 1 ({steps_per_pass})")
        if self.leads != list(range(1, len(self.leads) + 1)):
            raise UserError(f"ZarrWindows.follow: a rollout needs leads 1, 2, ... ({self.lead})")
        self.schedule, self.steps_per_pass = schedule, steps_per_pass

    def leads_now(self) -> list[int]:
        """The leads this pass sends."""
        if self.schedule is None:
            return self.leads
        first = self.epoch * self.steps_per_pass
        steps = range(first, first + self.steps_per_pass + 1)  # + 1: the next pass's first
        longest = max(self.schedule(step) for step in steps)
        if longest > len(self.leads):
            raise UserError(
                f"the rollout schedule rolls {longest} steps in pass {self.epoch}; "
                f"ZarrWindows holds {len(self.leads)} leads: give lead=range(1, {longest + 1})"
            )
        return self.leads[:longest]

    # ----- the plan of a pass ---------------------------------------------------------------
    def blocks(self) -> list[Piece]:
        """Every block's sample starts, in time order; blocks are on the archive's chunk
        grid (the period need not start on it)."""
        start, block = self.archive.start, self.block
        edges = range(start - start % block, start + self.samples, block)
        return [(max(e - start, 0), min(e - start + block, self.samples)) for e in edges]

    def pieces(self, worker: int, workers: int) -> list[Piece]:
        """This worker's pieces of blocks in the pass, in order: the blocks (shuffled by
        seed and pass) laid end to end and cut in equal shares by rank, then by worker."""
        blocks = self.blocks()
        if self.seed is not None:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(blocks)
        begin, end = self._share(self.rank)
        lo = begin + (end - begin) * worker // workers
        hi = begin + (end - begin) * (worker + 1) // workers
        mine, at = [], 0
        for first, stop in blocks:
            a, b = max(first, first + lo - at), min(stop, first + hi - at)
            if a < b:
                mine.append((a, b))
            at += stop - first
        return mine

    def _order(self, pieces: list[Piece], worker: int, number: int) -> list[int]:
        """The sample starts of one buffer of ``pieces``: shuffled together with a seed."""
        starts = [t for first, stop in pieces for t in range(first, stop)]
        if self.seed is not None:
            key = f"{self.seed}-{self.epoch}-{self.rank}-{worker}-{number}"
            random.Random(key).shuffle(starts)
        return starts

    # ----- reading ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        leads = self.leads_now()
        pieces = self.pieces(worker, workers)
        skip = self.position
        for number, at in enumerate(range(0, len(pieces), self.shuffle_buffer)):
            buffer = pieces[at : at + self.shuffle_buffer]
            size = sum(stop - first for first, stop in buffer)
            if skip >= size:
                skip -= size
                continue
            rows = {p[0]: self._rows(number, i, *p) for i, p in enumerate(buffer)}
            owner = {t: first for first, stop in buffer for t in range(first, stop)}
            for t in self._order(buffer, worker, number)[skip:]:
                self.position += 1
                yield self._sample(rows[owner[t]], t - owner[t], leads)
            skip = 0

    def _rows(self, buffer: int, number: int, first: int, stop: int) -> np.ndarray:
        """Normalised float32 rows of the steps samples first..stop-1 read, static fields
        appended to each."""
        rows = self.archive.read(
            first, stop - 1 + self.span, self._slot(buffer, number, stop - first)
        )
        if self.archive.static:
            if self._static is None:
                self._static = self.archive.read_static()
            rows[:, len(self.target_channels) :] = self._static
        if self._scale is not None:
            shape = (-1, *([1] * (rows.ndim - 2)))
            rows -= self._scale[0].reshape(shape)
            rows /= self._scale[1].reshape(shape)
        return rows

    def _slot(self, buffer: int, number: int, samples: int) -> np.ndarray:
        """Rows for ``samples`` samples, the ``number``-th piece of a buffer: the memory
        read into two buffers before, which no sample holds any more (fresh memory's first
        touch cost as much as decoding into it: benchmarks/findings.md). Otherwise, and
        at first, new memory."""
        slots = self._slots[buffer % 2]  # the last buffer's samples may wait in a batch
        shape = (self.block + self.span - 1, len(self.channels), *self.archive.grid)
        if number == len(slots):
            slots.append(np.empty(shape, np.float32))
        elif sys.getrefcount(slots[number]) > 2:  # a sample's view of it lives on
            slots[number] = np.empty(shape, np.float32)
        return slots[number][: samples - 1 + self.span]

    def _sample(
        self, rows: np.ndarray, j: int, leads: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample at row ``j``: views of the rows, which a batch copies."""
        inputs = rows[j : j + self.window]
        last, channels = j + self.window - 1, len(self.target_channels)
        if isinstance(self.lead, int):
            target = rows[last + self.lead, :channels]
        else:
            target = rows[[last + k for k in leads], :channels]
        return torch.from_numpy(inputs), torch.from_numpy(target)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __getstate__(self) -> dict[str, Any]:
        # read again where it is read; the rows allocated there
        return {**self.__dict__, "_static": None, "_slots": ([], [])}

"""Reading a climate archive in windows (ZarrWindows) against reading its arrays in order.

    python benchmarks/archive_read.py            # a 2 GB store, 3 rounds (4 minutes)
    python benchmarks/archive_read.py --quick    # 0.5 GB, 1 round
    python benchmarks/archive_read.py --smoke    # 40 MB: that it runs

An ERA5-like zarr store written here: 6 variables x 4 levels x 64 x 128 float32, chunks
of 24 time steps, zarr's default compressor, smooth fields with noise. The sequential
read decodes each array chunk by chunk in time order, in this process: the rate the
disk and the decompressor allow. ZarrWindows (window 2, lead 1) goes through torch's
DataLoader (batch 16), shuffled and in order, with 0, 2 and 4 workers. MB/s counts
distinct data: one time step of every variable a sample. A pass includes starting its
workers; each loader is made once and read a pass a round, as epochs are, after a
round to warm up. The store sits in the page cache, so both measure decoding, not the
disk. "The loader alone" feeds the same DataLoader samples of the same shapes from
memory: its limit. The per-sample read, as ZarrWindows read before it read whole chunks,
is timed on 400 random samples.
"""

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dmltrain.data.zarr_windows import ZarrWindows

VARIABLES, LEVELS, GRID, CHUNK = 6, 4, (64, 128), 24
BATCH = 16
STEP_BYTES = VARIABLES * LEVELS * GRID[0] * GRID[1] * 4


def write(path: Path, steps: int) -> None:
    """Fields that drift in time: a smooth pattern per variable and level, and noise."""
    import zarr

    group = zarr.open_group(path, mode="w")
    lat, lon = np.meshgrid(np.linspace(-1.5, 1.5, GRID[0]), np.linspace(0, 6.28, GRID[1]),
                           indexing="ij")  # fmt: skip
    rng = np.random.default_rng(0)
    for v in range(VARIABLES):
        array = group.create_array(f"v{v}", shape=(steps, LEVELS, *GRID),
                                   chunks=(CHUNK, LEVELS, *GRID), dtype="f4")  # fmt: skip
        for first in range(0, steps, CHUNK):
            t = np.arange(first, min(first + CHUNK, steps))[:, None, None, None]
            level = np.arange(LEVELS)[None, :, None, None]
            field = 250 + 20 * np.cos(lat) * np.sin(lon - t / 50 + v) + 5 * level
            noise = rng.standard_normal((len(t), LEVELS, *GRID))
            array[first : first + len(t)] = (field + noise).astype(np.float32)


def sequential(path: Path) -> float:
    """Seconds to decode every array chunk by chunk, in time order."""
    import zarr

    group = zarr.open_group(path, mode="r")
    started = time.perf_counter()
    for v in range(VARIABLES):
        array = group[f"v{v}"]
        for first in range(0, array.shape[0], CHUNK):
            array[first : first + CHUNK]
    return time.perf_counter() - started


def windows(path: Path, workers: int, shuffled: bool) -> DataLoader:
    """ZarrWindows through a DataLoader: made once, a pass each round (as epochs)."""
    data = ZarrWindows(str(path), [f"v{v}" for v in range(VARIABLES)], window=2, lead=1,
                       seed=0 if shuffled else None)  # fmt: skip
    return DataLoader(data, batch_size=BATCH, num_workers=workers)


class InMemory(IterableDataset):
    """Samples of ZarrWindows' shapes from memory: what the loader alone can move."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.inputs = torch.zeros(2, VARIABLES * LEVELS, *GRID)
        self.target = torch.zeros(VARIABLES * LEVELS, *GRID)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for _ in range(worker, self.samples, workers):
            yield self.inputs, self.target

    def set_epoch(self, epoch: int) -> None:
        pass


def one_pass(loader: DataLoader, number: int) -> tuple[int, float]:
    """Samples and seconds of pass ``number``."""
    loader.dataset.set_epoch(number)  # type: ignore[attr-defined]
    started, samples = time.perf_counter(), 0
    for inputs, _ in loader:
        samples += len(inputs)
    return samples, time.perf_counter() - started


def per_sample(path: Path, count: int) -> float:
    """Seconds a sample, read as three steps of every array at a random time."""
    import zarr

    group = zarr.open_group(path, mode="r")
    arrays = [group[f"v{v}"] for v in range(VARIABLES)]
    starts = random.Random(0).sample(range(arrays[0].shape[0] - 2), count)
    started = time.perf_counter()
    for t in starts:
        np.stack([a[t : t + 2] for a in arrays], axis=1)
        np.stack([a[t + 2] for a in arrays])
    return (time.perf_counter() - started) / count


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="0.5 GB, one round")
    parser.add_argument("--smoke", action="store_true", help="40 MB: that it runs")
    args = parser.parse_args(argv)
    steps = 48 if args.smoke else 650 if args.quick else 2600
    rounds = 1 if args.quick or args.smoke else 3
    scratch = Path(tempfile.mkdtemp(prefix="archive-"))
    try:
        store = scratch / "era.zarr"
        write(store, steps)
        size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
        loaders = {
            f"{'shuffled' if s else 'in order'}, {w} workers": windows(store, w, s)
            for s in (True, False)
            for w in (0, 2, 4)
        }
        ceiling = {f"{w} workers": DataLoader(InMemory(steps - 2), batch_size=BATCH,
                                              num_workers=w) for w in (0, 2, 4)}  # fmt: skip
        seconds: dict[str, list[float]] = {"sequential": []}
        served: dict[str, int] = {}
        sequential(store)  # warm-up: the store in the page cache
        for number in range(rounds + 1):  # the first round warms up: memory, page cache
            took = sequential(store)
            if number:
                seconds["sequential"].append(took)
            for name, loader in {
                **loaders,
                **{f"ceiling {k}": v for k, v in ceiling.items()},
            }.items():
                served[name], took = one_pass(loader, number)
                seconds.setdefault(name, [])
                if number:
                    seconds[name].append(took)
        sample_s = per_sample(store, 40 if args.smoke else 400)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = steps * STEP_BYTES / statistics.median(seconds["sequential"]) / 1e6
    lines = [
        f"archive_read: a zarr store of {VARIABLES} variables x {LEVELS} levels x "
        f"{GRID[0]} x {GRID[1]} float32, {steps} time steps ({steps * STEP_BYTES / 1e9:.2f} GB; "
        f"{size / 1e9:.2f} GB on disk), chunks of {CHUNK} steps; window 2, lead 1, batch "
        f"{BATCH}; median of {rounds} pass(es) each, in turns",
        "| read | samples/s | MB/s of distinct data | vs the sequential read | the loader "
        "alone (samples/s) |",
        "|---|---|---|---|---|",
        f"| sequential, chunk by chunk | | {base:,.0f} | 1.00x | |",
    ]
    ratios = {}
    for name in loaders:
        rate = served[name] / statistics.median(seconds[name])
        alone = f"ceiling {name.split(', ')[1]}"
        top = served[alone] / statistics.median(seconds[alone])
        mb = rate * STEP_BYTES / 1e6
        ratios[f"archive, {name}: MB/s / sequential"] = mb / base
        lines.append(f"| ZarrWindows, {name} | {rate:,.0f} | {mb:,.0f} | {mb / base:.2f}x | "
                     f"{top:,.0f} |")  # fmt: skip
    mb = STEP_BYTES / sample_s / 1e6
    lines.append(f"| per sample, shuffled (before), 0 workers | {1 / sample_s:,.0f} | "
                 f"{mb:,.0f} | {mb / base:.2f}x | |")  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios, "sequential_mb_s": base}


if __name__ == "__main__":
    main()

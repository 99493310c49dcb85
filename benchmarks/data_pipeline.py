"""Loader throughput with and without per-sample seeds (``dmltrain.data.samples.SeededSamples``).

    python benchmarks/data_pipeline.py            # 5 rounds
    python benchmarks/data_pipeline.py --quick    # 1 round

The bundled MNIST sample's 4,000 training digits, batch 64, read by a DataLoader as
dmltrain builds it (persistent workers), with 0 and 2 workers, for two datasets: with a
random augmentation that draws from torch, numpy and random (a shift, a brightness
factor, noise), and without (a TensorDataset, which draws nothing: dmltrain fetches it
without seeds, so "seeded" there is the wrapper's own cost). Per round, each contender
reads the data once, in turns (plain, seeded, plain, seeded, ...); samples/s is from the
median pass.
"""

import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import loader_benchmark
from dmltrain.data.samples import ResumableSampler, SeededSamples

BATCH = 64


class Augmented(Dataset):
    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        x, y = self.inner[index]
        shift = (random.randint(-2, 2), random.randint(-2, 2))
        x = torch.roll(x, shifts=shift, dims=(1, 2)) * float(np.random.uniform(0.8, 1.2))
        return x + 0.1 * torch.randn_like(x), y


def loader(dataset: Dataset, seeded: bool, workers: int) -> DataLoader:
    if seeded:
        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, seed=0)
        dataset = SeededSamples(dataset, seed=0)
    else:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers,
                      persistent_workers=workers > 0)  # fmt: skip


def one_pass(data: DataLoader) -> float:
    started = time.perf_counter()
    for _ in data:
        pass
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    rounds, train = loader_benchmark(__doc__.splitlines()[0], argv)
    lines = [
        f"data_pipeline: {len(train)} MNIST digits, batch {BATCH}, median of {rounds} "
        "pass(es) each, plain and seeded in turns",
        "| dataset | workers | plain (samples/s) | seeded (samples/s) | seeded time / plain "
        "| cost (us a sample) |",
        "|---|---|---|---|---|---|",
    ]
    ratios, costs = {}, {}
    for name, dataset in (("augmented", Augmented(train)), ("TensorDataset", train)):
        for workers in (0, 2):
            loaders = {s: loader(dataset, s, workers) for s in (False, True)}
            for data in loaders.values():
                one_pass(data)  # warm-up: workers start, pages are touched
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for seeded, data in loaders.items():
                    times[seeded].append(one_pass(data))
            plain, seeded = (statistics.median(times[s]) for s in (False, True))
            ratio, cost = seeded / plain, (seeded - plain) / len(train) * 1e6
            ratios[f"loader {name}, {workers} workers: seeded / plain time"] = ratio
            costs[f"{name}, {workers} workers"] = cost
            lines.append(f"| {name} | {workers} | {len(train) / plain:,.0f} | "
                         f"{len(train) / seeded:,.0f} | {ratio:.2f}x | {cost:+.1f} |")  # fmt: skip
            del loaders
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios, "us_per_sample": costs}


if __name__ == "__main__":
    main()

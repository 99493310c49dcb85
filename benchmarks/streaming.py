"""Loader throughput of a stream against map-style data, and the cost of its saved place.

    python benchmarks/streaming.py            # 5 rounds
    python benchmarks/streaming.py --quick    # 1 round

The bundled MNIST sample's 4,000 training digits 5 times over, batch 64, with 0 and 2 workers, read
three ways, each as dmltrain builds it: map-style (dmltrain's sampler and per-sample
seeds, persistent workers); the same digits as a stream through dmltrain's default
stream loader (torchdata's StatefulDataLoader, which keeps each worker's place every
batch; workers start anew each pass); and that stream through torch's DataLoader (no
place kept). Per round each reads the data once, in turns; samples/s is from the median
pass. A stream's pass includes starting its workers.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    get_worker_info,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import loader_benchmark
from dmltrain.data import streams
from dmltrain.data.samples import ResumableSampler, SeededSamples
from dmltrain_experiments.mnist import Net

BATCH = 64
REPEAT = 5  # the sample's digits, this many times a pass


class Digits(IterableDataset):
    """The digits as a user's stream: dealt out to the workers, with a place to save."""

    def __init__(self, inner: Dataset) -> None:
        self.inner, self.position = inner, 0

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        shard = range(worker, len(self.inner), workers)  # type: ignore[arg-type]
        while self.position < len(shard):
            self.position += 1
            yield self.inner[shard[self.position - 1]]

    def set_epoch(self, epoch: int) -> None:
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def map_style(dataset: Dataset, workers: int) -> DataLoader:
    sampler = ResumableSampler(dataset, num_replicas=1, rank=0, seed=0)
    return DataLoader(SeededSamples(dataset, seed=0), batch_size=BATCH, sampler=sampler,
                      num_workers=workers, persistent_workers=workers > 0)  # fmt: skip


def one_pass(data: DataLoader) -> float:
    started = time.perf_counter()
    for _ in streams.evaluation_pass(data):  # a stream's pass begins with set_epoch
        pass
    return time.perf_counter() - started


def training_pass(data: DataLoader, model: torch.nn.Module, optimizer) -> float:
    """A pass with the MNIST CNN's step on each batch: the loader's workers run beside it."""
    started = time.perf_counter()
    for images, labels in streams.evaluation_pass(data):
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return time.perf_counter() - started


def in_training(train: Dataset, rounds: int) -> tuple[str, float]:
    """The stream through dmltrain's loader and through torch's, 2 workers each, feeding
    the MNIST CNN in turns: the step's time with the place kept, over without (us)."""
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)  # as dmltrain
    loaders = {
        "kept": streams.loader(Digits(train), BATCH, 2, False),
        "not": DataLoader(Digits(train), batch_size=BATCH, num_workers=2),
    }
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for data in loaders.values():
        training_pass(data, model, optimizer)  # warm-up
    for _ in range(rounds):
        for name, data in loaders.items():
            times[name].append(training_pass(data, model, optimizer))
    kept, plain = (statistics.median(times[n]) for n in ("kept", "not"))
    steps = -(-len(train) // BATCH)  # type: ignore[arg-type]
    extra = (kept - plain) / steps * 1e6
    ms = plain / steps * 1e3
    line = (f"in training (the MNIST CNN's step on each of {len(train)} digits' batches, 2 "
            f"workers, in turns, median of {rounds}): {ms:.2f} ms a step without the place "
            f"kept, {extra:+.0f} us a step with it ({kept / plain:.3f}x)")  # fmt: skip
    return line, kept / plain


def main(argv: list[str] | None = None) -> dict:
    rounds, digits = loader_benchmark(__doc__.splitlines()[0], argv)
    train = ConcatDataset([digits] * REPEAT)  # a pass long beside its workers' start
    lines = [
        f"streaming: {len(train)} MNIST digits (the sample {REPEAT} times), batch {BATCH}, "
        f"median of {rounds} pass(es) each, in turns",
        "| workers | map-style (samples/s) | stream, dmltrain's loader (samples/s) | stream, "
        "torch's DataLoader (samples/s) | stream / map-style time | place kept / not | "
        "place kept: extra us a step |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios, extra = {}, {}
    steps = -(-len(train) // BATCH)
    for workers in (0, 2):
        loaders = {
            "map": map_style(train, workers),
            "stream": streams.loader(Digits(train), BATCH, workers, False),
            "plain stream": DataLoader(Digits(train), batch_size=BATCH, num_workers=workers),
        }
        for data in loaders.values():
            one_pass(data)  # warm-up: pages are touched, persistent workers start
        times: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(rounds):
            for name, data in loaders.items():
                times[name].append(one_pass(data))
        median = {name: statistics.median(t) for name, t in times.items()}
        versus_map = median["stream"] / median["map"]
        kept = median["stream"] / median["plain stream"]
        ratios[f"streaming, {workers} workers: stream / map-style time"] = versus_map
        ratios[f"streaming, {workers} workers: place kept / not"] = kept
        extra[f"{workers} workers"] = (median["stream"] - median["plain stream"]) / steps * 1e6
        rates = [f"{len(train) / median[n]:,.0f}" for n in ("map", "stream", "plain stream")]
        lines.append(f"| {workers} | {' | '.join(rates)} | {versus_map:.2f}x | {kept:.2f}x | "
                     f"{extra[f'{workers} workers']:+.0f} |")  # fmt: skip
        del loaders
    fed = digits if rounds > 1 else Subset(digits, range(256))  # --quick: that it runs
    line, ratios["streaming in training: place kept / not"] = in_training(fed, rounds)
    text = "\n".join([*lines, "", line])
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios, "us_per_step": extra}


if __name__ == "__main__":
    main()

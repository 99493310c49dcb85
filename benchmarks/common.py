"""What the benchmarks share: the models, in-memory data, the step clock, peak memory,
and running contenders interleaved in fresh processes."""

import atexit
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

ROOT = Path(__file__).resolve().parent.parent


class Block(nn.Module):
    """A pre-norm transformer block (attention and a 4x MLP)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A ViT-Base (12 blocks of width 768: 85M parameters) over 28x28 images in 4x4 patches
    (49 tokens): the size users train."""

    def __init__(self, width: int = 768, depth: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.patches = nn.Conv2d(1, width, 4, 4)
        self.position = nn.Parameter(torch.zeros(1, 49, width))
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patches(x).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def make_model(name: str) -> nn.Module:
    """``tiny``: a linear layer (7,850 parameters: a step is almost nothing but the
    framework's own work, so it shows that work in microseconds); ``cnn``: dmltrain's
    MNIST CNN (1.2M parameters); ``mlp``: a 784-4096-4096-4096-10 MLP (37M parameters);
    ``vit``: a ViT-Base (85M parameters)."""
    if name == "vit":
        return ViT()
    if name == "tiny":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    if name == "cnn":
        from dmltrain_experiments.mnist import Net

        return Net()
    if name == "mlp":
        widths = [784, 4096, 4096, 4096]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(widths[-1], 10))
    raise ValueError(name)


def make_data(samples: int, seed: int = 0) -> TensorDataset:
    """MNIST-shaped random images and labels, held in memory."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 1, 28, 28, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (samples,), generator=g))


class Clocked(nn.Module):
    """Wraps a model; times training steps by the forward calls it sees, so the same clock
    runs inside every framework: between the starts of two consecutive training forwards
    lies exactly one whole step (data, forward, backward, optimizer, the framework's own
    work). Steps ``warmup`` to ``warmup + steps`` are timed.

    ``turn``, when given, is called every ``block`` timed steps (at the start of a forward):
    it hands the process to another contender (``common.rotate``) and returns when this
    one's turn comes again. A step that spans a hand-off is not timed.

    On the CPU each step is timed and ``step_time`` is their median (robust to the
    interference of other processes on a shared machine); on a GPU a per-step sync would
    change what is measured, so the clock syncs only at block ends and ``step_time`` is the
    median over blocks of a block's mean step."""

    def __init__(
        self,
        model: nn.Module,
        warmup: int,
        steps: int,
        device: str,
        block: int = 0,
        turn: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self.model, self.warmup, self.steps = model, warmup, steps
        self.block = block or steps
        self.turn = turn
        self.cuda = device.startswith("cuda")
        self.calls = 0
        self.intervals: list[float] = []  # CPU: single steps
        self.blocks: list[float] = []  # mean step of each block
        self.last = self.block_start = 0.0
        self.block_taken = 0  # timed steps done when the current block started
        self.first_step_wall = 0.0  # time.time() when the 2nd forward starts (1 step done)

    def _stamp(self, sync: bool) -> float:
        if sync and self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.calls == 1:
                self.first_step_wall = time.time()
            done = self.calls - self.warmup  # timed steps completed before this forward
            if 0 <= done <= self.steps:
                edge = done % self.block == 0 or done == self.steps
                now = self._stamp(edge)
                if done > 0 and not self.cuda:
                    self.intervals.append(now - self.last)
                if done > 0 and edge:
                    self.blocks.append((now - self.block_start) / (done - self.block_taken))
                if edge and done < self.steps:
                    if self.turn is not None and done > 0:
                        self.turn()
                    now = self._stamp(True)
                    self.block_start, self.block_taken = now, done
                self.last = now
            self.calls += 1
        return self.model(x)

    @property
    def step_time(self) -> float:
        return statistics.median(self._timed_steps())

    @property
    def fast_step_time(self) -> float:
        """On the CPU the 10th percentile step (on a GPU ``step_time``). A small model's
        steps on shared cores fall into a fast and a slow mode whose mixture changes from
        moment to moment, and a median moves with the mixture; work that a step adds shows
        in both modes, and the lowest tenth is in the fast one as long as a tenth of the
        contender's steps are."""
        if self.cuda:
            return self.step_time
        steps = sorted(self._timed_steps())
        return steps[len(steps) // 10]

    def _timed_steps(self) -> list[float]:
        if self.calls <= self.warmup + self.steps:
            raise RuntimeError(f"only {self.calls} training forwards; the clock needs more")
        return self.blocks if self.cuda else self.intervals


def pass_turn() -> None:
    """Give the process to the next contender of ``rotate``; returns at the next turn."""
    from greenlet import getcurrent

    getcurrent().parent.switch()


def rotate(runs: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Run several contenders in this process and thread, taking turns.

    Each run is a greenlet (a coroutine with its own stack on the main thread, so signal
    handlers, OpenMP's thread team and autograd's state are the same for all); a run gives
    up its turn by calling ``pass_turn`` (``Clocked`` does so every ``block`` steps).
    Contenders then share the process's state and the machine's moment equally: on a
    shared machine, fresh processes running the same loop differ by up to 1.5x, which no
    ranking by a few percent survives. Returns each run's return value."""
    from greenlet import greenlet

    lets = {name: greenlet(fn) for name, fn in runs.items()}
    out: dict[str, object] = {}
    while lets:
        for name, let in list(lets.items()):
            value = let.switch()
            if let.dead:
                out[name] = value
                del lets[name]
    return out


def single_process(device: str):
    """dmltrain's ``DistInfo`` for one process on ``device``."""
    from dataclasses import replace

    from dmltrain.runtime.launch import detect

    return replace(detect("single", 1), device=device)


def scratch(name: str) -> str:
    """A new folder for one benchmark's runs, removed when this process exits: the runs'
    checkpoints add up to gigabytes over a few benchmark runs."""
    folder = tempfile.mkdtemp(prefix=f"dmltrain-{name}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(script: Path, args: Sequence[str], env: dict[str, str] | None = None) -> dict:
    """Run ``python script --worker ...`` in a fresh process; its last line is JSON."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=ROOT,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleaved(
    names: Sequence[str], repeats: int, measure: Callable[[str], dict]
) -> dict[str, list[dict]]:
    """``measure`` each name in turn, ``repeats`` rounds (A B C, A B C, ...)."""
    results: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            results[name].append(measure(name))
    return results


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def machine() -> str:
    import platform

    cpus = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpus} CPU cores, {gpu}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.platform(terse=True)}"
    )


def loader_benchmark(description: str, argv: list[str] | None) -> tuple[int, Any]:
    """The loader benchmarks' setting: their rounds (``--quick``: one; else 5), one thread
    here (a worker runs one too), and the bundled MNIST sample's training digits."""
    import argparse

    from dmltrain_experiments import mnist_data

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train, _, _ = mnist_data.load(mnist_data.SAMPLE_DIR, True, "", None)
    return (1 if args.quick else 5), train

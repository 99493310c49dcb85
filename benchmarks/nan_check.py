"""What ``--check-nans`` costs per training step.

    python benchmarks/nan_check.py            # MNIST CNN, batch 64, 150 steps a run, 5 pairs
    python benchmarks/nan_check.py --quick    # 40 steps a run, 2 pairs (a smoke test)

The MNIST CNN on random MNIST-shaped data held in memory, trained by dmltrain with and
without ``--check-nans``, alternated (off, on, off, on, ...) in one process; the time of
the training loop alone (from ``on_train_start`` to ``on_train_end``, no validation) is
divided by the steps. Reported: median time per step of each and their ratio.
Logging off, no checkpoints inside the loop, one process, the device given (default CPU).
"""

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, TrainConfig
from dmltrain.launch import detect
from experiments.mnist import Net


class Timed(BaseTrainer):
    name = "bench"
    steps = 150

    def create_model(self):
        return Net()

    def create_datasets(self):
        g = torch.Generator().manual_seed(0)
        n = self.steps * self.config.batch_size
        x = torch.randn(n, 1, 28, 28, generator=g)
        return TensorDataset(x, torch.randint(0, 10, (n,), generator=g)), None

    def train_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_train_start(self):
        self.started = time.perf_counter()

    def on_train_end(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.loop_time = time.perf_counter() - self.started


def step_time(check: bool, steps: int, device: str, root: Path, rep: int) -> float:
    config = TrainConfig(
        epochs=1,
        batch_size=64,
        check_nans=check,
        progress="off",
        keep_last=1,
        run_dir=str(root / f"{'on' if check else 'off'}-{rep}"),
    )
    dist = detect("single", 1)
    if device != "cpu":
        from dataclasses import replace

        dist = replace(dist, device=device)
    Timed.steps = steps
    trainer = Timed(config, dist=dist)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's banner and epoch line
        trainer.fit()
    return trainer.loop_time / steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    steps, pairs = (40, 2) if args.quick else (150, 5)
    root = Path(tempfile.mkdtemp(prefix="dmltrain-nan-bench-"))
    step_time(False, 5, args.device, root, -1)  # warm-up (allocator, kernels)
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(pairs):
        for check in (False, True):
            times[check].append(step_time(check, steps, args.device, root, rep))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    text = "\n".join(
        [
            f"nan-check: MNIST CNN, batch 64, {steps} steps a run, median of {pairs}, "
            f"alternated, device {args.device}",
            "| run | ms per step | vs unchecked |",
            "|---|---|---|",
            f"| unchecked | {1000 * off:.2f} | 1.000x |",
            f"| --check-nans | {1000 * on:.2f} | {on / off:.3f}x |",
        ]
    )
    print(text, flush=True)
    return {"markdown": text, "ratios": {"nan-check: on / off": on / off}}


if __name__ == "__main__":
    main()

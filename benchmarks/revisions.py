"""The loop's own cost at this tree against an earlier revision: has a change made every
step slower, even with its options off?

    python -m benchmarks.revisions REV [--repeats N] [--settings JSON]

The same script (a 784-10 linear layer, batch 64, in-memory data, 3,000 steps, no
validation, progress and tracking off; the median time between training forwards after
100 steps) runs against REV's dmltrain (a git worktree) and this tree's, in fresh
processes taking turns (REV, this, this again, REV, ...), because separate runs drift
with the machine's load. ``--settings`` are this tree's extra config settings (e.g. the
options a later revision added, off). Reported: each side's median and range over the
repeats, the ratio this / REV, and beside it this tree's second run against its first:
identical code, so its spread is what "not measurable" means on this machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, statistics, sys, tempfile, time
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from dmltrain import BaseTrainer, TrainConfig
times = []
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.last = nn.Linear(784, 10), None
    def forward(self, x):
        if self.training:
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now
        return self.linear(x.flatten(1))
class Bench(BaseTrainer):
    def create_model(self):
        return Model()
    def create_datasets(self):
        g = torch.Generator().manual_seed(0)
        n = 64 * 3000
        return TensorDataset(torch.randn(n, 1, 28, 28, generator=g),
                             torch.randint(0, 10, (n,), generator=g)), None
    def train_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)
with tempfile.TemporaryDirectory() as tmp:
    config = TrainConfig(epochs=1, batch_size=64, progress="off", wandb_mode="disabled",
                         keep_last=1, run_dir=tmp + "/run", **json.loads(sys.argv[1]))
    Bench(config).fit()
print(json.dumps(1e6 * statistics.median(times[100:])))
"""


def step_us(tree: Path, settings: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "disabled"}
    command = [sys.executable, "-c", WORKER, json.dumps(settings)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                          cwd=tempfile.gettempdir())  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--settings", default="{}", help="this tree's extra settings (JSON)")
    args = parser.parse_args(argv)
    settings = json.loads(args.settings)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old),
                        args.rev], check=True)  # fmt: skip
        try:
            rounds = [
                (step_us(old, {}), step_us(ROOT, settings), step_us(ROOT, settings))
                for _ in range(args.repeats)
            ]
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           check=False)  # fmt: skip
    before, after, again = ([r[i] for r in rounds] for i in (0, 1, 2))
    ratios = [b / a for a, b, _ in rounds]
    twins = [c / b for _, b, c in rounds]
    text = "\n".join([
        f"revisions: tiny model, batch 64, 3,000 steps, {args.repeats} fresh processes each in "
        f"turns; this tree with {settings or 'its defaults'}",
        "| tree | us per step (median) | range |",
        "|---|---|---|",
        f"| {args.rev} | {statistics.median(before):.1f} | {min(before):.1f}-{max(before):.1f} |",
        f"| this tree | {statistics.median(after):.1f} | {min(after):.1f}-{max(after):.1f} |",
        f"| this tree again | {statistics.median(again):.1f} | {min(again):.1f}-{max(again):.1f} |",
        f"Ratio this / {args.rev}: median {statistics.median(ratios):.3f}x, range "
        f"{min(ratios):.3f}-{max(ratios):.3f}x; identical runs (this again / this): median "
        f"{statistics.median(twins):.3f}x, range {min(twins):.3f}-{max(twins):.3f}x.",
    ])  # fmt: skip
    print(text, flush=True)
    return {"markdown": text, "ratio": statistics.median(ratios), "twin": statistics.median(twins)}


if __name__ == "__main__":
    main(sys.argv[1:])

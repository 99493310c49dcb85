"""Where in a step dmltrain's cost over the plain loop lands, by phase, on the tiny model.

    python -m benchmarks.overhead_phases                  # 8 processes of 1,200 steps
    python -m benchmarks.overhead_phases --processes 2 --steps 100

``plain``, ``plain-twin`` and ``dmltrain`` train as in ``overhead.py`` (one process,
taking turns of 50 steps: ``common.rotate``). Five clocks cut each step into phases: the
start of the training forward (``common.Clocked``), the optimizer step's global pre- and
post-hooks, and the start and end of the DataLoader's fetch (the samples and their
collate). A step that spans a hand-off is left out. The phases:

- A: forward start to optimizer step start (forward, loss, backward and what the loop
  does between them);
- B: the optimizer step;
- C: optimizer step end to the next fetch (the step's bookkeeping, the loop, the sampler);
- D: the fetch and collate;
- E: fetch end to the next forward (moving the batch, zero_grad).

Each process gives each contender's median of each phase; the table shows, per phase,
the median over processes of (contender - plain). ``plain-twin`` is the resolution.
"""

import argparse
import functools
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = "ABCDE"
NAMES = ["plain", "plain-twin", "dmltrain"]


def worker(order: list[str], steps: int) -> dict:
    """One process: the contenders in turns; each one's median phases, in us."""
    import torch.optim.optimizer as optim
    import torch.utils.data._utils.fetch as fetching

    from benchmarks import overhead
    from benchmarks.common import Clocked, rotate, scratch

    clock, seen = time.perf_counter, {}
    fetch = fetching._MapDatasetFetcher.fetch

    def timed_fetch(self, index):
        seen["f0"] = clock()
        batch = fetch(self, index)
        seen["f1"] = clock()
        return batch

    fetching._MapDatasetFetcher.fetch = timed_fetch  # type: ignore[method-assign]
    optim.register_optimizer_step_pre_hook(lambda *_: seen.__setitem__("o0", clock()))
    optim.register_optimizer_step_post_hook(lambda *_: seen.__setitem__("o1", clock()))
    phases: dict[int, dict[str, list[float]]] = {}
    forward = Clocked.forward

    def clocked_forward(self, x):
        now = clock()
        last = getattr(self, "_phase_start", None)
        if self.training and self.warmup < self.calls <= self.warmup + self.steps and last:
            marks = [last, *(seen.get(k, 0.0) for k in ("o0", "o1", "f0", "f1")), now]
            if all(a < b for a, b in itertools.pairwise(marks)):  # one step, no hand-off
                mine = phases.setdefault(id(self), {p: [] for p in PHASES})
                for p, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True):
                    mine[p].append(b - a)
        out = forward(self, x)
        # a hand-off to another contender happens inside forward: that step is not one
        self._phase_start = now if clock() - now < 0.01 else None
        return out

    Clocked.forward = clocked_forward  # type: ignore[method-assign]
    base = dict(model="tiny", warmup=20, steps=steps, device="cpu", block=50, batch=64)
    folder = scratch("phases")
    runs = {
        name: functools.partial(
            overhead.TRAIN[name],
            argparse.Namespace(**base, precision="fp32", run_dir=f"{folder}/{name}"),
        )
        for name in order
    }
    models = rotate(runs)
    return {
        name: {p: statistics.median(v) * 1e6 for p, v in phases[id(models[name])].items()}
        for name in order
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--worker", default="")
    args = parser.parse_args()
    if args.worker:
        out = worker(args.worker.split(","), args.steps)
        print(json.dumps(out), file=sys.__stdout__, flush=True)
        return
    rows = []
    for i in range(args.processes):
        order = NAMES[i % len(NAMES) :] + NAMES[: i % len(NAMES)]
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.overhead_phases", "--worker", ",".join(order),
             "--steps", str(args.steps)],
            capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
        )  # fmt: skip
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| contender | " + " | ".join(PHASES) + " | sum |")
    print("|---" * (len(PHASES) + 2) + "|")
    plain = {p: statistics.median(r["plain"][p] for r in rows) for p in PHASES}
    print("| plain (us) | " + " | ".join(f"{plain[p]:.1f}" for p in PHASES) + " | |")
    for name in NAMES[1:]:
        diff = {p: statistics.median(r[name][p] - r["plain"][p] for r in rows) for p in PHASES}
        cells = " | ".join(f"{diff[p]:+.1f}" for p in PHASES)
        print(f"| {name} - plain | {cells} | {sum(diff.values()):+.1f} |")


if __name__ == "__main__":
    main()

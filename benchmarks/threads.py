"""The command users type, ``dmltrain mnist --nprocs 2``, with and without the thread share.

    python benchmarks/threads.py            # 4 rounds
    python benchmarks/threads.py --quick    # 1 round

Before ``dmltrain.runtime.threads``, every process took one thread per core of the machine, as
torch does by default: ``--threads <cores>`` does the same. After: the default, each
process's share of the cores. One epoch on the bundled sample (batch 64 per process),
the two in turns in fresh processes; the time is the training log's ``epoch_time_s``
(the epoch with its validation, without start-up), median of the rounds.
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def epoch_time(threads: int, root: Path, name: str, steps: int = 0) -> tuple[float, str]:
    run = root / name
    command = [sys.executable, "-m", "dmltrain", "mnist", "--nprocs", "2", "--epochs", "1",
               "--no-download", "--progress", "off", "--run-dir", str(run),
               "--max-steps", str(steps)]  # fmt: skip
    if threads:
        command += ["--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    with open(run / "training_log.csv") as handle:
        (row,) = csv.DictReader(handle)
    return float(row["epoch_time_s"]), row["val_loss"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--smoke", action="store_true", help="10 steps (a smoke test)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else 4
    cores = len(os.sched_getaffinity(0))
    contenders = {f"before: --threads {cores} (every core each)": cores, "after: default": 0}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    losses: dict[str, set[str]] = {name: set() for name in contenders}
    with tempfile.TemporaryDirectory(prefix="dmltrain-threads-") as tmp:
        for i in range(rounds):
            for n, (name, threads) in enumerate(contenders.items()):
                seconds, loss = epoch_time(threads, Path(tmp), f"run-{i}-{n}", 10 * args.smoke)
                times[name].append(seconds)
                losses[name].add(loss)
    before, after = (statistics.median(times[name]) for name in contenders)
    lines = [
        f"threads: `dmltrain mnist --nprocs 2 --epochs 1` on {cores} CPUs, median of {rounds} "
        "round(s), in turns",
        "| threads per process | epoch time (s) | vs before | final val_loss |",
        "|---|---|---|---|",
    ]
    for name in contenders:
        median = statistics.median(times[name])
        lines.append(f"| {name} | {median:.2f} | {median / before:.2f}x | "
                     f"{', '.join(sorted(losses[name]))} |")  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": {"mnist --nprocs 2 epoch: after / before": after / before}}


if __name__ == "__main__":
    main()

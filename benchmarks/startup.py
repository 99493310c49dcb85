"""Startup: import time, ``dmltrain --help``, and time from process start to the first
optimizer step, against ``import torch`` and the plain loop, with Lightning and Accelerate.

    python benchmarks/startup.py            # 5 rounds
    python benchmarks/startup.py --quick    # 2 rounds

Every command runs in a fresh process, the commands interleaved round by round; reported
is the median wall time. Time to first step: from just before the process is started to
the start of the second training forward (one whole step done), for the MNIST CNN trained
as in ``overhead.py``.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, interleaved, run_worker
from benchmarks.overhead import available, worker_args

COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import dmltrain": ["-c", "import dmltrain"],
    "dmltrain --help": ["-m", "dmltrain", "--help"],
    "dmltrain mnist --help": ["-m", "dmltrain", "mnist", "--help"],
    "import lightning": ["-c", "import lightning"],
    "import accelerate": ["-c", "import accelerate"],
}
FIRST_STEP = ["plain", "dmltrain", "lightning", "accelerate"]


def wall(args: list[str]) -> dict:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True, cwd=ROOT)
    return {"s": time.perf_counter() - started}


def first_step(name: str, run_dir: str) -> dict:
    started = time.time()
    out = run_worker(Path(__file__).with_name("overhead.py"), worker_args(
        name, "cnn", 1, 1, "cpu", run_dir))  # fmt: skip
    return {"s": out["first_step_wall"] - started}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else 5
    commands = {
        k: v
        for k, v in COMMANDS.items()
        if not k.startswith("import ") or available(k.split()[1]) or k.endswith("torch")
    }
    times = interleaved(list(commands), rounds, lambda k: wall(commands[k]))
    import tempfile

    tmp = tempfile.mkdtemp(prefix="dmltrain-startup-")
    counter = iter(range(10**6))
    names = [n for n in FIRST_STEP if available(n)]
    steps = interleaved(names, rounds, lambda n: first_step(n, f"{tmp}/{n}-{next(counter)}"))
    torch_s = statistics.median(r["s"] for r in times["import torch"])
    plain_s = statistics.median(r["s"] for r in steps["plain"])
    lines = [
        f"startup: fresh processes, median of {rounds}, interleaved",
        "| command | seconds | minus `import torch` | vs `import torch` |",
        "|---|---|---|---|",
    ]
    ratios, extra = {}, {}
    for name, rows in times.items():
        s = statistics.median(r["s"] for r in rows)
        lines.append(f"| `{name}` | {s:.2f} | {s - torch_s:+.2f} | {s / torch_s:.2f}x |")
        ratios[f"{name} / import torch"] = s / torch_s
        extra[name] = s - torch_s
    lines += ["", "| time to first step (MNIST CNN) | seconds | vs plain loop |", "|---|---|---|"]
    for name, rows in steps.items():
        s = statistics.median(r["s"] for r in rows)
        lines.append(f"| {name} | {s:.2f} | {s / plain_s:.2f}x |")
        ratios[f"first step {name} / plain"] = s / plain_s
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios, "seconds_over_torch": extra}


if __name__ == "__main__":
    main()

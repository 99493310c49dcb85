"""Startup: import time, ``dmltrain --help``, and time from process start to the first
optimizer step, against ``import torch`` and the plain loop, with Lightning and Accelerate;
and a ``--nprocs 2`` run by how its workers start.

    python benchmarks/startup.py            # 5 rounds
    python benchmarks/startup.py --quick    # 1 round, first step of plain and dmltrain only
    python benchmarks/startup.py --smoke    # that, without the peers' imports

Every command runs in a fresh process, the commands interleaved round by round; reported
is the median wall time. On a shared machine ``import torch`` alone swings by a second
from one process to the next (the files it maps are read anew), which drowns a 0.3 s
target; so each command also runs in a process that imports torch first and times only
what the command adds after that (median of the rounds): that is what the targets on
``import dmltrain`` and ``--help`` are judged by, both figures shown. Time to first step:
from just before the process is started to the start of the second training forward (one
whole step done), for the MNIST CNN trained as in ``overhead.py``. ``--nprocs 2``: the
command ``dmltrain mnist --nprocs 2 --max-steps 1`` from start to end, wall and CPU
seconds (the parent, the fork server and the workers), with each ``--start-method``.
dmltrain's bytecode is compiled first, as ``pip install`` does: where
PYTHONDONTWRITEBYTECODE is set, an editable install would compile it in every process.
"""

import argparse
import compileall
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, interleaved, run_worker, scratch
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
# The same commands after ``import torch`` in one process: prints the seconds they add.
# ``-m`` runs the module as ``python -m`` would (argv, SystemExit and output as there).
AFTER_TORCH = """
import contextlib, os, runpy, sys, time
import torch
started = time.perf_counter()
args = sys.argv[1:]
if args[0] == "-c":
    exec(args[1])
else:
    sys.argv = [args[1], *args[2:]]
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        try:
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
print(time.perf_counter() - started, file=sys.stderr)
"""


def command_times(args: list[str]) -> dict:
    """Wall seconds of ``args`` in a fresh process, and what it adds after ``import torch``."""
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    done = subprocess.run([sys.executable, "-c", AFTER_TORCH, *args], check=True,
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    return {"s": seconds, "after_torch": float(done.stderr.strip().splitlines()[-1])}


def first_step(name: str, run_dir: str) -> dict:
    started = time.time()
    out = run_worker(Path(__file__).with_name("overhead.py"), worker_args(
        name, "cnn", 1, 1, "cpu", run_dir))  # fmt: skip
    return {"s": out["first_step_wall"] - started}


# --start-method of the --nprocs rows; the first is what the others are compared with
START_METHODS = ("spawn", "forkserver")


def nprocs_run(method: str, run_dir: str) -> dict:
    """Wall and CPU seconds of one ``dmltrain mnist --nprocs 2`` step, start to end (the
    CPU of every process it started: each was waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dmltrain", "mnist", "--nprocs", "2", "--max-steps",
                    "1", "--progress", "off", "--start-method", method, "--run-dir", run_dir],
                   check=True, capture_output=True, cwd=ROOT)  # fmt: skip
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"s": seconds, "cpu": cpu}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest size (a smoke test)")
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    compileall.compile_dir(ROOT / "dmltrain", quiet=1)
    rounds = 1 if args.quick else 5
    peers = {"import lightning", "import accelerate"}
    commands = {
        k: v
        for k, v in COMMANDS.items()
        if k not in peers or (available(k.split()[1]) and not args.smoke)
    }
    times = interleaved(list(commands), rounds, lambda k: command_times(commands[k]))
    tmp = scratch("startup")
    counter = iter(range(10**6))
    # quick mode: the target's two (the peers' workers run in overhead's quick mode too)
    wanted = ("plain", "dmltrain") if args.quick else FIRST_STEP
    names = [n for n in FIRST_STEP if available(n) and n in wanted]
    steps = interleaved(names, rounds, lambda n: first_step(n, f"{tmp}/{n}-{next(counter)}"))
    torch_s = statistics.median(r["s"] for r in times["import torch"])
    plain_s = statistics.median(r["s"] for r in steps["plain"])
    lines = [
        f"startup: fresh processes, median of {rounds}, interleaved",
        "| command | seconds | minus `import torch` | vs `import torch` "
        "| added after `import torch` in one process |",
        "|---|---|---|---|---|",
    ]
    ratios, extra, wall_extra = {}, {}, {}
    for name, rows in times.items():
        s = statistics.median(r["s"] for r in rows)
        added = statistics.median(r["after_torch"] for r in rows)
        lines.append(
            f"| `{name}` | {s:.2f} | {s - torch_s:+.2f} | {s / torch_s:.2f}x | {added:+.3f} |"
        )
        ratios[f"{name} / import torch"] = s / torch_s
        extra[name], wall_extra[name] = added, s - torch_s
    lines += ["", "| time to first step (MNIST CNN) | seconds | vs plain loop |", "|---|---|---|"]
    for name, rows in steps.items():
        s = statistics.median(r["s"] for r in rows)
        lines.append(f"| {name} | {s:.2f} | {s / plain_s:.2f}x |")
        ratios[f"first step {name} / plain"] = s / plain_s
    runs = interleaved(
        list(START_METHODS), rounds, lambda m: nprocs_run(m, f"{tmp}/nprocs-{next(counter)}")
    )
    lines += ["", "| `dmltrain mnist --nprocs 2 --max-steps 1` | seconds | CPU seconds "
              f"| vs {START_METHODS[0]} (seconds, CPU) |", "|---|---|---|---|"]  # fmt: skip
    first = {k: statistics.median(r[k] for r in runs[START_METHODS[0]]) for k in ("s", "cpu")}
    for method, rows in runs.items():
        s, cpu = (statistics.median(r[k] for r in rows) for k in ("s", "cpu"))
        lines.append(f"| `--start-method {method}` | {s:.2f} | {cpu:.2f} "
                     f"| {s / first['s']:.2f}x, {cpu / first['cpu']:.2f}x |")  # fmt: skip
        ratios[f"nprocs 2 {method} / {START_METHODS[0]}: seconds"] = s / first["s"]
        ratios[f"nprocs 2 {method} / {START_METHODS[0]}: CPU"] = cpu / first["cpu"]
    text = "\n".join(lines)
    print(text, flush=True)
    return {
        "markdown": text,
        "ratios": ratios,
        "seconds_over_torch": extra,  # same process: what the targets are judged by
        "wall_seconds_over_torch": wall_extra,
    }


if __name__ == "__main__":
    main()

"""The commands users type, timed on this machine's device: ``dmltrain mnist`` in each
precision, with ``--check-nans``, with ``--compile`` (a first job and the job after it),
and on every GPU with DDP and FSDP (NCCL; on the CPU, 2 processes with Gloo).

    python benchmarks/user_runs.py            # 150 steps a run
    python benchmarks/user_runs.py --quick    # 60 steps
    python benchmarks/user_runs.py --smoke    # 8 steps, fp32 and one of each other (tests)

Each run is the bundled MNIST sample (offline: 32 steps an epoch), batch 64, as many
epochs as ``--max-steps`` takes, in a fresh process. Reported: its exit status, the steps
a second at the end of the run (dmltrain's own log line, which times the steps alone) and
the wall time of the command.
The compile rows are one run and the next job of the same run (``--max-steps`` raised),
each with torch's own compile caches empty (a job on a node the run has not been on): the
second job loads the compiled code from the run directory.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT

STEPS_PER_S = re.compile(r"steps_per_s ([0-9.]+)")


def run(args: list[str], run_dir: Path, steps: int, caches: Path | None = None) -> dict:
    """``dmltrain mnist ARGS`` for ``steps`` steps: exit status, steps/s, wall seconds.
    ``caches``: torch's compile caches go there (a new folder: a job on a fresh node)."""
    command = [sys.executable, "-m", "dmltrain", "mnist", "--no-download",
               "--max-steps", str(steps), "--progress", "log", "--log-every", str(steps // 2),
               "--wandb-mode", "disabled", "--run-dir", str(run_dir), *args]  # fmt: skip
    began = time.monotonic()
    env = dict(os.environ)
    if caches is not None:  # no compiled code left by earlier runs in /tmp
        env.update(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                   TRITON_CACHE_DIR=str(caches / "triton"))  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    wall = time.monotonic() - began
    rates = STEPS_PER_S.findall(done.stdout)
    return {
        "status": done.returncode,
        "steps_per_s": float(rates[-1]) if rates else None,
        "wall_s": wall,
        "error": done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr else "",
    }


def plan(smoke: bool) -> dict[str, list[str]]:
    """{row: flags} on this machine."""
    gpus = torch.cuda.device_count()
    rows = {"fp32": [], "bf16": ["--precision", "bf16"], "fp16": ["--precision", "fp16"],
            "fp32 --check-nans": ["--check-nans"],
            "bf16 --check-nans": ["--precision", "bf16", "--check-nans"]}  # fmt: skip
    processes = str(max(gpus, 2) if gpus != 1 else 1)
    precision = "bf16" if gpus else "fp32"
    for strategy in ("ddp", "fsdp"):
        rows[f"{strategy}, {processes} process(es)"] = [
            "--strategy", strategy, "--nprocs", processes, "--precision", precision,
        ]  # fmt: skip
    if smoke:  # one of each kind
        rows = {
            k: v
            for k, v in rows.items()
            if k in ("fp32", "bf16 --check-nans", "ddp, 2 process(es)")
        }
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    steps = 8 if args.smoke else 60 if args.quick else 150
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as runs:
        for row, flags in plan(args.smoke).items():
            found[row] = run(flags, Path(runs) / row.replace(" ", "_"), steps)
        compiled = Path(runs) / "compile"
        # each job with torch's own caches empty, as on a node the run has not been on:
        # only the run directory's compile_cache.bin carries compiled code to the next
        found["--compile, first job"] = run(["--compile"], compiled, steps, Path(runs) / "c1")
        found["--compile, next job"] = run(["--compile"], compiled, 2 * steps, Path(runs) / "c2")
    lines = [
        f"`dmltrain mnist` on {device}, batch 64, {steps} steps a run (the next compile job: "
        f"{steps} more); steps/s from the run's own last log line",
        "| run | exit | steps/s | wall (s) | vs fp32 |",
        "|---|---|---|---|---|",
    ]
    base = found["fp32"]["steps_per_s"]
    for row, got in found.items():
        rate = got["steps_per_s"]
        ratio = f"{base / rate:.3f}x the time" if rate and base else "-"
        shown = f"{rate:.1f}" if rate else "-"
        lines.append(f"| {row} | {got['status']} | {shown} | {got['wall_s']:.1f} | {ratio} |")
    failed = {row: got["error"] for row, got in found.items() if got["status"]}
    lines += [f"\n{row} failed: {error}" for row, error in failed.items()]
    first, second = found["--compile, first job"], found["--compile, next job"]
    return {
        "markdown": "\n".join(lines),
        "runs": found,
        "failed": sorted(failed),
        "compile_next_job_s": second["wall_s"],
        "compile_first_job_s": first["wall_s"],
    }


if __name__ == "__main__":
    print(main()["markdown"])

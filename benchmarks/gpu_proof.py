"""The GPU proof in one command: every ``gpu``-marked test, then the benchmarks a GPU
decides (host reads a step, the overhead table beside Fabric, Accelerate and Lightning on
the tiny model, the MNIST CNN and a ViT-Base in bf16, ``--check-nans``, the commands users
type in fp32, bf16 and fp16, ``--compile`` and its next job, DDP and FSDP over every GPU).
It writes ``benchmarks/RESULTS-gpu.md``: machine, versions, date, each table and target.

    python benchmarks/gpu_proof.py --wheels wheels   # here: the pure-Python wheels it needs
    python benchmarks/gpu_proof.py                   # there, on the GPU machine (not run yet)

A GPU machine has its own torch and Python; it lacks this project's other packages and
reaches no index. So the wheels go with the working tree, and the command there is:

    pip install -q --no-index --no-deps wheels/*.whl && pip install -q --no-index \\
        --no-deps --no-build-isolation -e . && python benchmarks/gpu_proof.py

The tests come first, then each benchmark; the file is written after each part, so a run
cut short keeps what it measured. Without CUDA it says so in one line and exits 2.
"""

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "RESULTS-gpu.md"
BENCHMARKS = "step_counts,overhead,nan_check,user_runs"
# pure Python (or cp312 manylinux) wheels of what the proof imports beyond torch and numpy
# (wandb is imported only when a run tracks with it; matplotlib only for results.png)
WHEELS = [
    "argparse-dataclass", "pyyaml", "tqdm", "pytest", "pluggy",
    "iniconfig", "pytest-timeout", "pytest-xdist", "execnet", "lightning",
    "lightning-utilities", "torchmetrics", "accelerate", "psutil", "safetensors",
    "huggingface-hub", "hf-xet", "fsspec", "packaging", "typing-extensions",
]  # fmt: skip


def download(folder: Path) -> int:
    """The wheels of ``WHEELS`` for the GPU machine's Python 3.12, into ``folder``."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest",
               str(folder), "--only-binary=:all:", "--python-version", "3.12", "--platform",
               "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", *WHEELS]  # fmt: skip
    return subprocess.run(command).returncode


def gpu_tests() -> str:
    """Every ``gpu``-marked test: pytest's summary line and its failures."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "--timeout", "240", "tests"]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = lines[-1] if lines else done.stderr.strip()[-500:]
    return "\n".join(
        [f"`pytest -m gpu tests` ({time.monotonic() - began:.0f} s): {summary}", "", *failed]
    )


def api_calls(device: str, steps: int = 50) -> str:
    """Where the tiny model's step spends its host time beyond the plain loop's: the
    device runtime's calls (``cuda*``; on the CPU none) and the operators, per step, of the
    plain loop and of dmltrain, each profiled over ``steps`` steps after 10."""
    import argparse as ap
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from benchmarks import overhead

    found: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as runs:
        for name in ("plain", "dmltrain"):
            args = ap.Namespace(model="tiny", warmup=10, steps=steps, device=device, block=0,
                                batch=64, run_dir=f"{runs}/{name}", precision="fp32")  # fmt: skip
            activities = [ProfilerActivity.CPU]
            if device.startswith("cuda"):
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities) as prof:
                overhead.TRAIN[name](args)
            # a whole run: its setup and end are in it too, the same for every step count
            found[name] = {e.key: e.count / (steps + 10) for e in prof.key_averages()}
    keys = sorted(set(found["plain"]) | set(found["dmltrain"]),
                  key=lambda k: found["plain"].get(k, 0) - found["dmltrain"].get(k, 0))  # fmt: skip
    lines = [
        f"The tiny model's run on {device}, profiled: calls per step (a whole run of "
        f"{steps + 10} steps, its setup included), where dmltrain makes more than the plain loop",
        "| call | plain loop | dmltrain |",
        "|---|---|---|",
    ]
    for key in keys:
        mine, theirs = found["dmltrain"].get(key, 0.0), found["plain"].get(key, 0.0)
        if mine - theirs >= 0.5:  # at least one call every other step
            lines.append(f"| {key} | {theirs:.1f} | {mine:.1f} |")
    return "\n".join(lines)


def machine() -> str:
    import platform

    import torch

    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return (
        f"{gpus}; torch {torch.__version__} (CUDA {torch.version.cuda}), Python "
        f"{platform.python_version()}, {platform.platform()}; {datetime.date.today()}"
    )


def write(parts: list[str]) -> None:
    OUT.write_text("\n\n".join(["# The GPU proof", *parts]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="download the wheels it needs there")
    args = parser.parse_args(argv)
    if args.wheels:
        return download(args.wheels)
    import torch

    if not torch.cuda.is_available():
        print("gpu_proof: no CUDA device here: run it on a GPU machine", file=sys.stderr)
        return 2
    began = time.monotonic()
    parts = [f"Written by `python benchmarks/gpu_proof.py`. Machine: {machine()}."]
    write(parts)
    parts += ["## gpu tests", gpu_tests()]
    write(parts)
    parts += ["## the tiny model's step: calls beyond the plain loop's", api_calls("cuda")]
    write(parts)
    scratch = ROOT / "build" / "gpu-proof"
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--only", BENCHMARKS,
               "--out", str(scratch)]  # fmt: skip
    subprocess.run(command, cwd=ROOT)
    results = scratch / "RESULTS.md"
    if results.is_file():  # its targets, then each table
        parts.append(results.read_text().split("\n", 1)[1].strip())
    parts.append(f"The whole proof took {time.monotonic() - began:.0f} s.")
    write(parts)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Startup diagnostics: what ran where, with which versions and settings.

At start every rank reports its host and device (one gather); rank 0 prints a compact
block and writes ``diagnostics.json`` into the run directory with: the ranks, world size,
launcher, strategy and backend, torch / CUDA / cuDNN / NCCL / Horovod / MPI / Python
versions, the git commit and dirty state of the experiment's code, the command line, the
resolved config and the relevant environment (``SLURM_*``, ``PBS_*``, ``MASTER_*``,
``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, ...; values of names with KEY, TOKEN, PASSWORD,
SECRET or CREDENTIAL in them redacted by ``dmltrain.runtime.launch``).
"""

import importlib.metadata
import inspect
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from dmltrain.runtime.launch import DistInfo, RunEnvironment, hostname
from dmltrain.runtime.threads import starved


def this_rank(dist: DistInfo, environment: RunEnvironment) -> dict[str, Any]:
    """What every rank reports at start (its CPUs too: ``dmltrain.runtime.threads`` reads them)."""
    device = torch.device(dist.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "rank": dist.rank,
        "local_rank": dist.local_rank,
        "node_rank": dist.node_rank,
        "host": hostname(),
        "device": dist.device,
        "device_name": name or platform.machine(),
        "cpus": list(environment.cpus),
        "cores": environment.cores,
        "omp_num_threads": environment.omp_num_threads,
        "cpus_per_task": environment.cpus_per_task,
    }


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_line_of(command: list[str]) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else None


def versions() -> dict[str, str | None]:
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None if cudnn is None else str(cudnn),
        "nccl": nccl,
        "horovod": package_version("horovod"),
        "mpi": _first_line_of(["mpirun", "--version"]),
        "dmltrain": package_version("dmltrain"),
        "wandb": package_version("wandb"),
    }


def git_state(path: Path) -> dict[str, Any]:
    """Commit and dirty state of the git checkout holding ``path`` (None outside one)."""
    directory = path if path.is_dir() else path.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"path": str(directory), "commit": None, "dirty": None}
    return {"path": str(directory), "commit": commit, "dirty": bool(git("status", "--porcelain"))}


def command_line() -> list[str]:
    program = Path(sys.argv[0])
    if program.name == "__main__.py":  # python -m <package>
        return ["python", "-m", program.parent.name, *sys.argv[1:]]
    return [program.name, *sys.argv[1:]]


def collect(
    ranks: list[dict[str, Any]],
    dist: DistInfo,
    strategy: str,
    backend: str,
    trainer_cls: type,
    config: dict[str, Any],
    environment: RunEnvironment,
) -> dict[str, Any]:
    """Everything ``diagnostics.json`` holds; the code's git state is that of the file
    defining ``trainer_cls`` (of the working directory for a notebook's class)."""
    try:
        code = Path(inspect.getfile(trainer_cls))
    except (TypeError, OSError):  # defined in a notebook or an interactive session
        code = Path.cwd()
    return {
        "world_size": dist.world_size,
        "launcher": dist.launcher,
        "strategy": strategy,
        "backend": backend,
        "job_id": dist.job_id,
        "ranks": ranks,
        "versions": versions(),
        "code": git_state(code),
        "command": command_line(),
        "config": config,
        "environment": dict(environment.variables),
    }


def _length(dataset: Any) -> int | None:
    """A dataset's size; None for a stream that does not say."""
    try:
        return len(dataset)
    except TypeError:
        return None


def training(
    model: Any,
    train: Any,
    val: Any,
    loop: Any,
    world_size: int,
    precision: str,
    steps_per_epoch: int | None,
) -> dict[str, Any]:
    """What the run trains: the model's parameters (all of them, sharded or not), the
    datasets' sizes (``train``, ``val``: the data loaders), the steps of an epoch and the
    global batch (``loop``: the config's loop section)."""
    params = list(model.parameters())
    return {
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "train_samples": _length(train.dataset),
        "val_samples": None if val is None else (_length(val.dataset) or "stream"),
        "steps_per_epoch": steps_per_epoch,
        "batch_size": loop.batch_size,
        "grad_accum": loop.grad_accum,
        "global_batch": loop.batch_size * loop.grad_accum * world_size,
        "precision": precision,
    }


def _count(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000 or unit == "B":
            return f"{n:.3g}{unit}" if unit else str(int(n))
        n /= 1000
    return str(n)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def summary(info: dict[str, Any], path: Path) -> str:
    """The compact block printed at start (the full config is in config.yaml)."""
    hosts: dict[str, list[str]] = {}
    for rank in info["ranks"]:
        hosts.setdefault(rank["host"], []).append(rank["device"])
    where = "; ".join(f"{host}: {', '.join(devices)}" for host, devices in hosts.items())
    threads = sorted({(r["threads"], r["threads_why"]) for r in info["ranks"] if "threads" in r})
    if threads:
        where += "; CPU threads per process: " + ", ".join(f"{n} ({why})" for n, why in threads)
        workers = sorted({r["workers"] for r in info["ranks"]})
        where += "; loader workers: " + ", ".join(str(n) for n in workers)
    v = info["versions"]
    shown = ", ".join(
        f"{name} {v[key]}"
        for name, key in (
            ("torch", "torch"),
            ("CUDA", "cuda"),
            ("cuDNN", "cudnn"),
            ("NCCL", "nccl"),
            ("Horovod", "horovod"),
            ("MPI", "mpi"),
            ("Python", "python"),
        )
        if v[key]
    )
    code = info["code"]
    state = "(not in git)" if code["commit"] is None else f"at {code['commit'][:12]}"
    if code["dirty"]:
        state += " (uncommitted changes)"
    lines = []
    t = info.get("training")
    if t:
        train = "a stream of" if t["train_samples"] is None else f"{t['train_samples']:,}"
        val = {None: "no", "stream": "a stream of"}.get(t["val_samples"]) or f"{t['val_samples']:,}"
        steps = t["steps_per_epoch"]
        steps = "until the stream ends:" if steps is None else f"{steps:,}"
        accum = f" x {t['grad_accum']} accumulated" if t["grad_accum"] > 1 else ""
        lines += [
            f"dmltrain: model {t['model']}: {_count(t['trainable'])} trainable of "
            f"{_count(t['parameters'])} parameters ({_bytes(t['parameter_bytes'])}), "
            f"precision {t['precision']}",
            f"dmltrain: data {train} training and {val} validation samples; "
            f"{steps} steps an epoch of global batch {t['global_batch']:,} "
            f"({info['world_size']} process(es) x {t['batch_size']}{accum})",
        ]
    return "\n".join(
        [
            *lines,
            f"dmltrain: {info['world_size']} process(es), launcher {info['launcher']}, "
            f"strategy {info['strategy']}, backend {info['backend']}",
            f"dmltrain: {where}",
            f"dmltrain: {shown}",
            f"dmltrain: code {code['path']} {state}; details in {path}",
            *([f"dmltrain: warning: {few}"] if (few := starved(info["ranks"])) else []),
        ]
    )


def job_tags(info: dict[str, Any]) -> dict[str, str]:
    """What a tracker tags this job with, from ``collect``'s record (text values)."""
    code = info.get("code") or {}
    tags = {
        "job_id": info.get("job_id"),
        "world_size": info.get("world_size"),
        "launcher": info.get("launcher"),
        "code_commit": code.get("commit"),
    }
    return {key: str(value) for key, value in tags.items() if value is not None}

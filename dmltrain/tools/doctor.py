"""``dmltrain doctor``: is this environment ready to train? A pass/fail table with fixes.

Checks: torch and CUDA, the collective backends torch has (NCCL, Gloo, MPI), Horovod and
what it was built with, wandb and its login, and a real all-reduce with each usable
backend: between 2 local processes started here, or, when started by a launcher with
several processes (``srun -N2 --ntasks-per-node=4 dmltrain doctor``), between all of them,
so a multi-node allocation is checked end to end (rank 0 prints the table).

Required (exit status 1 when one fails): torch, Gloo and its all-reduce; with ``--gpu``
also CUDA, NCCL and the NCCL all-reduce; with ``--horovod`` Horovod; with ``--wandb``
a wandb login. Anything else that is missing is reported with its fix but is not fatal.
"""

import argparse
import datetime
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dmltrain.errors import UserError, first_line
from dmltrain.runtime import launch, preflight, processes


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    @property
    def status(self) -> str:
        return "PASS" if self.ok else ("FAIL" if self.required else "MISSING")


def _all_reduce(
    rank: int, world: int, backend: str, addr: str, port: int, device: str, share: Any = None
) -> tuple[float, list[Any]]:
    """The sum over ranks of rank+1, after the checks across hosts
    (``dmltrain.runtime.preflight``), and every rank's ``share``."""
    interface = launch.run_environment().socket_interface is not None
    store = preflight.rendezvous(rank, world, addr, port, 60, interface)
    timeout = datetime.timedelta(seconds=60)
    launch.lazy_gloo_connections()  # as a training run connects
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        shared: list[Any] = [None] * world
        dist.all_gather_object(shared, share)
        return float(value.item()), shared
    finally:
        dist.destroy_process_group()


def _local_worker(rank: int, backend: str, port: int, results: Any) -> None:
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    results[rank] = _all_reduce(rank, 2, backend, "127.0.0.1", port, device)[0]


def all_reduce_check(
    backend: str,
    info: launch.DistInfo,
    required: bool,
    port_offset: int = 1,
    started: float = 0.0,
    starts: list[Any] | None = None,
) -> Check:
    """All-reduce of rank+1 over every process: the sum must be w(w+1)/2. Under a
    launcher, at the launcher's port + ``port_offset``: each check its own port, so that
    a fast rank of the next check never reaches the store of the one before it. Every
    rank's (host, ``started``: its start-up seconds) are appended to ``starts``."""
    world = info.world_size if info.distributed else 2
    where = f"{world} processes" + ("" if info.distributed else " on this node")
    expected = world * (world + 1) / 2
    try:
        if info.distributed:
            device = info.device if backend == "nccl" else "cpu"
            if backend == "nccl":
                torch.cuda.set_device(torch.device(device))
            port = info.master_port + port_offset  # beside the launcher's, never the same
            share = (launch.hostname(), started)
            got, shared = _all_reduce(
                info.rank, world, backend, info.master_addr, port, device, share
            )
            if starts is not None:
                starts.extend(shared)
        else:
            context = torch.multiprocessing.get_context("spawn")
            results = context.Manager().dict()
            torch.multiprocessing.start_processes(
                _local_worker,
                args=(backend, launch.free_port(), results),
                nprocs=2,
                join=True,
                start_method="spawn",
            )
            values = set(results.values())  # every rank must hold the same sum
            got = values.pop() if len(values) == 1 else float("nan")
    except Exception as exc:
        return Check(
            f"{backend} all-reduce",
            False,
            f"{where}: {first_line(exc, None if isinstance(exc, UserError) else 150)}",
            "check the network between nodes (MASTER_ADDR reachable, firewall), "
            f"and {'NCCL_DEBUG=INFO' if backend == 'nccl' else 'GLOO_SOCKET_IFNAME'}",
            required,
        )
    ok = got == expected
    return Check(f"{backend} all-reduce", ok, f"{where}: sum {got:g} (expected {expected:g})")


def _started_seconds_ago() -> float:
    """Seconds since this process started (Linux's /proc; 0 elsewhere): the interpreter
    and the imports of torch and dmltrain, which a shared file system read by every rank
    at once can make minutes."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


SLOW_START = 60.0  # seconds: worth staging the environment on the nodes


def start_up_check(started: float, starts: list[Any]) -> Check:
    """How long the processes took to start (``started`` here; ``starts``: every rank's
    host and seconds), by node: the slowest rank of each."""
    if not starts:
        detail = f"{started:.1f} s from this process's start to here (Python, torch, dmltrain)"
        slowest = started
    else:
        nodes: dict[str, float] = {}
        for host, seconds in starts:
            nodes[host] = max(seconds, nodes.get(host, 0.0))
        ranked = sorted(nodes.items(), key=lambda item: item[1])
        (fast, fastest), (slow, slowest) = ranked[0], ranked[-1]
        detail = (
            f"slowest node {slow} {slowest:.1f} s, fastest {fast} {fastest:.1f} s, over "
            f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} (Python, torch, dmltrain)"
        )
    if slowest > SLOW_START:
        detail += "; slow: stage the environment on the nodes (docs/launching.md)"
    return Check("start-up", True, detail)


def checks(args: argparse.Namespace, info: launch.DistInfo, started: float = 0.0) -> list[Check]:
    """``started``: seconds from this process's start to the checks."""
    out = [Check("torch", True, f"{torch.__version__} (Python {_python()})")]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out.append(
        Check(
            "CUDA",
            gpus > 0,
            f"{gpus} GPU(s), CUDA {torch.version.cuda}" if gpus else "no GPU visible",
            "install a CUDA build of torch (environment/create_env.sh) and check "
            "CUDA_VISIBLE_DEVICES and the driver (nvidia-smi)",
            args.gpu,
        )
    )
    nccl = dist.is_nccl_available() and gpus > 0
    out.append(
        Check(
            "NCCL backend",
            nccl,
            "available" if nccl else "not available (needs CUDA GPUs and a CUDA torch)",
            "train with --backend gloo on CPUs, or install a CUDA build of torch",
            args.gpu,
        )
    )
    out.append(
        Check(
            "Gloo backend",
            dist.is_gloo_available(),
            "available" if dist.is_gloo_available() else "not available",
            "reinstall torch (the PyPI wheels include Gloo)",
        )
    )
    mpi = dist.is_mpi_available()
    out.append(
        Check(
            "MPI backend",
            mpi,
            "available" if mpi else "not in this torch (the PyPI wheels have none)",
            "use --strategy horovod (Horovod over MPI), or Gloo/NCCL under mpirun",
            False,
        )
    )
    horovod = _horovod(args.horovod)
    out.append(horovod)
    out.append(_wandb(args.wandb, launch.run_environment()))
    starts: list[Any] = []
    out.append(all_reduce_check("gloo", info, True, started=started, starts=starts))
    out.append(start_up_check(started, starts))
    if nccl and (info.distributed or gpus >= 2):
        out.append(all_reduce_check("nccl", info, args.gpu, port_offset=2))
    if horovod.ok and not info.distributed:
        out.append(_horovod_all_reduce(args.horovod))
    return out


HOROVOD_ALL_REDUCE = (
    "import torch, horovod.torch as hvd; hvd.init(); "
    "print('sum', hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item())"
)


def _horovod_all_reduce(required: bool) -> Check:
    """2 processes under ``horovodrun`` (its Gloo controller) on this node."""
    import shutil
    import subprocess
    import sys

    name = "horovod all-reduce"
    if shutil.which("horovodrun") is None:
        return Check(name, False, "horovodrun is not on PATH", "reinstall Horovod", required)
    command = ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2"]
    command += [sys.executable, "-c", HOROVOD_ALL_REDUCE]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return Check(name, False, "no answer in 120 s", "run horovodrun --check-build", required)
    sums = [line.split()[-1] for line in done.stdout.splitlines() if "sum " in line]
    ok = done.returncode == 0 and sums == ["3.0", "3.0"]
    detail = "2 processes on this node (horovodrun --gloo): " + (
        "sum 3 (expected 3)" if ok else f"exit {done.returncode}, got {sums or 'nothing'}"
    )
    return Check(name, ok, detail, "run horovodrun --check-build and see its output", required)


def _python() -> str:
    import platform

    return platform.python_version()


def _horovod(required: bool) -> Check:
    try:
        import horovod.torch as hvd
    except Exception as exc:
        return Check(
            "Horovod",
            False,
            f"not importable ({first_line(exc, 100)})",
            "pip install 'dmltrain[horovod]' (see environment/install_horovod.sh for flags)",
            required,
        )
    built = {
        "controllers": [n for n in ("mpi", "gloo") if getattr(hvd, f"{n}_built")()],
        "operations": [n for n in ("nccl", "mpi", "gloo") if getattr(hvd, f"{n}_built")()],
    }
    version = importlib.metadata.version("horovod")
    detail = (
        f"{version}: framework PyTorch, controllers {', '.join(built['controllers'])}, "
        f"operations {', '.join(built['operations'])}"
    )
    return Check("Horovod", True, detail)


def _wandb(required: bool, environment: launch.RunEnvironment) -> Check:
    try:
        import wandb
        from wandb.sdk.lib import wbauth
    except ImportError:
        return Check("wandb", False, "not installed", "pip install wandb", required)
    logged_in = environment.wandb_key_set
    if not logged_in:
        try:
            logged_in = bool(wbauth.read_netrc_auth(host=environment.wandb_host))
        except Exception:
            logged_in = False
    return Check(
        "wandb",
        logged_in,
        f"{wandb.__version__}, " + ("logged in" if logged_in else "not logged in"),
        "wandb login (or set WANDB_API_KEY); offline runs need no login",
        required,
    )


def table(results: list[Check]) -> str:
    width = max(len(c.name) for c in results)
    lines = [f"{'check'.ljust(width)}  status   detail"]
    for c in results:
        lines.append(f"{c.name.ljust(width)}  {c.status.ljust(7)}  {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{''.ljust(width)}  {'fix:'.ljust(7)}  {c.fix}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", action="store_true", help="require CUDA, NCCL and its all-reduce")
    parser.add_argument("--horovod", action="store_true", help="require Horovod")
    parser.add_argument("--wandb", action="store_true", help="require a wandb login")


def run(args: argparse.Namespace) -> int:
    started = _started_seconds_ago()  # before the checks' own imports (wandb, horovod)
    info = launch.detect("auto", 1)
    results = checks(args, info, started)
    failed = [c.name for c in results if c.required and not c.ok]
    if info.is_main:
        hosts = f" ({info.world_size} processes)" if info.distributed else ""
        print(f"dmltrain doctor on {launch.hostname()}{hosts}\n{table(results)}")
        verdict = f"FAILED: {', '.join(failed)}" if failed else "all required checks passed"
        print(f"dmltrain doctor: {verdict}")
    if processes.started_by_launcher(info):
        processes.leave(1 if failed else 0)  # past a Gloo group, as a training run does
    return 1 if failed else 0

"""What the tests share: running dmltrain as a user would (a subprocess with a clean
environment), starting ranks by hand, tools the suite needs, and comparing two runs.

Fixtures are in conftest.py; tests import everything else from here."""

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from zygote import Zygote

from dmltrain.checkpoint.storage import load_file
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SAMPLE = ROOT / "experiments" / "mnist_sample"


def run_of(trainer):
    """The run a trainer holds (``engine.run.Run``), for tests that look at its parts."""
    return trainer._BaseTrainer__run


def readme_experiment(folder: Path) -> Path:
    """The README's complete experiment (experiment ``line``), written to
    ``folder/my_experiment.py`` as a user would save it: a file, not an installed package."""
    readme = (ROOT / "README.md").read_text()
    part = readme.split("## A complete experiment", 1)[1]
    path = folder / "my_experiment.py"
    path.write_text(re.search(r"```python\n(.*?)```", part, re.S).group(1))
    return path


def cli_env(gpus: bool = False, **extra: str) -> dict[str, str]:
    """The environment for a dmltrain subprocess: tests/ importable, no batch-system ids,
    and no GPUs unless asked for (the mechanics tests run on the CPU with Gloo, as in CI)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.pop("MASTER_PORT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@functools.cache
def _zygote() -> Zygote:
    """This test process's zygote (its interpreter starts at the first run it forks)."""
    return Zygote(cli_env(), ROOT)


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, gpus: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """``python -m dmltrain ARGS`` in a process of its own; its exit status and output.
    Forked from this test process's zygote (tests/zygote.py: torch already imported) where
    nothing read at interpreter start differs, else a fresh interpreter."""
    run_env = cli_env(gpus, **env)
    done = _zygote().run(list(args), cwd, run_env, timeout)
    return done if done is not None else run_fresh(args, cwd, run_env, timeout)


def run_fresh(
    args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m dmltrain ARGS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "dmltrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def signal_at_line(
    args: list[str],
    line: str,
    name: str,
    cwd: Path,
    timeout: float = 300,
    group: bool = False,
    **env: str,
) -> tuple[int, str]:
    """Run ``dmltrain ARGS`` (``env`` added to its environment) and send it signal ``name``
    when it prints a line containing ``line`` (a progress line); its exit status and
    stderr. ``group``: to every process of the run (started in a process group of its
    own), as a terminal's Ctrl-C and a scheduler's signal to a job step reach them."""
    proc = subprocess.Popen([sys.executable, "-m", "dmltrain", *args], cwd=cwd, env=cli_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=group)  # fmt: skip
    assert proc.stdout is not None
    for out in proc.stdout:
        if line in out:
            if group:
                os.killpg(proc.pid, getattr(signal, name))
            else:
                proc.send_signal(getattr(signal, name))
            break
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def start_ranks(command: list[str], cwd: Path, world_size: int = 2) -> list[subprocess.Popen]:
    """Start ``world_size`` processes of ``command`` as ranks of one job with no launcher
    (the variables torchrun would set), each with its own pipes, so a test sees every
    rank's exit status."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = cli_env(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


# tests/run.sh sets this: there a missing component fails the suite instead of skipping.
REQUIRE_ALL = os.environ.get("DMLTRAIN_TEST_REQUIRE_ALL") == "1"
# Ranks agree on a signal at every step, so a signal sent at step N stops the run at step N
# (by default they agree about every half second: a test run would end first).
AT_ONCE = ("--preempt-check-seconds", "0")


def sigint_at_default() -> None:
    """``preexec_fn`` of a child that must answer Ctrl-C as from a terminal: a suite started
    in the background (``&``) ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# 2 ranks under OpenMPI, as root and on fewer cores than ranks (this machine, CI).
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]


def own_port() -> dict[str, str]:
    """MASTER_PORT for a launcher whose ranks would otherwise meet on the fixed default port
    (mpirun, horovodrun, a PBS script): tests run side by side (pytest-xdist), and two such
    jobs on one port would meet each other."""
    return {"MASTER_PORT": str(free_port())}


def require(tool: str) -> None:
    """Skip (plain pytest) or fail (tests/run.sh) when a command-line tool is missing."""
    if shutil.which(tool) is None:
        message = f"{tool} is not installed; tests/run.sh installs it"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)


def log_numbers(run: Path) -> list[dict[str, float]]:
    """The training log without its wall-clock and world-size columns."""
    rows = read_training_log(run / "training_log.csv")
    return [{k: v for k, v in row.items() if k not in ("epoch_time_s", "world_size")}
            for row in rows]  # fmt: skip


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The run's final_weights.pt (tiny's --save-weights), else its latest checkpoint's model."""
    if (run / "final_weights.pt").is_file():
        return torch.load(run / "final_weights.pt", weights_only=True)
    from dmltrain.checkpoint.storage import load_file

    return load_file(run / "checkpoints" / "latest.pt")["model"]


def assert_same_run(run_a: Path, run_b: Path, rel: float = 0.0) -> None:
    """Same final weights and training-log numbers: bitwise when rel is 0, else within
    ``rel`` relative."""
    a, b = log_numbers(run_a), log_numbers(run_b)
    wa, wb = final_weights(run_a), final_weights(run_b)
    assert len(a) == len(b) and list(wa) == list(wb)
    if rel == 0.0:
        assert a == b
        for key in wa:
            assert torch.equal(wa[key], wb[key]), key
        return
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a == pytest.approx(row_b, rel=rel)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=rel, atol=rel)


# The tiny experiment's runs (tests/tiny.py), in one place: 3 epochs of 12 steps that save
# their final weights. A test adds what it needs; a flag given again later wins.
TINY = ["tiny", "--epochs", "3", "--batch-size", "8", "--save-weights", "--progress", "off"]
RANDOM = ["--dropout", "0.2", "--augment"]  # random numbers in the step and in the data
LOGGED = ["--progress", "log", "--log-every", "1"]  # a line per step, to wait for
# What the Slurm and PBS jobs run, and what tiny_reference runs uninterrupted.
TINY_RUN = [*TINY, *LOGGED, *RANDOM]


# ----- Slurm jobs (test_slurm, test_two_nodes) -------------------------------------------
def sbatch(
    cwd: Path,
    *args: str,
    options: tuple[str, ...] = (),
    script: str = str(ROOT / "slurm" / "run.sh"),
    env: dict[str, str] | None = None,
) -> str:
    """Submit ``script`` with 2 tasks of 1 CPU (``options`` come later and win); ``env``
    adds to the job's environment (``SLURM_CONF`` aims it at another cluster)."""
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--ntasks-per-node",
            "2",
            "--cpus-per-task",
            "1",
            "--time",
            "10",
            "--output",
            str(cwd / "job.out"),
            *options,
            script,
            *args,
        ],
        cwd=cwd,
        env=cli_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_field(job: str, name: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}).stdout  # fmt: skip
    match = re.search(rf"\b{name}=(\S+)", out)
    return match.group(1) if match else ""


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def release_requeues_until_done(
    job: str,
    cwd: Path,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    release: bool = True,
) -> None:
    """A requeued job waits (BeginTime) before it restarts; start it at once, as an admin
    would (unless not ``release``: then it starts when Slurm starts it), until the job
    completes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(job, "JobState", env)
        if state == "COMPLETED":
            return
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if release and state == "PENDING" and job_field(job, "Reason", env) == "BeginTime":
            # Released at once, Slurm may restart the job before its last run has finished
            # completing and kill it ("Job credential revoked"); an admin waits a moment.
            time.sleep(5)
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"],
                           env={**os.environ, **(env or {})})  # fmt: skip
        time.sleep(1)
    log = (cwd / "job.out").read_text() if (cwd / "job.out").exists() else ""
    raise AssertionError(f"job {job} ended {job_field(job, 'JobState', env)}:\n{log[-3000:]}")


class Counted:
    """A store client that counts the requests it sends (set, get, add, check...)."""

    REQUESTS = frozenset(("set", "get", "add", "check", "multi_get", "multi_set", "wait",
                          "compare_set"))  # fmt: skip

    def __init__(self, store) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        self.requests += name in self.REQUESTS
        return getattr(self.store, name)


def tensorboard_scalars(run) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of RUN_DIR/tensorboard as TensorBoard reads it (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}  # fmt: skip


def assert_same_mnist(run_a, run_b):
    """The same training log numbers and, bitwise, the same final weights."""
    assert log_numbers(run_a) == log_numbers(run_b)
    a = load_file(run_a / "checkpoints" / "latest.pt")["model"]
    b = load_file(run_b / "checkpoints" / "latest.pt")["model"]
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def pbs_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    require("mpiexec")
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\n" * 2)  # select=1:mpiprocs=2
    path = f"{TESTS / 'cluster'}{os.pathsep}{os.environ['PATH']}"  # the fake qsub
    return cli_env(
        PATH=path,
        FAKE_PBS_NODEFILE=str(nodefile),
        FAKE_PBS_COUNTER=str(tmp_path / "counter"),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        **{**own_port(), **extra},
    )


ZARR_STEPS, ZARR_SHAPE = 43, (2, 3, 4)  # make_store's (time, (level, lat, lon))


ARCHIVE_LEVELS, ARCHIVE_GRID = (500, 850, 1000), (3, 4)


def make_archive(path: Path, steps: int = 50, chunk: int = 7) -> Path:
    """An ERA5-like archive written by xarray, zarr or netCDF by ``path``'s suffix: t and u
    on 3 levels, t2m, static lsm and orography; 6-hourly from 2000-01-01, chunks of
    ``chunk`` steps. Values say where they are: 1000 t + 10 level + cell / 100, u 0.5 and
    t2m 5 above t; lsm 0 and 1, orography 10 cell."""
    import numpy as np
    import pandas as pd
    import xarray as xr

    cells = np.arange(np.prod(ARCHIVE_GRID)).reshape(ARCHIVE_GRID) / 100
    t = 1000 * np.arange(steps)[:, None, None, None] + 10 * np.arange(3)[:, None, None] + cells
    grid, levels = ("lat", "lon"), ("time", "level", "lat", "lon")
    data = xr.Dataset(
        {
            "t": (levels, t.astype("f4")),
            "u": (levels, (t + 0.5).astype("f4")),
            "t2m": (("time", *grid), (t[:, 0] + 5).astype("f4")),
            "lsm": (grid, (np.arange(12).reshape(ARCHIVE_GRID) % 2).astype("f4")),
            "orography": (grid, (1000 * cells).astype("f4")),
        },
        coords={
            "time": pd.date_range("2000-01-01", periods=steps, freq="6h"),
            "level": list(ARCHIVE_LEVELS),
        },
    )
    chunks = {"t": (chunk, 3, *ARCHIVE_GRID), "u": (chunk, 3, *ARCHIVE_GRID),
              "t2m": (chunk, *ARCHIVE_GRID)}  # fmt: skip
    if path.suffix == ".zarr":
        encoding = {k: {"chunks": c} for k, c in chunks.items()}
        data.to_zarr(path, mode="w", encoding=encoding, consolidated=False)
    else:
        encoding = {k: {"chunksizes": c} for k, c in chunks.items()}
        data.to_netcdf(path, engine="h5netcdf", encoding=encoding)
    return path


def make_store(path: Path) -> Path:
    """A zarr store of two variables, t2m and u10, whose values say their time step
    (1000 t + position, u10 0.5 above t2m)."""
    import numpy as np
    import zarr

    group = zarr.open_group(path, mode="w")
    cells = np.arange(np.prod(ZARR_SHAPE)).reshape(ZARR_SHAPE) / 100
    for offset, name in ((0, "t2m"), (0.5, "u10")):
        shape, chunks = (ZARR_STEPS, *ZARR_SHAPE), (1, *ZARR_SHAPE)
        array = group.create_array(name, shape=shape, chunks=chunks, dtype="f4")
        array[:] = np.stack([1000 * t + cells + offset for t in range(ZARR_STEPS)])
    return path

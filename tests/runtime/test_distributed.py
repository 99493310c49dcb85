"""Real processes under every launcher that runs here: self-spawn, torchrun, srun on a
local Slurm cluster, mpirun, horovodrun (Gloo and MPI controllers). Gloo on the CPU.

Equivalence (README, "Batch size and equivalence"): with the same seed and global batch,
every 2-process run writes the same training log and final weights, bitwise for the
Gloo-based launchers and within 1e-6 relative for Horovod; a 1-process run with twice the
per-process batch matches within 1e-5 relative.

Every run also validates a torchmetrics RMSE (``--exact-rmse``) over 33 samples, so two
ranks hold uneven shards (17 and 16; FSDP pads one to 17): each launcher's reduction of the
metric's states (torch.distributed's gather, Horovod's allgather) gives the same val_rmse.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    MPIRUN,
    TINY,
    assert_same_run,
    cli_env,
    own_port,
    require,
    run_cli,
    start_ranks,
)

from dmltrain.errors import UserError
from dmltrain.records.files import read_status_record
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime.launch import free_port
from tiny import TinyOptions, TinyTrainer, tiny_data

ARGS = [*TINY, "--progress", "log", "--log-every", "4", "--exact-rmse", "--val-samples", "33"]
DMLTRAIN = [sys.executable, "-m", "dmltrain"]


def launch(command, run, timeout=300, gpus=False):
    if command[: len(DMLTRAIN)] == DMLTRAIN:
        args = [*command[len(DMLTRAIN) :], "--run-dir", str(run)]
        done = run_cli(*args, cwd=run.parent, timeout=timeout, gpus=gpus, **own_port())
    else:
        done = subprocess.run(
            [*command, "--run-dir", str(run)],
            env=cli_env(gpus, **own_port()),
            cwd=run.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 2-process self-spawn run every other launcher is compared with."""
    run = tmp_path_factory.mktemp("spawn") / "run"
    done = launch(DMLTRAIN + ARGS + ["--nprocs", "2", "--exit-note", f"{run}-exit"], run)
    return run, done


def test_spawn_writes_once_from_rank_0(reference):
    run, done = reference
    # ranks.csv: only where a rank was slow, which a loaded machine may make happen
    assert sorted(p.name for p in run.iterdir() if p.name != "ranks.csv") == [
        "checkpoints",
        "config.yaml",
        "diagnostics.json",
        "final_weights.pt",
        "outcome.json",
        "steps.csv",
        "training_log.csv",
    ]
    assert done.stdout.count("epoch 1/3 train_loss") == 1  # one summary, from rank 0
    assert done.stdout.count("dmltrain: tiny ->") == 1
    assert "nprocs: 2" in (run / "config.yaml").read_text()
    # workers leave with os._exit (launch.leave), after the experiment's atexit handlers
    assert sorted(p.name for p in run.parent.glob("run-exit.*")) == ["run-exit.0", "run-exit.1"]


def test_validation_rmse_is_exact_over_uneven_shards(reference):
    """val_rmse is the root of the mean squared error over all 33 samples, every sample
    counted once, not a mean of the batches' or the ranks' RMSEs (which differ from it)."""
    run, _ = reference
    model = TinyTrainer(options=TinyOptions(val_samples=33)).create_model()
    model.load_state_dict(torch.load(run / "final_weights.pt", weights_only=True))
    x, y = tiny_data(TinyOptions(val_samples=33))
    x, y = x[96:], y[96:]
    with torch.no_grad():
        squared = (model(x) - y) ** 2
    last = read_training_log(run / "training_log.csv")[-1]
    assert last["val_rmse"] == pytest.approx(squared.mean().sqrt().item(), rel=1e-6)
    shards = [squared[r::2] for r in range(2)]  # rank r validates samples r, r+2, ...
    of_batches = [b.mean().sqrt().item() for shard in shards for b in shard.split(8)]
    assert abs(sum(of_batches) / len(of_batches) - last["val_rmse"]) > 1e-4


def test_one_process_with_the_same_global_batch_matches(reference, tmp_path):
    run = tmp_path / "run"
    args = [a if a != "8" else "16" for a in ARGS]
    launch(DMLTRAIN + args, run)
    assert_same_run(reference[0], run, rel=1e-5)


def test_torchrun(reference, tmp_path):
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "dmltrain",
        *ARGS,
        "--exit-note",
        str(tmp_path / "exit"),
    ]
    done = launch(command, run)
    assert_same_run(reference[0], run)
    # rank 0 joins the agent's store rather than failing to bind its port, with a line
    assert "failed to bind" not in done.stderr, done.stderr[-3000:]
    # Ranks a launcher started leave without the interpreter's teardown (launch.leave),
    # yet an experiment's atexit handlers still run on every rank.
    assert sorted(p.name for p in tmp_path.glob("exit.*")) == ["exit.0", "exit.1"]


def test_mpirun(reference, tmp_path):
    require("mpirun")
    run = tmp_path / "run"
    launch(MPIRUN + DMLTRAIN + ARGS, run)
    assert_same_run(reference[0], run)


def test_one_mpirun_rank_that_starts_two_workers(reference, tmp_path):
    """``mpirun -np 1 ... --nprocs 2``: the rank starts the 2 workers, ranks 0 and 1."""
    require("mpirun")
    run = tmp_path / "run"
    one = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "1"]
    done = launch(one + DMLTRAIN + ARGS + ["--nprocs", "2"], run)
    assert "2 process(es), launcher mpi, strategy ddp" in done.stdout + done.stderr
    assert_same_run(reference[0], run)


def test_fsdp(reference, tmp_path):
    run = tmp_path / "run"
    launch(DMLTRAIN + ARGS + ["--nprocs", "2", "--strategy", "fsdp"], run)
    assert_same_run(reference[0], run, rel=1e-6)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovodrun(reference, tmp_path, controller):
    require("horovodrun")
    run = tmp_path / "run"
    command = ["horovodrun", f"--{controller}", "-np", "2", "-H", "localhost:2"]
    if controller == "mpi":
        command += ["--mpi-args=--allow-run-as-root --oversubscribe"]
    launch(command + DMLTRAIN + ARGS + ["--strategy", "horovod"], run)
    assert_same_run(reference[0], run, rel=1e-6)


def test_srun_inside_sbatch(reference, tmp_path, slurm):
    run = tmp_path / "run"
    script = tmp_path / "job.sh"
    command = " ".join(DMLTRAIN + ARGS + ["--run-dir", str(run)])
    script.write_text(f"#!/bin/bash\nsrun {command}\n")
    done = subprocess.run(
        ["sbatch", "--wait", "-n", "2", "-o", str(tmp_path / "slurm.out"), str(script)],
        env=cli_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = (tmp_path / "slurm.out").read_text() if (tmp_path / "slurm.out").exists() else ""
    assert done.returncode == 0, done.stderr + log
    assert "launcher: auto" in (run / "config.yaml").read_text()
    assert_same_run(reference[0], run)


def test_killed_rank_under_spawn_is_named_and_the_others_stop(tmp_path):
    started = time.monotonic()
    done = run_cli(
        *ARGS,
        "--nprocs",
        "2",
        "--die-rank",
        "1",
        "--die-at-step",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=120,
    )
    assert time.monotonic() - started < 90
    assert done.returncode == 5  # a lost peer, as rank 0's own line says: resumable
    assert (
        "dmltrain: rank 1 was killed by SIGKILL; the other ranks stopped, the "
        "checkpoints are intact: run the same command to resume (exit status 5)" in done.stderr
    )


def test_survivors_exit_on_their_own_when_a_rank_is_killed(tmp_path):
    """No launcher to clean up: rank 0 must notice rank 1's death and exit, naming it."""
    options = ["--die-rank", "1", "--die-at-step", "3", "--dist-timeout", "60"]
    command = DMLTRAIN + ARGS + options + ["--run-dir", str(tmp_path / "run")]
    procs = start_ranks(command, tmp_path)
    started = time.monotonic()
    _, err0 = procs[0].communicate(timeout=90)
    procs[1].wait(timeout=30)
    assert time.monotonic() - started < 75
    assert procs[1].returncode == -9
    assert procs[0].returncode == 5  # a lost peer: the checkpoints are intact, resume
    here = socket.gethostname()
    assert f"[rank 0] stopping: lost contact with rank 1 on {here} (gone)" in err0


def test_a_late_rank_is_waited_for_by_init_timeout_then_dist_timeout_applies(tmp_path):
    """Rank 1 starts 12 s after rank 0, with --dist-timeout 4: the start waits for it
    (--init-timeout 60) and the run trains. Once started, rank 1 blocked for 30 s in
    train_step is a lost peer after --dist-timeout: rank 0 stops long before 30 s."""
    options = ["--dist-timeout", "4", "--init-timeout", "60", "--no-hang-watchdog",
               "--pause-at-step", "6", "--pause-rank", "1", "--pause-seconds", "30",
               "--run-dir", str(tmp_path / "run")]  # fmt: skip
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [*DMLTRAIN, *ARGS, *options]
    procs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=cli_env(**env, RANK="0", LOCAL_RANK="0"))]  # fmt: skip
    try:
        time.sleep(12)
        procs.append(subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env=cli_env(**env, RANK="1", LOCAL_RANK="1")))  # fmt: skip
        seen = []  # rank 0's lines until step 4 (trained after the late start)
        while not seen or ("step 4/" not in seen[-1] and seen[-1]):
            seen.append(procs[0].stdout.readline())
        # counted from 2 steps before rank 1's pause, not from its start (slow when loaded)
        started = time.monotonic()
        out0, err0 = procs[0].communicate(timeout=120)
        stopped = time.monotonic() - started
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert procs[0].returncode == 5, err0[-3000:]
    assert "step 4/" in seen[-1], "".join(seen) + out0
    assert "[rank 0] stopping: lost contact with rank 1" in err0
    assert stopped < 30, stopped  # the pause's 30 s: --dist-timeout, not --init-timeout


def test_a_rank_0_that_works_alone_is_not_reported_lost_by_the_others(tmp_path):
    """Rank 0 blocks for 25 s (a save that outlasts --dist-timeout): rank 1's collective
    gives up, its roll call finds rank 0's store answering, and it leaves saying rank 0 is
    busy without writing --status-file (the batch scripts end the step on a 5 there);
    rank 0 writes the job's status itself when it finds rank 1 gone."""
    status = tmp_path / "status"
    options = ["--dist-timeout", "5", "--no-hang-watchdog", "--pause-at-step", "3",
               "--pause-rank", "0", "--pause-seconds", "25", "--status-file", str(status),
               "--run-dir", str(tmp_path / "run")]  # fmt: skip
    procs = start_ranks(DMLTRAIN + ARGS + options, tmp_path)
    try:
        _, err1 = procs[1].communicate(timeout=60)
        assert procs[0].poll() is None and not status.exists()  # rank 0 still at work
        _, err0 = procs[0].communicate(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert procs[1].returncode == 5, err1[-3000:]
    here = socket.gethostname()
    assert f"[rank 1] stopping: lost contact with rank 0 on {here} (alive, busy" in err1
    assert procs[0].returncode == 5, err0[-3000:]
    assert f"[rank 0] stopping: lost contact with rank 1 on {here} (gone)" in err0
    assert read_status_record(status) == (5, 0)


def peer_connections(pid: int) -> int:
    """TCP connections of process ``pid`` to other ranks: established, and neither end on
    the store's port (MASTER_PORT)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    store = int(next(v for v in environ if v.startswith(b"MASTER_PORT=")).split(b"=")[1])
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (target := os.readlink(fd)).startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            ports = {int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)}
            count += fields[3] == "01" and fields[9] in inodes and store not in ports
    return count


def test_a_rank_connects_to_a_few_peers_not_to_every_rank(tmp_path):
    """8 ranks train; while rank 0 is held in its 5th step, every other rank, waiting in
    the step's collectives, holds connections to a few peers (those its collectives'
    patterns reach, O(log N)), not to all 7 (Gloo's full mesh: 1,023 sockets a rank at
    1,024 ranks)."""
    options = ["--pause-at-step", "5", "--pause-rank", "0", "--pause-seconds", "20",
               "--no-hang-watchdog", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    procs = start_ranks(DMLTRAIN + ARGS + options, tmp_path, world_size=8)
    log = tmp_path / "run" / "training_log.csv"
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and ",4," in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)  # the others reach step 5's collectives
        held = [peer_connections(proc.pid) for proc in procs[1:]]
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), outs[0][1][-3000:]
    assert 1 <= max(held) < 7, held


def test_backend_mpi_without_torch_mpi_is_a_clear_error(tmp_path):
    if torch.distributed.is_mpi_available():
        pytest.skip("this torch was built with MPI")
    done = run_cli(*ARGS, "--nprocs", "2", "--backend", "mpi", cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "--backend mpi: this torch was built without MPI" in line
    assert "--backend gloo" in line and "--strategy horovod" in line


def test_strategy_single_with_two_processes_is_a_clear_error(tmp_path):
    done = run_cli(*ARGS, "--nprocs", "2", "--strategy", "single", cwd=tmp_path)
    assert done.returncode == 2 and "--strategy single cannot run 2 processes" in done.stderr


def test_nccl_without_a_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = run_cli(*ARGS, "--backend", "nccl", cwd=tmp_path)
    assert done.returncode == 2 and "--backend nccl needs CUDA GPUs" in done.stderr


def test_a_parent_starting_more_nccl_workers_than_its_gpus_is_refused_first(monkeypatch):
    """The --nprocs parent refuses before any worker starts. The GPU count is mocked (no
    GPU here); test_more_processes_than_gpus_is_a_clear_error runs it on one."""
    from dmltrain.config import DistConfig
    from dmltrain.runtime.launch import DistInfo
    from dmltrain.runtime.strategies import create_strategy

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    parent = DistInfo(world_size=2, launcher="spawn", device="cuda:0", workers=2)
    with pytest.raises(UserError, match="2 processes to start here and 1 GPU"):
        create_strategy(parent, DistConfig())
    task = DistInfo(world_size=4, launcher="slurm", device="cuda:0", workers=2)  # 2 tasks
    with pytest.raises(UserError, match="start at most 1 here"):
        create_strategy(task, DistConfig())


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_on_gpus_matches_one_process(tmp_path, strategy):
    """One process per GPU (up to 2), NCCL chosen automatically, vs one process on cuda:0."""
    n = min(torch.cuda.device_count(), 2)
    single = tmp_path / "single"
    args = [a if a != "8" else str(8 * n) for a in ARGS]
    launch(DMLTRAIN + args, single, gpus=True)
    run = tmp_path / "run"
    launch(DMLTRAIN + ARGS + ["--nprocs", str(n), "--strategy", strategy], run, gpus=True)
    assert_same_run(single, run, rel=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_more_processes_than_gpus_is_a_clear_error(tmp_path):
    n = str(torch.cuda.device_count() + 1)
    done = run_cli(*ARGS, "--nprocs", n, cwd=tmp_path, gpus=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "NCCL needs one GPU per process" in lines[0], done.stderr


@pytest.mark.gpu
@needs_gpu
def test_mnist_on_a_gpu(tmp_path):
    run = tmp_path / "run"
    done = run_cli(
        "mnist",
        "--epochs",
        "1",
        "--no-download",
        "--num-workers",
        "2",
        "--run-dir",
        str(run),
        cwd=tmp_path,
        gpus=True,
    )
    assert done.returncode == 0, done.stderr
    (row,) = read_training_log(run / "training_log.csv")
    assert row["val_acc"] > 0.9


def test_mnist_two_processes(tmp_path):
    """The user's command under self-spawn: the sample trains and rank 0 warns once."""
    run = tmp_path / "run"
    done = run_cli(
        "mnist",
        "--nprocs",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--no-download",
        "--run-dir",
        str(run),
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("bundled 5,000-digit sample") == 1
    (row,) = read_training_log(run / "training_log.csv")
    assert row["val_acc"] > 0.85


def test_components_are_installed():
    """The test command installs these; without them the tests above prove nothing."""
    for tool in ("mpirun", "horovodrun", "sbatch"):
        require(tool)
    horovod = subprocess.run(["horovodrun", "--check-build"], capture_output=True, text=True)
    assert "[X] PyTorch" in horovod.stdout, horovod.stdout

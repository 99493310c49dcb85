"""Each process's CPU threads: its share of the cores it may run on, under every launcher."""

import json

import pytest
from helpers import run_cli

from dmltrain.runtime.launch import cpu_set, physical_cores, run_environment
from dmltrain.runtime.threads import assign, choose, starved


def rank(host="a", cpus=(0, 1, 2, 3), cores=4, omp=None, per_task=None):
    return {"host": host, "cpus": list(cpus), "cores": cores, "omp_num_threads": omp,
            "cpus_per_task": per_task}  # fmt: skip


@pytest.mark.parametrize(
    "ranks, workers, expected",
    [
        ([rank()], 0, 4),  # one process: every core
        ([rank(), rank()], 0, 2),  # --nprocs, torchrun, an unbound srun: shared
        ([rank(), rank(), rank(host="b"), rank(host="b")], 0, 2),  # per host
        ([rank(cpus=(0, 1), cores=2), rank(cpus=(2, 3), cores=2)], 0, 2),  # mpirun binds
        ([rank(), rank()], 1, 1),  # a loader worker takes one of the two
        ([rank(), rank()], 5, 1),  # never fewer than one
        ([rank(cpus=(0, 1), cores=1)], 0, 1),  # two hyperthreads of one core
        ([rank(cpus=range(8), cores=8, per_task=2)] * 2, 0, 2),  # SLURM_CPUS_PER_TASK caps
    ],
)
def test_the_share_of_the_cores(ranks, workers, expected):
    assert choose(0, workers, ranks, 0).threads == expected


def test_the_flag_then_the_users_omp_num_threads_win():
    assert choose(3, 0, [rank(omp=2)], 0).threads == choose(3, 2, [rank()], 0).threads == 3
    assert choose(3, 0, [rank(omp=2)], 0).why == "--threads"
    assert choose(0, 0, [rank(omp=2), rank(omp=2)], 0).threads == 2


@pytest.mark.parametrize(
    "ranks, cuda, workers, threads",
    [
        ([rank()], False, 1, 3),  # CPU: a quarter of the process's cores load
        ([rank(), rank()], False, 0, 2),  # below 4 CPUs each: loading in the process
        ([rank(cpus=range(64), cores=64)], False, 8, 56),  # at most 8
        ([rank()], True, 3, 1),  # a GPU computes: all CPUs but one load
        ([rank(), rank()], True, 1, 1),
        ([rank(cpus=range(32), cores=32, per_task=6)] * 4, True, 5, 1),  # Slurm's share
        ([rank(cpus=(0,), cores=1)], True, 0, 1),  # one CPU: nothing to spare
    ],
)
def test_auto_workers_come_from_the_same_share(ranks, cuda, workers, threads):
    choice = choose(0, "auto", ranks, 0, cuda)
    assert (choice.workers, choice.threads) == (workers, threads)
    assert choose(0, 2, ranks, 0, cuda).workers == 2  # a number is taken as it is


def test_gpu_processes_with_one_cpu_each_are_warned_of():
    """PBS's select=1:ncpus=4:ngpus=4:mpiprocs=4 (the old default of dmltrain submit pbs):
    4 GPU processes share 4 cores, so their loader workers have none of their own."""
    four = [{**rank(), "device": f"cuda:{i}"} for i in range(4)]
    assign(0, "auto", four, cuda=True)
    warning = starved(four)
    assert warning is not None and warning.startswith("4 GPU process(es) on a have 1 CPU each")
    two = [{**rank(), "device": f"cuda:{i}"} for i in range(2)]
    assign(0, "auto", two, cuda=True)
    assert starved(two) is None  # 2 CPUs each
    cpu = [{**rank(), "device": "cpu"} for _ in range(4)]
    assign(0, "auto", cpu)
    assert starved(cpu) is None  # on the CPU the cores compute; nothing loads beside them


def test_auto_workers_reach_the_loader_and_the_summary(tmp_path):
    done = run_cli("tiny", "--epochs", "1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if "CPU threads per process" in line]
    diagnostics = json.loads((tmp_path / "run" / "diagnostics.json").read_text())
    (me,) = diagnostics["ranks"]
    expected = choose(0, "auto", [me], 0).workers  # 0 on a machine below 4 CPUs
    assert me["workers"] == expected and line.endswith(f"loader workers: {expected}"), line
    assert f"num_workers: {expected}" in (tmp_path / "run" / "config.yaml").read_text()
    bad = run_cli("tiny", "--num-workers", "some", cwd=tmp_path)
    assert bad.returncode == 2 and "--num-workers: give auto or a number >= 0" in bad.stderr


def test_torchruns_own_omp_num_threads_is_not_the_users():
    """torchrun sets OMP_NUM_THREADS=1 for its workers when its own environment has none."""
    worker = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert run_environment(worker, parent={}).omp_num_threads is None
    assert run_environment(worker, parent={"OMP_NUM_THREADS": "1"}).omp_num_threads == 1
    assert run_environment({"OMP_NUM_THREADS": "3"}).omp_num_threads == 3  # no torchrun
    assert run_environment({"OMP_NUM_THREADS": "junk"}).omp_num_threads is None
    assert run_environment({"SLURM_CPUS_PER_TASK": "4"}).cpus_per_task == 4


CORES = physical_cores(cpu_set())
SHARED = f"{CORES} core(s) shared by 2 process(es)"


@pytest.mark.parametrize(
    "extra, env, expected, threads",
    [([], {}, SHARED, max(1, CORES // 2)), (["--threads", "3"], {}, "--threads", 3),
     ([], {"OMP_NUM_THREADS": "3"}, "OMP_NUM_THREADS", 3)],
)  # fmt: skip
def test_the_choice_is_made_and_recorded(tmp_path, extra, env, expected, threads):
    run = tmp_path / "run"
    args = ["tiny", "--epochs", "1", "--nprocs", "2", "--progress", "off", *extra]
    done = run_cli(*args, "--run-dir", str(run), cwd=tmp_path, **env)
    assert done.returncode == 0, done.stderr
    ranks = json.loads((run / "diagnostics.json").read_text())["ranks"]
    assert [(r["threads"], r["threads_why"]) for r in ranks] == [(threads, expected)] * 2
    assert f"CPU threads per process: {threads} ({expected})" in done.stdout

"""Launcher detection from patched environments (PBS/PALS and multi-node Slurm cannot run
here; the launchers that can run are exercised for real in tests/runtime/test_distributed.py)."""

import pytest

from dmltrain import UserError
from dmltrain.runtime import launch


def test_single_process_defaults():
    info = launch.detect(env={})
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (0, 1, 0, "single")
    assert info.is_main and not info.distributed and info.job_id is None


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3,c[09-10]", ["a1", "a2", "b3", "c09", "c10"]),
        ("gpu-[1-2]-ib", ["gpu-1-ib", "gpu-2-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("dec[0001-0003]", ["dec0001", "dec0002", "dec0003"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert launch.expand_hostlist(hostlist) == hosts


def slurm_env(procid, nodeid, localid, **extra):
    env = {
        "SLURM_JOB_ID": "4711",
        "SLURM_PROCID": str(procid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NTASKS": "8",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    env.update(extra)
    return env


def test_multi_node_slurm_has_one_master_and_right_node_ranks():
    infos = [launch.detect(env=slurm_env(r, r // 4, r % 4)) for r in range(8)]
    assert {i.master_addr for i in infos} == {"gpu07"}
    assert {i.master_port for i in infos} == {15000 + 4711}
    assert [i.node_rank for i in infos] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [i.local_rank for i in infos] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(i.world_size == 8 and i.local_world_size == 4 for i in infos)
    assert {i.launcher for i in infos} == {"slurm"} and infos[0].job_id == "4711"


def test_uneven_slurm_layout():
    env = slurm_env(4, 1, 0, SLURM_STEP_TASKS_PER_NODE="4,1", SLURM_STEP_NUM_TASKS="5")
    info = launch.detect(env=env)
    assert (info.world_size, info.local_world_size, info.node_rank) == (5, 1, 1)


def test_slurm_tasks_that_do_not_add_up_are_one_line_naming_the_node():
    """SLURM_NTASKS set by hand (or an srun that overrides the allocation): the ranks would
    wait for ranks that never start."""
    env = slurm_env(0, 0, 0, SLURM_STEP_NUM_TASKS="6")  # 4(x2) per node is 8
    with pytest.raises(
        UserError,
        match=r"on \S+: Slurm says 6 task\(s\) in all but 4\(x2\) "
        r"per node, 8 in all: start the ranks with srun",
    ):
        launch.detect(env=env)


def test_two_jobs_on_one_node_get_different_ports():
    a = launch.detect(env=slurm_env(0, 0, 0, SLURM_JOB_ID="100"))
    b = launch.detect(env=slurm_env(0, 0, 0, SLURM_JOB_ID="101"))
    assert a.master_port != b.master_port


def test_sbatch_shell_salloc_and_pty_are_single_unless_told():
    batch_shell = {k: v for k, v in slurm_env(0, 0, 0).items() if not k.startswith("SLURM_STEP")}
    pty = slurm_env(0, 0, 0, SLURM_PTY_PORT="4000")
    for env in (batch_shell, pty):
        assert launch.detect(env=env).launcher == "single"
    forced = launch.detect("slurm", env=batch_shell)
    assert forced.launcher == "slurm" and forced.world_size == 8


def test_torchrun_inside_srun_is_torchrun():
    env = slurm_env(
        3,
        0,
        3,
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="10.0.0.5",
        MASTER_PORT="29400",
        TORCHELASTIC_RUN_ID="abc",
    )
    info = launch.detect(env=env)
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == (
        "torchrun",
        1,
        2,
        "10.0.0.5",
    )
    assert info.master_port == 29400
    assert info.agent_store_attempt is None  # rank 0 makes the store
    held = launch.detect(
        env={**env, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    )  # torchrun's agent holds it: every rank joins, under the attempt's prefix
    assert held.agent_store_attempt == 2


def test_multi_node_torchrun_node_rank():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "1234",
    }
    info = launch.detect(env=env)
    assert (info.node_rank, info.local_rank, info.local_world_size) == (1, 1, 4)


def test_openmpi_single_node():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    info = launch.detect(env=env)
    assert (info.launcher, info.rank, info.local_rank, info.master_addr) == (
        "mpi",
        1,
        1,
        "127.0.0.1",
    )


def test_openmpi_multi_node_needs_master_addr():
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    with pytest.raises(UserError, match="MASTER_ADDR"):
        launch.detect(env=env)
    info = launch.detect(env={**env, "MASTER_ADDR": "n1"})
    assert (info.node_rank, info.master_addr) == (1, "n1")


def test_pbs_cray_pals_derecho_layout(tmp_path):
    """mpiexec on a Cray PBS machine: PMI_*, PALS_LOCAL_RANKID, the PBS node file."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("dec0101.hsn\ndec0101.hsn\ndec0102.hsn\ndec0102.hsn\n")
    env = {
        "PMI_RANK": "3",
        "PMI_SIZE": "8",
        "PALS_LOCAL_RANKID": "3",
        "PALS_LOCAL_SIZE": "4",
        "PBS_JOBID": "123456.desched1",
        "PBS_NODEFILE": str(nodefile),
    }
    info = launch.detect(env=env)
    assert (info.launcher, info.rank, info.local_rank, info.node_rank) == ("mpi", 3, 3, 0)
    assert info.master_addr == "dec0101.hsn" and info.job_id == "123456"
    mpich = launch.detect(
        env={"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    )
    assert (mpich.launcher, mpich.world_size) == ("mpi", 2)


def test_horovodrun_gloo_env():
    env = {
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "0",
    }
    info = launch.detect(env=env)
    assert (info.launcher, info.rank, info.world_size) == ("horovod", 1, 2)


def test_explicit_launcher_without_its_environment_is_a_clear_error():
    with pytest.raises(UserError, match="--launcher torchrun needs RANK"):
        launch.detect("torchrun", env={})
    with pytest.raises(UserError, match="--launcher mpi needs"):
        launch.detect("mpi", env={})


def test_nprocs_spawns_only_without_an_external_launcher():
    info = launch.detect(nprocs=3, env={})
    assert (info.launcher, info.world_size, info.rank) == ("spawn", 3, 0)
    assert [launch.spawned(info, r).rank for r in range(3)] == [0, 1, 2]
    with pytest.raises(UserError, match="--nprocs starts workers itself; under torchrun"):
        launch.detect(nprocs=2, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_srun_tasks_that_each_start_workers():
    """2 nodes x 2 tasks, --nprocs 8: each task starts 2 workers; ranks follow the tasks,
    local ranks count across each node's tasks (what srun -N 2 -n 8 would give)."""
    layout = {
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    tasks = [launch.detect(nprocs=8, env=slurm_env(t, t // 2, t % 2, **layout)) for t in range(4)]
    assert all(t.starts_workers and t.workers == 2 and t.world_size == 8 for t in tasks)
    workers = [launch.spawned(t, i) for t in tasks for i in range(2)]
    direct = [launch.detect(env=slurm_env(r, r // 4, r % 4)) for r in range(8)]
    for field in ("rank", "local_rank", "world_size", "local_world_size", "node_rank",
                  "master_addr", "master_port", "launcher"):  # fmt: skip
        assert [getattr(w, field) for w in workers] == [getattr(d, field) for d in direct], field
    assert not any(w.starts_workers for w in workers)
    one = launch.detect(nprocs=4, env=slurm_env(0, 0, 0, **layout))  # a worker a task: as it is
    assert not one.starts_workers and one.world_size == 4
    with pytest.raises(UserError, match=r"--nprocs 6 with 4 slurm tasks: .* a multiple of 4"):
        launch.detect(nprocs=6, env=slurm_env(0, 0, 0, **layout))


def test_job_id_from_batch_systems():
    assert launch.job_id({"SLURM_JOB_ID": "123"}) == "123"
    array = {"SLURM_JOB_ID": "124", "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "4"}
    assert launch.job_id(array) == "120_4"
    assert launch.job_id({"PBS_JOBID": "987.desched1"}) == "987"
    assert launch.job_id({}) is None


def test_the_gpus_a_process_sees_are_dealt_out_to_its_children():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert launch.split_gpus(2, env) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    assert launch.split_gpus(4, env)[3] == {"CUDA_VISIBLE_DEVICES": "3"}
    assert launch.split_gpus(3, {"CUDA_VISIBLE_DEVICES": ""}) == [
        {},
        {},
        {},
    ]  # no GPU: nothing to set
    with pytest.raises(ValueError, match="2 GPU\\(s\\) for 3 processes"):
        launch.split_gpus(3, {"CUDA_VISIBLE_DEVICES": "4,5"})

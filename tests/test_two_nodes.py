"""The multi-node paths on two real hosts: a two-node Slurm cluster made of network
namespaces on this machine (tests/cluster/two_node_slurm.sh: node1 and node2, each with
its own address and hostname), CPU and Gloo. Each run ends bitwise equal to the same
number of processes on one host (tiny_reference: --nprocs 2, a thread each)."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import (
    REQUIRE_ALL,
    ROOT,
    TESTS,
    TINY_RUN,
    assert_same_run,
    cli_env,
    job_field,
    release_requeues_until_done,
    require,
    run_cli,
    sbatch,
    wait_for,
)

CLUSTER = Path(os.environ.get("DMLTRAIN_TWO_NODES", "/var/tmp/dmltrain-two-nodes"))
PBS = ROOT / "slurm" / "pbs"
# A task per node, a core and a thread each (the reference's processes have one thread).
NODES = ("--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "1", "--mem", "1000")
TINY = [*TINY_RUN, "--threads", "1"]


@pytest.fixture(scope="session")
def two_nodes() -> dict[str, str]:
    """The environment that aims Slurm's commands at the two-node cluster (started here
    when it is down: tests/run.sh starts it, beside the single-node one)."""
    for tool in ("sbatch", "slurmd", "ip", "nsenter"):
        require(tool)
    up = subprocess.run(["bash", str(TESTS / "cluster" / "two_node_slurm.sh"), "up"],
                        capture_output=True, text=True, timeout=180)  # fmt: skip
    if up.returncode != 0:
        message = f"the two-node Slurm cluster did not come up: {up.stderr.strip()[-1500:]}"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return {"SLURM_CONF": str(CLUSTER / "slurm.conf")}


def hosts_of(log: str) -> str:
    """The 'where' line of the startup summary: each host and its devices."""
    return next(line for line in log.splitlines() if line.startswith("dmltrain: node"))


def test_run_sh_across_two_nodes_requeues_and_equals_one_host(two_nodes, tiny_reference,
                                                              tmp_path):  # fmt: skip
    """srun, one rank per node: the master address comes from the node list (node1), the
    port from the job id; --epochs-per-job 1 requeues the two-node job twice."""
    job = sbatch(tmp_path, *TINY, "--epochs-per-job", "1", options=NODES, env=two_nodes)
    release_requeues_until_done(job, tmp_path, env=two_nodes)
    log = (tmp_path / "job.out").read_text()
    assert "nodes node[1-2]" in log
    assert hosts_of(log).startswith("dmltrain: node1: cpu; node2: cpu")
    assert log.count("checkpoint saved, requeueing job") == 2
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def test_torchrun_sh_rendezvous_on_the_first_node(two_nodes, tiny_reference, tmp_path):
    """One torchrun per node, c10d rendezvous at node1's address."""
    job = sbatch(tmp_path, *TINY, options=NODES, script=str(ROOT / "slurm" / "torchrun.sh"),
                 env={**two_nodes, "DMLTRAIN_NPROC_PER_NODE": "1"})  # fmt: skip
    release_requeues_until_done(job, tmp_path, env=two_nodes)
    log = (tmp_path / "job.out").read_text()
    assert "2 node(s) x 1 process(es), rendezvous node1:" in log
    assert "launcher torchrun, strategy ddp" in log
    assert hosts_of(log).startswith("dmltrain: node1: cpu; node2: cpu")
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def test_horovod_sh_over_mpi_through_srun_on_two_nodes(two_nodes, tiny_reference, tmp_path):
    """srun --mpi=pmix wires one Horovod rank per node into one MPI world."""
    job = sbatch(tmp_path, *TINY, options=NODES, script=str(ROOT / "slurm" / "horovod.sh"),
                 env=two_nodes)  # fmt: skip
    release_requeues_until_done(job, tmp_path, timeout=180, env=two_nodes)
    log = (tmp_path / "job.out").read_text()
    assert "strategy horovod, backend horovod/mpi" in log
    assert hosts_of(log).startswith("dmltrain: node1: cpu; node2: cpu")
    # Horovod averages gradients in its own order: equal to DDP up to rounding.
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}", rel=1e-4)


def test_chain_sh_and_submit_slurm_on_two_nodes(two_nodes, tiny_reference, tmp_path):
    """slurm/chain.sh: dependent two-node jobs in one run directory; dmltrain submit slurm
    --nodes 2: the script it writes runs across both nodes."""
    sbatch_options = " ".join([*NODES, "--time", "10", f"--output={tmp_path}/chain-%j.out"])
    chain = subprocess.run(
        ["bash", str(ROOT / "slurm" / "chain.sh"), "2", *TINY, "--epochs-per-job", "2"],
        cwd=tmp_path, env=cli_env(**two_nodes, DMLTRAIN_SBATCH=sbatch_options),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert chain.returncode == 0, chain.stderr
    jobs = re.findall(r"job \d/2: (\d+)", chain.stdout)
    for job in jobs:
        wait_for(lambda job=job: job_field(job, "JobState", two_nodes) == "COMPLETED", 180, job)
    logs = [(tmp_path / f"chain-{job}.out").read_text() for job in jobs]
    assert "the next job of the chain goes on" in logs[0] and "resuming from" in logs[1]
    assert all(hosts_of(log).startswith("dmltrain: node1: cpu; node2: cpu") for log in logs)
    assert_same_run(tiny_reference, tmp_path / re.search(r"directory (\S+)", chain.stdout)[1])

    done = run_cli("submit", "slurm", *TINY, "--nodes", "2", "--tasks-per-node", "1",
                   "--cpus-per-task", "1", "--time", "10", cwd=tmp_path, **two_nodes)  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted job (\d+)", done.stdout)[1]
    run = Path(re.search(r"run directory (\S+)", done.stdout)[1])
    wait_for(lambda: job_field(job, "JobState", two_nodes) == "COMPLETED", 180, f"job {job}")
    assert "#SBATCH --nodes=2" in (run / "submit-slurm.sh").read_text()
    log = next(run.glob("slurm-*.out")).read_text()
    assert hosts_of(log).startswith("dmltrain: node1: cpu; node2: cpu")
    assert_same_run(tiny_reference, run)


def test_prepare_data_runs_once_per_node(two_nodes, tmp_path):
    """Two ranks on each node: prepare_data runs on each node's local rank 0 only."""
    marker = tmp_path / "prepared"
    options = (*NODES, "--ntasks-per-node", "2")
    job = sbatch(tmp_path, "tiny", "--epochs", "1", "--progress", "off", "--prepare-log",
                 str(marker), options=options, env=two_nodes)  # fmt: skip
    wait_for(lambda: job_field(job, "JobState", two_nodes) == "COMPLETED", 120, f"job {job}")
    assert sorted(marker.read_text().splitlines()) == ["node1 0", "node2 2"]


def test_doctor_all_reduces_across_both_nodes(two_nodes, tmp_path):
    done = subprocess.run(
        ["srun", *NODES, "--time", "5", "python", "-m", "dmltrain", "doctor"],
        cwd=tmp_path, env=cli_env(**two_nodes), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    gloo = next(line for line in done.stdout.splitlines() if "gloo all-reduce" in line)
    assert "2 processes: sum 3 (expected 3)" in gloo


def test_derecho_sh_mpiexec_starts_a_rank_on_each_host(two_nodes, tiny_reference, tmp_path):
    """PBS faked (tests/cluster/qsub) with a PBS_NODEFILE of node1 and node2; OpenMPI's
    mpiexec starts a rank in each node's namespaces (tests/cluster/netns-rsh stands in for
    ssh or PALS); MASTER_ADDR is the node file's first host."""
    require("mpiexec")
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node1\nnode2\n")
    subnet = "10.213.0.0/24"  # the cluster's own bridge: nothing else is used
    env = cli_env(
        PATH=f"{TESTS / 'cluster'}{os.pathsep}{os.environ['PATH']}",  # the fake qsub
        FAKE_PBS_NODEFILE=str(nodefile),
        FAKE_PBS_COUNTER=str(tmp_path / "counter"),
        DMLTRAIN_ARGS=" ".join(TINY),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_orte_default_hostfile=str(nodefile),  # PBS's TM would tell mpiexec
        OMPI_MCA_plm_rsh_agent=str(TESTS / "cluster" / "netns-rsh"),
        OMPI_MCA_btl_tcp_if_include=subnet,
        OMPI_MCA_oob_tcp_if_include=subnet,
    )
    done = subprocess.run(["qsub", str(PBS / "derecho.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "pbs-101.out").read_text()
    assert (tmp_path / "pbs-101.status").read_text().strip() == "0", log[-3000:]
    assert "2 node(s) x 1 rank(s), rendezvous node1:" in log
    assert hosts_of(log).startswith("dmltrain: node1: cpu; node2: cpu")
    assert_same_run(tiny_reference, tmp_path / "runs" / "tiny-101")

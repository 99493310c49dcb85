"""The PBS scripts (slurm/pbs/) and `dmltrain submit pbs`, with PBS faked: no PBS server
can run here, so tests/cluster/qsub stands in for qsub (it runs the job script at once with
PBS_JOBID, PBS_O_WORKDIR and a PBS_NODEFILE naming this machine once per rank) and
OpenMPI's mpiexec stands in for Cray MPICH's. What runs inside is real: mpiexec or torchrun
starting 2 training processes, checkpoints, resubmission after --epochs-per-job."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY_RUN, assert_same_run, pbs_env

PBS = ROOT / "slurm" / "pbs"
TINY = TINY_RUN


def job_logs(tmp_path: Path) -> list[tuple[str, int]]:
    """(output, exit status) of each fake PBS job, in submission order."""
    ids = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("pbs-*.status"))
    return [
        ((tmp_path / f"pbs-{i}.out").read_text(), int((tmp_path / f"pbs-{i}.status").read_text()))
        for i in ids
    ]


@pytest.mark.parametrize("script", ["derecho.sh", "casper.sh"])
def test_pbs_script_resubmits_after_each_part_and_ends_equal(script, tiny_reference, tmp_path):
    """--epochs-per-job 1: three jobs, each submitting the next; the run equals an
    uninterrupted one."""
    env = pbs_env(
        tmp_path,
        DMLTRAIN_ARGS=" ".join([*TINY, "--epochs-per-job", "1"]),
        DMLTRAIN_SCRIPT=str(PBS / script),
        NGPUS="2",  # casper.sh: processes per node from the job's GPUs
    )
    done = subprocess.run(
        ["qsub", str(PBS / script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    logs = job_logs(tmp_path)
    assert [status for _, status in logs] == [0, 0, 0], logs[-1][0][-3000:]
    launcher = "mpi" if script == "derecho.sh" else "torchrun"
    assert all(f"2 process(es), launcher {launcher}, strategy ddp" in out for out, _ in logs)
    assert all("checkpoint saved; resubmitting" in out for out, _ in logs[:2])
    if script == "derecho.sh":
        assert "dmltrain: NCCL_SOCKET_IFNAME=hsn" in logs[0][0]
    assert_same_run(tiny_reference, tmp_path / "runs" / "tiny-101")


def test_pbs_script_without_an_experiment_says_how_to_give_one(tmp_path):
    env = pbs_env(tmp_path, PBS_JOBID="1.fake", PBS_NODEFILE=str(tmp_path / "nodefile"))
    done = subprocess.run(
        ["bash", str(PBS / "derecho.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "no experiment: qsub -v DMLTRAIN_ARGS=" in done.stderr


def test_submit_pbs_writes_a_filled_in_script_that_runs_to_completion(tiny_reference, tmp_path):
    env = pbs_env(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dmltrain",
            "submit",
            "pbs",
            *TINY,
            "--epochs-per-job",
            "2",
            "--tasks-per-node",
            "2",
            "--time",
            "1-00:30:00",
            "--account",
            "PROJ0001",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    run = Path(re.search(r"run directory (\S+)", done.stdout).group(1))
    script = (run / "submit-pbs.sh").read_text()
    assert "#PBS -l select=1:ncpus=8:mpiprocs=2" in script  # 4 CPUs a process
    assert "#PBS -l walltime=24:30:00" in script and "#PBS -A PROJ0001" in script
    logs = job_logs(tmp_path)
    assert [status for _, status in logs] == [0, 0]  # 2 epochs, then the last one
    assert f"resubmitting {run / 'submit-pbs.sh'}" in logs[0][0]
    assert_same_run(tiny_reference, run)


def test_a_pbs_job_stops_before_its_walltime_and_the_next_job_goes_on(tiny_reference, tmp_path):
    """PBS kills a job at its walltime (qsub -l walltime=...): the run reads the limit from
    qstat -f (faked: 5 min 8 s, none used), checkpoints --stop-before-end-minutes 5 before
    it, exits 3 and the script submits the next job, which ends the run equal to one
    never stopped."""
    env = pbs_env(
        tmp_path,
        DMLTRAIN_ARGS=" ".join([*TINY, "--step-sleep", "0.4"]),
        DMLTRAIN_SCRIPT=str(PBS / "derecho.sh"),
        FAKE_PBS_WALLTIME="00:05:08",
    )
    done = subprocess.run(["qsub", str(PBS / "derecho.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    logs = job_logs(tmp_path)
    assert [status for _, status in logs][:2] == [0, 0], logs[-1][0][-3000:]
    first = logs[0][0]
    assert "preempted (time limit): checkpoint saved" in first, first[-3000:]
    assert "checkpoint saved; resubmitting" in first
    assert "resuming from" in logs[1][0]
    assert_same_run(tiny_reference, tmp_path / "runs" / "tiny-101")


def submit_chain(tmp_path: Path, env: dict[str, str], *flags: str) -> tuple[Path, list]:
    done = subprocess.run(
        [sys.executable, "-m", "dmltrain", "submit", "pbs", *flags, "--tasks-per-node", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "submitted a chain of 3 jobs (101.fakepbs, 102.fakepbs, 103.fakepbs)" in done.stdout
    return Path(re.search(r"run directory (\S+)", done.stdout).group(1)), job_logs(tmp_path)


def test_a_chain_goes_on_after_a_job_stops_for_its_walltime(tiny_reference, tmp_path):
    """dmltrain submit pbs --chain 3: jobs with -W depend=afterok on the one before (the
    fake qsub runs a job when the one it depends on ended with 0). The first job stops
    before its walltime (qstat -f faked: 5 min 8 s) with a checkpoint and ends well; the
    jobs after it go on in the same run directory, none resubmitting itself, and the run
    ends equal to one never stopped."""
    env = pbs_env(tmp_path, FAKE_PBS_WALLTIME="00:05:08")
    run, logs = submit_chain(tmp_path, env, *TINY, "--step-sleep", "0.4", "--chain", "3")
    assert [status for _, status in logs] == [0, 0, 0], logs[-1][0][-3000:]
    first = logs[0][0]
    assert "preempted (time limit): checkpoint saved" in first, first[-3000:]
    assert "the next job of the chain goes on" in first
    assert not any("resubmitting" in out for out, _ in logs)
    assert "resuming from" in logs[1][0]
    assert_same_run(tiny_reference, run)


def test_a_chain_ends_at_a_job_that_fails(tmp_path):
    """A job that fails (here: its environment cannot be activated) ends the chain: PBS
    deletes the jobs that depend on it (faked: pbs-ID.deleted)."""
    env = pbs_env(tmp_path)
    submit_chain(tmp_path, env, *TINY, "--env", "no-such-env", "--chain", "3")
    assert int((tmp_path / "pbs-101.status").read_text()) != 0
    assert not (tmp_path / "pbs-102.status").exists() and (tmp_path / "pbs-102.deleted").exists()
    assert (tmp_path / "pbs-103.deleted").exists()

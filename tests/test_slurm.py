"""slurm/run.sh on a real single-node Slurm cluster: plain runs, preemption with requeue,
and the --epochs-per-job chain. Each final log and weights equal an uninterrupted run."""

import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, assert_same_run, cli_env, run_cli

RUN_SH = str(ROOT / "slurm" / "run.sh")
TINY = [
    "tiny",
    "--epochs",
    "3",
    "--batch-size",
    "8",
    "--save-weights",
    "--progress",
    "log",
    "--log-every",
    "1",
]


def sbatch(cwd: Path, *args: str, options: tuple[str, ...] = ()) -> str:
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
            RUN_SH,
            *args,
        ],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_field(job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    match = re.search(rf"\b{name}=(\S+)", out)
    return match.group(1) if match else ""


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def release_requeues_until_done(job: str, cwd: Path, timeout: float = 300) -> None:
    """A requeued job waits (BeginTime) before it restarts; start it at once, as an admin
    would, until the job completes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(job, "JobState")
        if state == "COMPLETED":
            return
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if state == "PENDING" and job_field(job, "Reason") == "BeginTime":
            # Released at once, Slurm may restart the job before its last run has finished
            # completing and kill it ("Job credential revoked"); an admin waits a moment.
            time.sleep(5)
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
        time.sleep(1)
    log = (cwd / "job.out").read_text() if (cwd / "job.out").exists() else ""
    raise AssertionError(f"job {job} ended {job_field(job, 'JobState')}:\n{log[-3000:]}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    done = run_cli(*TINY, "--nprocs", "2", "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr
    return run


def test_run_sh_passes_shellcheck():
    subprocess.run(["shellcheck", RUN_SH], check=True)


def test_preempted_job_checkpoints_requeues_resumes_and_completes(slurm, reference, tmp_path):
    job = sbatch(tmp_path, *TINY, "--step-sleep", "0.4")
    run = tmp_path / "runs" / f"tiny-{job}"  # the default run directory, found again
    out = tmp_path / "job.out"
    wait_for(lambda: out.exists() and "epoch 1/3 step 3/" in out.read_text(), 120, "training")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    release_requeues_until_done(job, tmp_path)
    log = out.read_text()
    assert "preempted (SIGUSR1)" in log and "checkpoint saved, requeueing job" in log
    assert "dmltrain: resuming from" in log and "restart 1" in log
    assert job_field(job, "Restarts") == "1"
    assert_same_run(reference, run)


def test_preempted_array_task_requeues_itself_not_the_array(slurm, reference, tmp_path):
    """Two array tasks (one at a time on this 2-CPU node); task 1 is preempted. Only task 1
    may be requeued: requeueing the array id would rerun the finished task 0 too."""
    array = sbatch(
        tmp_path,
        *TINY,
        "--step-sleep",
        "0.4",
        options=("--array", "0-1", "--output", str(tmp_path / "job-%a.out")),
    )
    out = tmp_path / "job-1.out"
    wait_for(lambda: out.exists() and "epoch 1/3 step 3/" in out.read_text(), 240, "task 1")
    subprocess.run(["scancel", "--signal=USR1", f"{array}_1"], check=True)
    release_requeues_until_done(f"{array}_1", tmp_path)
    wait_for(lambda: job_field(f"{array}_0", "JobState") == "COMPLETED", 60, "task 0")
    assert f"checkpoint saved, requeueing job {array}_1" in out.read_text()
    assert job_field(f"{array}_1", "Restarts") == "1"
    assert job_field(f"{array}_0", "Restarts") == "0"
    assert "resuming from" not in (tmp_path / "job-0.out").read_text()
    for task in (0, 1):
        assert_same_run(reference, tmp_path / "runs" / f"tiny-{array}_{task}")


def test_epochs_per_job_chain_through_requeue(slurm, reference, tmp_path):
    job = sbatch(tmp_path, *TINY, "--epochs-per-job", "1")
    release_requeues_until_done(job, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert log.count("checkpoint saved, requeueing job") == 2
    assert job_field(job, "Restarts") == "2"
    assert_same_run(reference, tmp_path / "runs" / f"tiny-{job}")


def test_time_limit_stops_the_job_in_time_and_it_resumes(slurm, reference, tmp_path):
    """No signal at all: dmltrain reads the job's end time from Slurm and stops
    --stop-before-end-minutes before it: here 168 s of a 3-minute job, so a run stops about
    12 s after it starts, while training alone needs 18 s. USR1 would come only a second
    before the limit. (A restart whose setup outlasts the 12 s says so and runs on.)"""
    job = sbatch(
        tmp_path,
        *TINY,
        "--step-sleep",
        "1.0",
        "--stop-before-end-minutes",
        "2.8",
        options=("--time", "3", "--signal", "USR1@1"),
    )
    release_requeues_until_done(job, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert "preempted (time limit)" in log and "checkpoint saved, requeueing job" in log
    assert int(job_field(job, "Restarts")) >= 1
    assert_same_run(reference, tmp_path / "runs" / f"tiny-{job}")

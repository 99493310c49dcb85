"""The Slurm scripts on a real single-node Slurm cluster: slurm/run.sh (plain runs,
preemption with requeue, the --epochs-per-job chain), slurm/torchrun.sh, slurm/horovod.sh
and slurm/chain.sh; `dmltrain submit slurm`. Each final log and weights equal an
uninterrupted run."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    ROOT,
    TINY_RUN,
    assert_same_run,
    cli_env,
    job_field,
    readme_experiment,
    release_requeues_until_done,
    run_cli,
    sbatch,
    wait_for,
)

SLURM = ROOT / "slurm"
RUN_SH = str(SLURM / "run.sh")
TINY = TINY_RUN


def test_batch_and_environment_scripts_pass_shellcheck():
    scripts = [*SLURM.glob("*.sh"), *SLURM.glob("pbs/*.sh"), *ROOT.glob("environment/*.sh")]
    scripts += [
        ROOT / "tests" / "run.sh",
        ROOT / ".ci" / "run",
        ROOT / "tests" / "cluster" / "qsub",
        ROOT / "tests" / "cluster" / "start_local_slurm.sh",
        ROOT / "tests" / "cluster" / "two_node_slurm.sh",
        ROOT / "tests" / "cluster" / "netns-rsh",
    ]
    assert len(scripts) >= 10
    subprocess.run(["shellcheck", *map(str, scripts)], check=True)


def test_batch_scripts_hold_the_shared_blocks_and_drift_is_caught(tmp_path):
    """Environment activation, job id, status file, requeue and resubmit are written once
    (slurm/blocks/) and pasted between markers; sync.py --check fails on a changed copy."""
    check = [sys.executable, str(SLURM / "blocks" / "sync.py"), "--check"]
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    uses = {
        name: {p.name for p in [*SLURM.glob("*.sh"), *SLURM.glob("pbs/*.sh")]
               if f"dmltrain block: {name} " in p.read_text()}
        for name in (b.name for b in (SLURM / "blocks").glob("*.sh"))
    }  # fmt: skip
    assert uses["activate.sh"] == {"run.sh", "torchrun.sh", "horovod.sh", "casper.sh",
                                   "derecho.sh"}  # fmt: skip
    assert (
        uses["slurm-job.sh"] == uses["slurm-requeue.sh"] == {"run.sh", "torchrun.sh", "horovod.sh"}
    )  # every Slurm script honours DMLTRAIN_REQUEUE=0 (slurm/chain.sh)
    assert uses["status-file.sh"] == {"run.sh", "torchrun.sh", "horovod.sh", "casper.sh"}
    assert uses["run-step.sh"] == {"run.sh", "torchrun.sh", "horovod.sh"}
    assert uses["pbs-args.sh"] == uses["pbs-resubmit.sh"] == {"casper.sh", "derecho.sh"}
    # A copy of the tree where one script's copy of a block was edited by hand.
    copy = tmp_path / "slurm"
    shutil.copytree(SLURM, copy)
    script = copy / "torchrun.sh"
    script.write_text(script.read_text().replace('"${DMLTRAIN_REQUEUE:-1}" = 0', "false"))
    check[1] = str(copy / "blocks" / "sync.py")
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 1 and "slurm/torchrun.sh differs" in done.stdout
    subprocess.run(check[:2], check=True, capture_output=True)  # copies the blocks in
    assert script.read_text() == (SLURM / "torchrun.sh").read_text()
    assert subprocess.run(check, capture_output=True).returncode == 0


def test_a_failed_requeue_names_the_submitted_script_not_slurmds_copy(slurm, tmp_path):
    """A job submitted with --no-requeue cannot be requeued: the hint to resubmit names the
    file the user submitted (sbatch runs a copy in slurmd's spool directory)."""
    job = sbatch(tmp_path, *TINY, "--epochs-per-job", "1", options=("--no-requeue",))
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 180, f"job {job}")
    log = (tmp_path / "job.out").read_text()
    hint = [line for line in log.splitlines() if "requeue failed" in line]
    assert hint == [f"dmltrain: requeue failed; resubmit with: sbatch {RUN_SH} {' '.join(TINY)} "
                    "--epochs-per-job 1"], log[-2000:]  # fmt: skip


def test_torchrun_script_requeues_through_torchrun_and_completes(slurm, tiny_reference, tmp_path):
    """One torchrun (c10d rendezvous) starting 2 processes; --epochs-per-job 1 ends each
    part with status 3, which the script reads from --status-file and requeues on; the
    workers exit 0 for it, so torchrun reports no failure (it would say 1, with a
    ChildFailedError traceback)."""
    job = sbatch(
        tmp_path,
        *TINY,
        "--epochs-per-job",
        "1",
        options=("--ntasks-per-node", "1", "--cpus-per-task", "2"),
        script=str(SLURM / "torchrun.sh"),
        env={"DMLTRAIN_NPROC_PER_NODE": "2"},
    )
    release_requeues_until_done(job, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert "1 node(s) x 2 process(es), rendezvous" in log
    assert "launcher torchrun, strategy ddp" in log
    assert log.count("checkpoint saved, requeueing job") == 2
    assert "ChildFailedError" not in log and "FAILED" not in log, log[-3000:]
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def test_horovod_script_runs_horovod_over_mpi_through_srun(slurm, tiny_reference, tmp_path):
    """srun --mpi=pmix, Horovod's MPI controller. With a job time limit rank 0 broadcasts
    the job's end time while the others pass None (this hung before the collectives had
    fixed names)."""
    job = sbatch(tmp_path, *TINY, script=str(SLURM / "horovod.sh"))
    release_requeues_until_done(job, tmp_path, timeout=120)
    log = (tmp_path / "job.out").read_text()
    assert "strategy horovod, backend horovod/mpi" in log
    # Horovod averages gradients in its own order: equal to DDP up to rounding.
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}", rel=1e-4)


def test_chain_script_runs_dependent_jobs_in_one_run_directory(slurm, tiny_reference, tmp_path):
    """4 jobs with afterok dependencies, one epoch each: 3 train, the 4th finds the run
    finished and ends at once."""
    done = subprocess.run(
        ["bash", str(SLURM / "chain.sh"), "4", *TINY, "--epochs-per-job", "1"],
        cwd=tmp_path,
        env=cli_env(
            DMLTRAIN_SBATCH="--ntasks-per-node=2 --cpus-per-task=1 --time=10 "
            f"--output={tmp_path}/chain-%j.out"
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    jobs = re.findall(r"job \d/4: (\d+)", done.stdout)
    run = tmp_path / re.search(r"run directory (\S+)", done.stdout).group(1)
    assert len(jobs) == 4
    for job in jobs:
        wait_for(lambda job=job: job_field(job, "JobState") == "COMPLETED", 180, f"job {job}")
    logs = [(tmp_path / f"chain-{job}.out").read_text() for job in jobs]
    assert all("the next job of the chain goes on" in log for log in logs[:2])
    assert "resuming from" in logs[1] and "nothing left to train" in logs[3]
    assert_same_run(tiny_reference, run)


def test_submit_slurm_writes_the_script_into_the_run_directory_and_completes(
    slurm, tiny_reference, tmp_path
):
    done = run_cli(
        "submit",
        "slurm",
        *TINY,
        "--tasks-per-node",
        "2",
        "--cpus-per-task",
        "1",
        "--time",
        "10",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted job (\d+)", done.stdout).group(1)
    run = Path(re.search(r"run directory (\S+)", done.stdout).group(1))
    assert (run / "submit-slurm.sh").is_file()
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 180, f"job {job}")
    assert "#SBATCH --ntasks-per-node=2" in (run / "submit-slurm.sh").read_text()
    assert list(run.glob("slurm-*.out"))
    assert_same_run(tiny_reference, run)


def test_an_experiment_file_submitted_from_itself_runs_that_file_in_the_job(slurm, tmp_path):
    """``python my_experiment.py submit slurm line``: the README's experiment, a file the
    job's node can read but no installed package; the batch script runs it by its path,
    and the run equals the same command run here."""
    source = readme_experiment(tmp_path)
    line = ["--epochs", "2", "--batch-size", "32", "--progress", "off"]
    done = subprocess.run(
        [sys.executable, "my_experiment.py", "submit", "slurm", "line", *line,
         "--cpus-per-task", "1", "--time", "10"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted job (\d+)", done.stdout).group(1)
    run = Path(re.search(r"run directory (\S+)", done.stdout).group(1))
    assert run.name.startswith("line-")
    assert f"set -- {source} --epochs 2" in (run / "submit-slurm.sh").read_text()
    here = run_cli(str(source), *line, "--run-dir", str(tmp_path / "here"), cwd=tmp_path)
    assert here.returncode == 0, here.stderr
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 180, f"job {job}")
    assert_same_run(tmp_path / "here", run)


def node_cpus() -> int:
    info = ["sinfo", "-h", "-o", "%c"]
    return int(subprocess.run(info, capture_output=True, text=True, check=True).stdout.split()[0])


@pytest.mark.parametrize("dry_run", [False, True])
def test_submit_refuses_a_job_the_partition_can_never_start(slurm, tmp_path, dry_run):
    """More CPUs a node than the partition's nodes have: sbatch would queue it for ever
    (PartitionConfig); dmltrain submit says what does not fit and submits nothing, and its
    --dry-run says so too."""
    name = f"cannot-fit-{os.getpid()}"
    cpus = node_cpus()
    args = ["submit", "slurm", *TINY, "--cpus-per-task", str(cpus + 1), "--job-name", name]
    done = run_cli(*args, "--time", "10", *(["--dry-run"] if dry_run else []), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("dmltrain: error:")]
    assert line.startswith("dmltrain: error: Slurm could never start this job (")
    assert f"1 node(s) of {cpus} CPUs" in line and "not submitted" in line
    queued = subprocess.run(["squeue", "-h", "-n", name], capture_output=True, text=True)
    assert queued.stdout.strip() == ""


def test_the_docs_plain_sbatch_of_run_sh_fits_a_small_node(slurm, tmp_path):
    """``sbatch --ntasks-per-node 2 slurm/run.sh ...`` (docs/launching.md) with the script's
    own defaults: Slurm could start it on a node of this cluster's size (2 CPUs here), where
    a default of 4 CPUs a task pended for ever (PartitionConfig)."""
    assert node_cpus() >= 2
    test = subprocess.run(["sbatch", "--test-only", "--ntasks-per-node", "2", RUN_SH, *TINY],
                          cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert test.returncode == 0, test.stderr
    assert "to start at" in test.stderr, test.stderr


def test_a_bad_setting_of_the_script_is_one_line_and_no_requeue(slurm, tmp_path):
    """DMLTRAIN_MAX_LOST_REQUEUES=abc: the job ends at once with one line (exit 2), where
    the requeue test failed in the shell and the job requeued for ever."""
    job = sbatch(tmp_path, *TINY, env={"DMLTRAIN_MAX_LOST_REQUEUES": "abc"})
    assert ended(job, 120) == "FAILED"
    log = (tmp_path / "job.out").read_text()
    assert job_field(job, "Restarts") == "0" and job_field(job, "ExitCode") == "2:0", log
    assert "dmltrain: DMLTRAIN_MAX_LOST_REQUEUES=abc is not a whole number" in log, log
    assert "integer expression expected" not in log and "epoch 1/" not in log


@pytest.mark.parametrize("sent", ["USR1", "TERM"])
def test_a_signal_to_the_batch_shell_alone_checkpoints_requeues_and_ends_equal(
    slurm, tiny_reference, tmp_path, sent
):
    """``scancel --signal=USR1 --batch`` (as ``#SBATCH --signal=B:USR1@...`` sends it), or
    TERM: the batch script passes USR1 on to the training processes, which checkpoint;
    the job requeues into the same run and ends bitwise equal, where the script died of it
    (the job FAILED, and a new sbatch began a new run from step 0)."""
    job = sbatch(tmp_path, *TINY, "--step-sleep", "0.4")
    run = tmp_path / "runs" / f"tiny-{job}"
    out = tmp_path / "job.out"
    wait_for(lambda: out.exists() and "epoch 1/3 step 3/" in out.read_text(), 120, "training")
    subprocess.run(["scancel", f"--signal={sent}", "--batch", job], check=True)
    release_requeues_until_done(job, tmp_path)
    log = out.read_text()
    assert f"the batch script received SIG{sent}; passing SIGUSR1" in log, log[-3000:]
    assert "preempted (SIGUSR1)" in log and "checkpoint saved, requeueing job" in log
    assert job_field(job, "Restarts") == "1" and job_field(job, "JobState") == "COMPLETED"
    assert_same_run(tiny_reference, run)


def test_preempted_job_checkpoints_requeues_resumes_and_completes(slurm, tiny_reference, tmp_path):
    job = sbatch(tmp_path, *TINY, "--step-sleep", "0.4")
    run = tmp_path / "runs" / f"tiny-{job}"  # the default run directory, found again
    out = tmp_path / "job.out"
    wait_for(lambda: out.exists() and "epoch 1/3 step 3/" in out.read_text(), 120, "training")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    release_requeues_until_done(job, tmp_path)
    log = out.read_text()
    assert "preempted (SIGUSR1)" in log and "checkpoint saved, requeueing job" in log
    assert "Exited with exit code" not in log, log[-3000:]  # srun's "error: ..." line
    assert "dmltrain: resuming from" in log and "restart 1" in log
    assert job_field(job, "Restarts") == "1"
    assert_same_run(tiny_reference, run)


def test_a_task_that_starts_two_workers_is_preempted_requeues_and_ends_equal(
    slurm, tiny_reference, tmp_path
):
    """One task of 2 CPUs that starts 2 workers (``srun dmltrain ... --nprocs 2``, as some
    centres' guides write it): the same ranks as srun -n 2; scancel --signal=USR1 reaches
    the task and its workers, which checkpoint; the job requeues and ends equal to the
    uninterrupted run."""
    options = ("--ntasks-per-node", "1", "--cpus-per-task", "2")
    job = sbatch(tmp_path, *TINY, "--nprocs", "2", "--step-sleep", "0.4", options=options)
    out = tmp_path / "job.out"
    wait_for(lambda: out.exists() and "epoch 1/3 step 3/" in out.read_text(), 120, "training")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    release_requeues_until_done(job, tmp_path)
    log = out.read_text()
    assert "2 process(es), launcher slurm, strategy ddp" in log, log[-3000:]
    assert "preempted (SIGUSR1)" in log and "checkpoint saved, requeueing job" in log
    assert "Exited with exit code" not in log, log[-3000:]
    assert "dmltrain: resuming from" in log and job_field(job, "Restarts") == "1"
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def test_a_stream_preempted_in_a_job_resumes_where_each_rank_was(slurm, tmp_path):
    """A training stream (tiny's, stateful) read by 2 loader workers on each of the job's 2
    tasks; scancel --signal=USR1 mid-epoch: the job requeues, each rank goes on from its
    place in its stream, and the run trains the same samples at the same steps and ends
    with the same weights, bitwise, as the same command run here uninterrupted."""
    stream = ["tiny", "--epochs", "3", "--batch-size", "8", "--save-weights", "--progress",
              "log", "--log-every", "1", "--dropout", "0.2", "--stream", "stateful",
              "--num-workers", "2", "--record-samples"]  # fmt: skip
    reference = tmp_path / "reference"
    done = run_cli(*stream, "--nprocs", "2", "--run-dir", str(reference), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    job = sbatch(tmp_path, *stream, "--step-sleep", "0.4")
    out = tmp_path / "job.out"
    wait_for(lambda: out.exists() and "epoch 2/3 step 2/" in out.read_text(), 120, "training")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    release_requeues_until_done(job, tmp_path)
    log = out.read_text()
    assert "preempted (SIGUSR1)" in log and "dmltrain: resuming from" in log, log[-3000:]
    assert "(epoch 2, 0 steps" not in log  # it stopped inside the epoch
    run = tmp_path / "runs" / f"tiny-{job}"
    for rank in (0, 1):
        steps = (run / f"samples.{rank}.txt").read_text().splitlines()
        assert (
            list(dict.fromkeys(steps))
            == (reference / f"samples.{rank}.txt").read_text().splitlines()
        )
    assert_same_run(reference, run)


def test_preempted_array_task_requeues_itself_not_the_array(slurm, tiny_reference, tmp_path):
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
        assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{array}_{task}")


def test_epochs_per_job_chain_through_requeue(slurm, tiny_reference, tmp_path):
    job = sbatch(tmp_path, *TINY, "--epochs-per-job", "1")
    release_requeues_until_done(job, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert log.count("checkpoint saved, requeueing job") == 2
    assert job_field(job, "Restarts") == "2"
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def test_time_limit_stops_the_job_in_time_and_it_resumes(slurm, tiny_reference, tmp_path):
    """No signal at all: dmltrain reads the job's end time from Slurm and stops
    --stop-before-end-minutes before it: here 75 s of a 2-minute job, so a run stops 45 s
    after the job starts, while training alone needs at least 49 s (18 steps of 2.7 s a
    rank). USR1 would come only a second before the limit. A run whose start-up outlasts
    those 45 s (a loaded machine's) takes the short job's deadline instead, a quarter of the
    job before its end (90 s after its start); the sleep is long enough for that one to stop
    it too, so the job stops by its time limit whatever its start-up took."""
    job = sbatch(
        tmp_path,
        *TINY,
        "--step-sleep",
        "2.7",
        "--stop-before-end-minutes",
        "1.25",
        options=("--time", "2", "--signal", "USR1@1"),
    )
    release_requeues_until_done(job, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert "preempted (time limit)" in log and "checkpoint saved, requeueing job" in log
    assert int(job_field(job, "Restarts")) >= 1
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def test_a_short_jobs_early_notice_does_not_preempt_it(slurm, tiny_reference, tmp_path):
    """A 2-minute job of run.sh, whose #SBATCH --signal=USR1@300 Slurm sends early (here
    often during start-up, when it used to kill the job): the job takes it for its own
    deadline (a quarter of its length before the limit) and trains through, 40 s, in this
    one job instead of requeueing itself. When the notice comes is Slurm's (it may come
    only after the run has ended), so the line saying it was deferred is not required."""
    job = sbatch(tmp_path, *TINY, "--step-sleep", "1.0", options=("--time", "2"))
    release_requeues_until_done(job, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert "it checkpoints and stops 30 s before its time limit instead" in log, log[-3000:]
    assert "preempted" not in log and "User defined signal" not in log, log[-3000:]
    assert int(job_field(job, "Restarts")) == 0, log[-3000:]
    assert_same_run(tiny_reference, tmp_path / "runs" / f"tiny-{job}")


def ended(job: str, within: float) -> str:
    """The job's final state; a requeued job is released at once (as an admin would)."""
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    wait_for(lambda: job_field(job, "JobState") in final or _release(job), within, f"job {job}")
    return job_field(job, "JobState")


def _release(job: str) -> bool:
    if job_field(job, "JobState") == "PENDING" and job_field(job, "Reason") == "BeginTime":
        # as release_requeues_until_done: released at once, Slurm may restart the job
        # before its last run has finished completing, and kill it
        time.sleep(5)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
    return False


@pytest.mark.parametrize(("script", "rank"), [("run.sh", "1"), ("run.sh", "0"),
                                             ("torchrun.sh", "1")])  # fmt: skip
def test_a_rank_that_fails_in_its_own_code_fails_the_job_without_a_requeue(
    slurm, tmp_path, script, rank
):
    """A bug on one rank (it raises in train_step): the job fails (exit 1) and is not
    requeued, whichever rank it was: rank 0's status in --status-file is the job's, also
    when the other rank, which lost rank 0, says 5 (and torchrun says 1 for any)."""
    torchrun = script == "torchrun.sh"
    job = sbatch(tmp_path, *TINY, "--raise-rank", rank, "--raise-at-step", "5",
                 script=str(SLURM / script),
                 options=("--ntasks-per-node", "1", "--cpus-per-task", "2") if torchrun else (),
                 env={"DMLTRAIN_NPROC_PER_NODE": "2"} if torchrun else None)  # fmt: skip
    assert ended(job, 120) == "FAILED"
    log = (tmp_path / "job.out").read_text()
    assert job_field(job, "Restarts") == "0" and job_field(job, "ExitCode") == "1:0", log[-3000:]
    assert "requeueing" not in log
    assert f"[rank {rank}] failed: RuntimeError: a bug in train_step at step 5" in log
    if rank == "1":
        assert "[rank 0] stopping: rank 1 on " in log and "not a lost node" in log, log[-3000:]


ON_LOG_COLLECTIVE = """
import torch
import torch.distributed as dist
from tiny import TinyOptions, TinyTrainer

from dmltrain import Callback, register_experiment


class Summed(Callback):
    def on_log(self, trainer, values):  # rank 0 alone runs it: a bug
        dist.all_reduce(torch.ones(3))


class Tiny(TinyTrainer):
    def create_callbacks(self):
        return [Summed()]


EXPERIMENT = register_experiment("on-log-collective", Tiny, TinyOptions)
"""


def test_a_collective_in_an_event_only_rank_0_runs_fails_the_job_without_a_requeue(slurm, tmp_path):
    """A collective in on_log pairs with the other rank's next one (Gloo aborts rank 0):
    a bug, not a lost node; the job fails once, not requeued."""
    (tmp_path / "mine.py").write_text(ON_LOG_COLLECTIVE)
    job = sbatch(tmp_path, "mine.py", "--epochs", "1", "--batch-size", "8", "--log-every", "2",
                 "--hang-timeout", "20")  # fmt: skip
    assert ended(job, 120) == "FAILED"
    log = (tmp_path / "job.out").read_text()
    assert job_field(job, "Restarts") == "0", log[-3000:]
    assert "requeueing" not in log
    assert "rank 0 stopped inside the callback event on_log" in log, log[-3000:]


def test_a_job_that_keeps_losing_a_rank_before_a_checkpoint_stops_requeueing(slurm, tmp_path):
    """Rank 1 is killed (SIGKILL) at step 2 of every job, before any checkpoint: the loss is
    requeued DMLTRAIN_MAX_LOST_REQUEUES times (1 here), then the job ends with status 5."""
    job = sbatch(tmp_path, *TINY, "--die-rank", "1", "--die-at-step", "2",
                 env={"DMLTRAIN_MAX_LOST_REQUEUES": "1"})  # fmt: skip
    assert ended(job, 240) == "FAILED"
    log = (tmp_path / "job.out").read_text()
    assert job_field(job, "Restarts") == "1" and job_field(job, "ExitCode") == "5:0", log[-3000:]
    assert log.count("a rank or node was lost, the checkpoints are intact, requeueing") == 1
    assert "lost 2 times in a row with no checkpoint saved in between; not requeueing" in log
    assert not list(tmp_path.glob(".dmltrain-*"))  # the script's own files are gone

"""``dmltrain sweep`` (dmltrain/tools/sweep_submit.py) on the real local Slurm cluster: a 4-trial
grid as a job array, 2 at a time, one task preempted with scancel --signal=USR1; every
trial ends equal to the same trial run here (``--local``), only the preempted task is
requeued, and submitting the finished sweep again starts nothing; 2 trials packed in each
task. The PBS path with PBS faked (tests/cluster/qsub). An experiment in a file of the
user's (the README's, not installed) swept here, as a Slurm array and as a PBS array."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    TINY_RUN,
    assert_same_run,
    cli_env,
    job_field,
    pbs_env,
    readme_experiment,
    release_requeues_until_done,
    require,
    run_cli,
    wait_for,
)

SPACE = "lr: [0.001, 0.01]\nbatch-size: [8, 16]\n"
TASK = ["--tasks-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00"]


def preempt(task: str, out: Path) -> None:
    """scancel --signal=USR1 TASK until its output says it stopped: with other tasks of
    the array pending behind --max-parallel, slurmctld may answer "Job can not be altered
    now" although the signal reached the running step."""
    for _ in range(5):
        subprocess.run(["scancel", "--signal=USR1", task], capture_output=True)
        try:
            wait_for(lambda: "preempted (SIGUSR1)" in out.read_text(), 10, f"{task} to stop")
            return
        except AssertionError:
            continue
    raise AssertionError(f"{task} did not stop on SIGUSR1:\n{out.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """The 4 trials run on this machine, 2 at a time (--local): what each must equal."""
    cwd = tmp_path_factory.mktemp("sweep-here")
    (cwd / "sweep.yaml").write_text(SPACE)
    done = run_cli("sweep", *TINY_RUN, "--space", "sweep.yaml", "--name", "here", "--local",
                   "--parallel", "2", cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(": done (exit status 0)") == 4, done.stdout
    return cwd / "runs" / "here"


def test_a_grid_as_an_array_equals_its_trials_run_here_and_a_preempted_one_resumes(
    slurm, here, tmp_path
):
    (tmp_path / "sweep.yaml").write_text(SPACE)
    sweep = ["sweep", *TINY_RUN, "--space", "sweep.yaml"]

    slow = [*sweep, "--step-sleep", "0.3", "--first-job-only", "--name", "array"]
    done = run_cli(*slow, "--max-parallel", "2", *TASK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    array = re.search(r"submitted job array (\d+) \(trials 0,1,2,3%2\)", done.stdout).group(1)
    out = tmp_path / "runs" / "array" / "trial-1" / f"slurm-{array}_1.out"
    wait_for(lambda: out.exists() and "epoch 1/3 step 3/" in out.read_text(), 240, "trial 1")
    preempt(f"{array}_1", out)
    release_requeues_until_done(f"{array}_1", tmp_path)
    for task in (0, 2, 3):
        wait_for(lambda t=task: job_field(f"{array}_{t}", "JobState") == "COMPLETED", 240, "tasks")
        assert job_field(f"{array}_{task}", "Restarts") == "0"
    assert job_field(f"{array}_1", "Restarts") == "1"
    assert "checkpoint saved, requeueing job" in out.read_text()
    for trial in range(4):
        ran = tmp_path / "runs" / "array" / f"trial-{trial}"
        assert_same_run(here / f"trial-{trial}", ran)
        assert json.loads((ran / "outcome.json").read_text())["status"] == "done"

    status = run_cli("sweep", "status", "runs/array", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert [line.split()[-2] for line in status.stdout.splitlines()[1:5]] == ["done"] * 4
    assert re.search(r"best trial \d \(val_loss [\d.]+\)", status.stdout), status.stdout
    assert (tmp_path / "runs" / "array" / "trials.csv").read_text().count(",done") == 4
    plotted = run_cli("plot", "runs/array", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "runs" / "array" / "sweep_curves.png").stat().st_size > 10_000

    again = run_cli(*slow, "--max-parallel", "2", *TASK, cwd=tmp_path)
    assert again.returncode == 0 and "every trial is done; nothing to run" in again.stdout
    record = json.loads((tmp_path / "runs" / "array" / "sweep.json").read_text())
    assert record["jobs"] == [array]  # nothing more was submitted
    assert Path(tmp_path / "runs" / "array" / "sweep-slurm.sh").is_file()


def test_two_trials_per_task_side_by_side_stop_together_and_equal_their_runs_here(
    slurm, here, tmp_path
):
    """2 array tasks of 2 CPUs, each running 2 trials as 2 processes of 1 thread; task 0
    is preempted: the signal reaches both its trials, which stop, and the task requeues."""
    (tmp_path / "sweep.yaml").write_text(SPACE)
    task = ["--cpus-per-task", "2", "--time", "00:10:00", "--trials-per-task", "2"]
    slow = ["--step-sleep", "0.3", "--first-job-only"]
    args = ["sweep", *TINY_RUN, *slow, "--space", "sweep.yaml", "--name", "packed", *task]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    array = re.search(r"submitted job array (\d+) \(tasks 0,1\)", done.stdout).group(1)
    sweep = tmp_path / "runs" / "packed"
    out = sweep / f"task-0-slurm-{array}.out"
    wait_for(lambda: out.exists() and out.read_text().count("step 3/") >= 2, 240, "task 0")
    preempt(f"{array}_0", out)
    release_requeues_until_done(f"{array}_0", tmp_path)
    wait_for(lambda: job_field(f"{array}_1", "JobState") == "COMPLETED", 240, "task 1")
    log = out.read_text()
    assert log.count("preempted (SIGUSR1)") == 2 and "requeueing job" in log, log[-3000:]
    assert "task 0: trials [0, 1] ended with [3, 3]" in log, log[-3000:]
    later = (sweep / f"task-1-slurm-{array}.out").read_text()
    assert "task 1 starts trial 2" in later and "task 1 starts trial 3" in later
    for trial in range(4):
        assert_same_run(here / f"trial-{trial}", sweep / f"trial-{trial}")
        config = (sweep / f"trial-{trial}" / "config.yaml").read_text()
        assert "threads: 1" in config  # the task's 2 CPUs split between its 2 trials


def test_a_pbs_array_runs_every_trial_and_a_finished_sweep_starts_nothing(here, tmp_path):
    """PBS faked (tests/cluster/qsub runs the subjobs of qsub -J one after another); one
    process a trial (casper.sh: torchrun --standalone), as here."""
    env = pbs_env(tmp_path)
    (tmp_path / "sweep.yaml").write_text(SPACE)
    args = [sys.executable, "-m", "dmltrain", "sweep", *TINY_RUN, "--space", "sweep.yaml",
            "--name", "pbs", "--system", "pbs", "--script", "casper"]  # fmt: skip
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"submitted array job \d+\[\]\.fakepbs \(trials 0-3\)", done.stdout)
    for trial in range(4):
        assert_same_run(here / f"trial-{trial}", tmp_path / "runs" / "pbs" / f"trial-{trial}")
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "every trial is done; nothing to run" in again.stdout


@pytest.mark.parametrize(
    "search", [[], ["--search", "random", "--trials", "4"]], ids=["grid", "search"]
)
def test_the_array_scripts_pass_shellcheck(tmp_path, search):
    """A grid's scripts, and a search's (dmltrain/tools/search.py): each task asks for its
    trial first."""
    require("shellcheck")
    (tmp_path / "sweep.yaml").write_text(SPACE)
    base = ["sweep", "tiny", "--space", "sweep.yaml", *search, "--dry-run"]
    for extra in (["--name", "a"], ["--name", "b", "--trials-per-task", "2"],
                  ["--name", "c", "--system", "pbs"]):  # fmt: skip
        done = run_cli(*base, *extra, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    kinds = {"a": "slurm", "b": "slurm", "c": "pbs"}
    scripts = [tmp_path / "runs" / name / f"sweep-{kind}.sh" for name, kind in kinds.items()]
    subprocess.run(["shellcheck", *map(str, scripts)], check=True)
    asked = 'asked=$(dmltrain sweep ask "$sweep" "$trial")'
    assert (asked in scripts[0].read_text()) == bool(search)
    assert (asked in scripts[2].read_text()) == bool(search)
    packed = scripts[1].read_text()
    assert 'set -- sweep task "$sweep" "$trial" 2' in packed
    assert "#SBATCH --ntasks-per-node=1" in packed


LINE_SPACE = "lr: [0.05, 0.1]\n"
LINE = ["--epochs", "2", "--batch-size", "32", "--progress", "off"]


@pytest.fixture(scope="module")
def line_here(tmp_path_factory):
    """``dmltrain sweep my_experiment.py --local``: the README's experiment file (not an
    installed package) swept here; each trial runs the file by its absolute path."""
    cwd = tmp_path_factory.mktemp("line-here")
    source = readme_experiment(cwd)
    (cwd / "sweep.yaml").write_text(LINE_SPACE)
    done = run_cli("sweep", "my_experiment.py", *LINE, "--space", "sweep.yaml", "--name", "here",
                   "--local", cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(": done (exit status 0)") == 2, done.stdout
    sweep = cwd / "runs" / "here"
    for trial in range(2):
        assert (sweep / f"trial-{trial}" / "args").read_text().split()[0] == str(source)
    return sweep


def test_an_experiment_file_started_as_a_script_sweeps_here(line_here, tmp_path):
    """``python my_experiment.py sweep line``: the trials run that file too."""
    readme_experiment(tmp_path)
    (tmp_path / "sweep.yaml").write_text(LINE_SPACE)
    done = subprocess.run(
        [sys.executable, "my_experiment.py", "sweep", "line", *LINE, "--space", "sweep.yaml",
         "--name", "script", "--local"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for trial in range(2):
        ran = tmp_path / "runs" / "script" / f"trial-{trial}"
        assert (ran / "args").read_text().split()[0] == str(tmp_path / "my_experiment.py")
        assert_same_run(line_here / f"trial-{trial}", ran)


def test_an_experiment_file_sweeps_as_a_slurm_array_and_a_pbs_array(slurm, line_here, tmp_path):
    readme_experiment(tmp_path)
    (tmp_path / "sweep.yaml").write_text(LINE_SPACE)
    args = ["sweep", "my_experiment.py", *LINE, "--space", "sweep.yaml"]
    done = run_cli(*args, "--name", "array", *TASK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    array = re.search(r"submitted job array (\d+) \(trials 0,1\)", done.stdout).group(1)
    for task in (0, 1):
        wait_for(lambda t=task: job_field(f"{array}_{t}", "JobState") == "COMPLETED", 240, "tasks")
    env = pbs_env(tmp_path)
    pbs = subprocess.run(
        [sys.executable, "-m", "dmltrain", *args, "--name", "pbs", "--system", "pbs", "--script",
         "casper"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert pbs.returncode == 0, pbs.stderr[-3000:]
    for trial in range(2):
        assert_same_run(
            line_here / f"trial-{trial}", tmp_path / "runs" / "array" / f"trial-{trial}"
        )
        assert_same_run(line_here / f"trial-{trial}", tmp_path / "runs" / "pbs" / f"trial-{trial}")

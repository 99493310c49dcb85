"""`dmltrain submit --dry-run`: the scripts it writes, and its errors. (Real submissions:
tests/cluster/test_slurm.py on the local Slurm cluster, tests/cluster/test_pbs.py with a
stand-in qsub.)"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env, readme_experiment, require, run_cli

from dmltrain.config import time_limit_seconds


def dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    done = run_cli("submit", *args, "--dry-run", cwd=tmp_path)
    scripts = list(tmp_path.glob("runs/*/submit-*.sh"))
    return done, scripts[0].read_text() if scripts else ""


def test_slurm_torchrun_script_has_one_task_per_node_and_the_command(tmp_path):
    done, script = dry_run(
        tmp_path,
        "slurm",
        "tiny",
        "--epochs",
        "7",
        "--script",
        "torchrun",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--cpus-per-task",
        "8",
        "--time",
        "2:00:00",
        "--partition",
        "gpu",
        "--account",
        "abc",
    )
    assert done.returncode == 0, done.stderr
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --time=2:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=abc",
        "export DMLTRAIN_NPROC_PER_NODE=4",
    ]:
        assert line in script.splitlines(), line
    run_dir = next(tmp_path.glob("runs/tiny-*"))
    assert f"set -- tiny --epochs 7 --run-dir {run_dir}" in script
    assert script in done.stdout  # printed, not submitted
    assert script.count("#SBATCH --nodes") == 1
    require("shellcheck")
    subprocess.run(["shellcheck", str(run_dir / "submit-slurm.sh")], check=True)


def test_pbs_derecho_select_line(tmp_path):
    done, script = dry_run(
        tmp_path,
        "pbs",
        "tiny",
        "--nodes",
        "4",
        "--gpus-per-node",
        "4",
        "--cpus-per-task",
        "16",
        "--time",
        "12:00:00",
        "--queue",
        "preempt",
    )
    assert done.returncode == 0, done.stderr
    assert "#PBS -l select=4:ncpus=64:ngpus=4:mpiprocs=4" in script.splitlines()
    assert "#PBS -l walltime=12:00:00" in script.splitlines()
    assert "#PBS -q preempt" in script.splitlines()


@pytest.mark.parametrize(
    "args, message",
    [
        (["slurm", "tiny", "--run-dir", "x"], "leave out --run-dir"),
        (["slurm", "tiny", "--time", "3h"], "--time '3h': write [D-]HH:MM:SS"),
        (["pbs", "tiny", "--script", "casper", "--nodes", "2"], "casper runs on one node"),
        (["slurm", "tiny", "--script", "casper"], "--script casper is not a slurm script"),
        (["slurm", "tiny", "--nodes", "0"], "--nodes must not be 0"),
        (["slurm", "tiny", "--cpus-per-task", "0"], "--cpus-per-task must not be 0"),
        (["slurm", "tiny", "--env", "/nonexistent"], "--env /nonexistent: no environment there"),
        (["slurm", "tiny", "--epochs", "-1"], "--epochs"),
        (["slurm", "nosuch"], "nosuch"),
        (["pbs", "tiny", "--chain", "0"], "--chain 0: give the number of jobs, 1 or more"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    done, script = dry_run(tmp_path, *args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert script == ""


def test_without_sbatch_it_says_where_to_run(tmp_path):
    (tmp_path / "bin").mkdir()  # a PATH with no sbatch on it
    done = subprocess.run(
        [sys.executable, "-m", "dmltrain", "submit", "slurm", "tiny"],
        cwd=tmp_path,
        env=cli_env(PATH=str(tmp_path / "bin")),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "sbatch not found: run this on a slurm login node, or add --dry-run" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_time_limit_formats():
    assert time_limit_seconds("30") == 30 * 60
    assert time_limit_seconds("10:30") == 10 * 60 + 30
    assert time_limit_seconds("02:00:00") == 2 * 3600
    assert time_limit_seconds("1-02") == 26 * 3600
    assert time_limit_seconds("1-00:30:00") == 24 * 3600 + 30 * 60


def test_a_pbs_job_of_an_experiment_file_runs_that_file_by_its_path(tmp_path):
    source = readme_experiment(tmp_path)
    done, script = dry_run(tmp_path, "pbs", "my_experiment.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    assert f"set -- {source} --epochs 2 --run-dir " in script


TWO = """from dmltrain import BaseTrainer, register_experiment
from dmltrain.cli import main

class T(BaseTrainer):
    pass

A = register_experiment("a", T)
B = register_experiment("b", T)

if __name__ == "__main__":
    raise SystemExit(main(experiments=[A, B]))
"""


def test_an_experiment_no_job_could_start_is_one_line(tmp_path):
    """A script that registers two experiments: ``dmltrain FILE.py`` (what a job would
    run) cannot tell which, so submitting one from it is refused; nothing is written."""
    (tmp_path / "two.py").write_text(TWO)
    done = subprocess.run([sys.executable, "two.py", "submit", "slurm", "a", "--dry-run"],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"dmltrain: error: {tmp_path / 'two.py'} registers 2 "), (
        done.stderr
    )
    assert "put 'a' in a file of its own" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_pbs_asks_four_cpus_a_process_or_the_whole_node(tmp_path):
    """ncpus = processes a node x --cpus-per-task (4 by default, as slurm/run.sh asks of
    Slurm): one CPU a GPU process would leave its loader workers none."""
    for folder in "abc":
        (tmp_path / folder).mkdir()
    done, script = dry_run(tmp_path / "a", "pbs", "tiny", "--nodes", "2", "--gpus-per-node", "4")
    assert done.returncode == 0, done.stderr
    assert "#PBS -l select=2:ncpus=16:ngpus=4:mpiprocs=4" in script.splitlines()
    assert "place" not in script
    done, script = dry_run(tmp_path / "b", "pbs", "tiny", "--gpus-per-node", "4", "--whole-node")
    assert done.returncode == 0, done.stderr
    lines = script.splitlines()
    assert "#PBS -l select=1:ncpus=64:ngpus=4:mpiprocs=4" in lines  # derecho.sh's node
    assert "#PBS -l place=scatter:excl" in lines
    done, script = dry_run(tmp_path / "c", "slurm", "tiny", "--whole-node")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --exclusive" in script.splitlines()


# Values a hostile neighbour or a pasted command could carry into a batch script.
INJECTED = "x\necho INJECTED > {mark}"


@pytest.mark.parametrize(
    "system, flag",
    [
        ("slurm", "--job-name"),
        ("slurm", "--partition"),
        ("slurm", "--account"),
        ("pbs", "--account"),
        ("pbs", "--job-name"),
        ("slurm", "--env"),
        ("pbs", "--best-metric"),  # a flag of the experiment's
    ],
)
def test_a_value_with_a_newline_is_refused_and_writes_no_script(tmp_path, system, flag):
    mark = tmp_path / "INJECTED"
    done, script = dry_run(tmp_path, system, "tiny", flag, INJECTED.format(mark=mark))
    assert done.returncode == 2, done.stderr
    assert "holds a newline or another control character" in done.stderr
    assert "Traceback" not in done.stderr and script == "" and not mark.exists()


def test_an_env_that_is_shell_code_is_refused(tmp_path):
    done, script = dry_run(tmp_path, "slurm", "tiny", "--env", f"$(touch {tmp_path}/F)")
    assert done.returncode == 2 and "no conda env's name" in done.stderr
    assert script == "" and not (tmp_path / "F").exists()

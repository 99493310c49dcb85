"""The batch scripts read values a hostile neighbour can write: the job's environment
(DMLTRAIN_ENV, DMLTRAIN_ARGS) and files in the shared submit folder (the status file,
the requeue counter). Each reaches the command as words or is refused; none runs as shell
code. The scripts run under bash as the batch system runs them; they stop at the refusal,
before any launcher would start (the blocks are the scripts' own: sync.py --check in
test_slurm.py holds each copy to its block)."""

import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, cli_env, pbs_env, require

SLURM = ROOT / "slurm"
SCRIPTS = ["run.sh", "torchrun.sh", "horovod.sh", "pbs/derecho.sh", "pbs/casper.sh"]


def bash(script: Path | str, cwd: Path, env: dict[str, str], *args: str):
    command = ["bash", str(script), *args] if isinstance(script, Path) else ["bash", "-c", script]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_env_that_is_shell_code_is_refused(tmp_path, script):
    mark = tmp_path / "RAN"
    env = cli_env(
        DMLTRAIN_ENV=f"$(touch {mark})",
        SLURM_JOB_ID="7",
        PBS_JOBID="7.fake",
        PBS_O_WORKDIR=str(tmp_path),
    )
    done = bash(SLURM / script, tmp_path, env, "tiny")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is neither a venv's directory, a conda env's directory nor" in done.stderr
    assert not mark.exists()


@pytest.mark.parametrize("script", ["derecho.sh", "casper.sh"])
def test_dmltrain_args_reach_the_command_as_words(tmp_path, script):
    """``$(...)`` in DMLTRAIN_ARGS is two words of the command line: the experiment's
    parser refuses them, and nothing runs."""
    mark = tmp_path / "RAN"
    env = pbs_env(
        tmp_path, DMLTRAIN_ARGS=f"tiny --epochs 1 $(touch {mark})", NGPUS="2"
    )  # casper.sh: processes per node from the job's GPUs
    done = subprocess.run(
        ["qsub", str(SLURM / "pbs" / script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = next(tmp_path.glob("pbs-*.out")).read_text()
    assert f"unrecognized arguments: $(touch {mark})" in out, out[-3000:]
    assert not mark.exists()


def requeue(tmp_path: Path, lost: str, status_lines: str) -> subprocess.CompletedProcess:
    """The scripts' status-file and requeue blocks as run.sh runs them after srun returned
    ``5`` (a rank was lost), with hostile files in the submit folder. No scontrol here: the
    requeue itself fails and says how to resubmit."""
    (tmp_path / ".dmltrain-lost-7").write_text(lost)
    status_file = tmp_path / ".dmltrain-status-7"
    status_file.write_text(status_lines)
    blocks = SLURM / "blocks"
    script = "\n".join(
        [
            "job=7",
            f"status_file={status_file}",
            "status=5",
            (blocks / "status-file.sh").read_text(),
            (blocks / "slurm-requeue.sh").read_text(),
        ]
    )
    return bash(script, tmp_path, cli_env(SLURM_SUBMIT_DIR=str(tmp_path), PATH="/usr/bin:/bin"))


def test_a_requeue_counter_that_is_not_digits_is_not_evaluated(tmp_path):
    mark = tmp_path / "RAN"
    done = requeue(tmp_path, f"a[$(touch {mark})]", "")
    assert not mark.exists()
    assert "holds no count (not digits); counting from 1" in done.stderr
    assert (tmp_path / ".dmltrain-lost-7").read_text() == "1\n"
    assert "requeueing job 7" in done.stdout


def test_a_status_file_that_is_not_digits_is_not_used(tmp_path):
    mark = tmp_path / "RAN"
    done = requeue(tmp_path, "2", f"a[$(touch {mark})]\n0\n")
    assert not mark.exists()
    assert "held no status (not digits); keeping the launcher's, 5" in done.stderr
    assert (tmp_path / ".dmltrain-lost-7").read_text() == "3\n"  # the launcher's 5 counted


def test_a_count_in_the_file_goes_on_and_ends_the_requeues(tmp_path):
    done = requeue(tmp_path, "3", "5\n0\n")
    assert done.returncode == 5
    assert "lost 4 times in a row" in done.stdout


def test_chain_options_reach_sbatch_as_words(tmp_path):
    """DMLTRAIN_SBATCH holding ``$(...)``: words sbatch refuses; nothing runs, no job."""
    require("sbatch")
    mark = tmp_path / "RAN"
    env = cli_env(DMLTRAIN_SBATCH=f"--partition=x $(touch {mark})")
    done = bash(SLURM / "chain.sh", tmp_path, env, "2", "tiny")
    assert done.returncode != 0
    assert not mark.exists() and "chain.sh: job 1/2" not in done.stdout

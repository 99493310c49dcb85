"""Bad input and faults that must lose no work and never loop: each ends with one line and
its documented exit status, and what was in the run directory before is there after,
byte for byte. (The Slurm side, a failing rank's job not requeued: test_slurm.)"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, assert_same_run, cli_env, run_cli
from test_checkpoint import small_disk  # noqa: F401 (a fixture)

from dmltrain import rundir

STEPS = [*TINY, "--epochs", "1", "--checkpoint-every-steps", "4"]


def contents(directory: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target under ``directory``."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            found[name] = str(path.readlink())
        elif path.is_file():
            found[name] = path.read_bytes()
    return found


def one_error(stderr: str) -> str:
    """The one ``dmltrain: error:`` line of a run that stopped on bad input."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("dmltrain: error:")]
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One epoch of 12 steps, a checkpoint every 4 (3 checkpoints)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    done = run_cli(*STEPS, "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("damage", ["truncated", "newer format"])
def test_checkpoints_that_do_not_load_stop_the_run_and_nothing_is_touched(
    finished, tmp_path, damage
):
    """Every checkpoint truncated, or written by a newer dmltrain: extending the run stops
    with one line (exit 2) instead of training from step 0 and rotating them away."""
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(run)], check=True)
    checkpoints = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    assert len(checkpoints) == 3
    for path in checkpoints:
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:1000])
        else:
            state = torch.load(path, weights_only=True)
            torch.save({**state, "format_version": 2}, path)
    before = contents(run)
    done = run_cli(*STEPS, "--epochs", "3", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_error(done.stderr)
    if damage == "truncated":
        assert f"none of the 3 checkpoint(s) in {run / 'checkpoints'} loads" in line, line
        assert "nothing was changed" in line and "pass a new --run-dir" in line
    else:  # the newest, not skipped for an older one
        assert f"checkpoint {checkpoints[-1]} has format 2" in line and "upgrade" in line, line
    assert contents(run) == before


def test_two_runs_in_one_run_directory_one_is_refused(tmp_path):
    """Started together into one --run-dir: one trains, the other stops at once with one
    line (exit 2) and writes nothing; the directory holds the one run's records."""
    run = tmp_path / "run"
    args = [*STEPS, "--step-sleep", "0.1", "--run-dir", str(run)]
    procs = {
        lr: subprocess.Popen(
            [sys.executable, "-m", "dmltrain", *args, "--lr", lr],
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for lr in ("0.001", "0.01")
    }
    ends = {}
    for lr, proc in procs.items():
        err = proc.communicate(timeout=300)[1]
        ends[lr] = (proc.returncode, err)
    (winner,) = [lr for lr, (code, _) in ends.items() if code == 0]
    (loser,) = [lr for lr, (code, _) in ends.items() if code != 0]
    assert ends[loser][0] == 2
    line = one_error(ends[loser][1])
    assert f"run directory {run} is in use by another run" in line, line
    assert f"lr: {winner}" in (run / "config.yaml").read_text()
    assert len((run / "training_log.csv").read_text().splitlines()) == 2
    assert json.loads((run / "outcome.json").read_text())["status"] == "done"


def test_default_run_directories_never_collide(tmp_path, monkeypatch):
    """Two runs started in the same second get runs/NAME-TIME and runs/NAME-TIME-2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-000000")
    first, second = rundir.default_path("tiny", None), rundir.default_path("tiny", None)
    assert (first, second) == ("runs/tiny-20260101-000000", "runs/tiny-20260101-000000-2")
    assert Path(first).is_dir() and Path(second).is_dir()
    assert rundir.default_path("tiny", "123") == "runs/tiny-123"  # a job's, on every requeue


def test_a_full_disk_at_an_epochs_end_is_one_line_and_the_log_is_written_later(small_disk):  # noqa: F811
    """The disk is full from step 3 to step 15: the epoch-1 row of training_log.csv cannot
    be written (one warning), epoch 2 writes both rows; no partial file is left, and the run
    ends as one that never lacked space."""
    run, reference = small_disk / "run", small_disk / "reference"
    args = [*TINY, "--epochs", "2", "--features", "2048", "--checkpoint-every-steps", "2"]
    done = run_cli(*args, "--fill-disk-at-step", "3", "--free-disk-at-step", "15",
                   "--fill-disk-leave", "0", "--run-dir", str(run), cwd=small_disk)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "training_log.csv" in line]
    assert f"cannot write {run / 'training_log.csv'}: no space left on its file system" in line
    assert "writes it again at the next epoch" in line, line
    assert not [p.name for p in run.rglob(".*tmp*")]
    ok = run_cli(*args, "--run-dir", str(reference), cwd=small_disk)
    assert ok.returncode == 0, ok.stderr
    assert_same_run(reference, run)


def test_a_disk_full_to_the_end_leaves_the_records_whole(small_disk):  # noqa: F811
    """The second job of a run fills the disk and it stays full: its last checkpoint cannot
    be written (exit 2, one line); outcome.json and training_log.csv hold the first job's
    records, whole, and no partial file is left."""
    run = small_disk / "run"
    args = [*TINY, "--epochs", "1", "--features", "2048", "--run-dir", str(run)]
    assert run_cli(*args, cwd=small_disk).returncode == 0
    before = {name: (run / name).read_bytes() for name in ("outcome.json", "training_log.csv")}
    done = run_cli(*args, "--epochs", "2", "--fill-disk-at-step", "14", "--fill-disk-leave", "0",
                   cwd=small_disk)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "no space left for checkpoint" in one_error(done.stderr)
    assert {name: (run / name).read_bytes() for name in before} == before
    assert json.loads(before["outcome.json"])["status"] == "done"
    assert not [p.name for p in run.rglob(".*tmp*")]


def test_a_status_file_in_a_missing_folder_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    status = tmp_path / "nodir" / "status"
    done = run_cli(*STEPS, "--status-file", str(status), "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2
    assert f"--status-file {status}: the folder {status.parent} does not exist" in one_error(
        done.stderr
    )
    assert not run.exists()


@pytest.mark.parametrize("where", ["train_step", "create_model"])
def test_a_rank_that_fails_in_its_own_code_is_named_and_the_run_fails(tmp_path, where):
    """Rank 1 raises (a bug): rank 0 stops at once with a line naming rank 1 and its error,
    exit status 1, not 5 (a lost peer, which the batch scripts requeue); the record says
    failed."""
    run = tmp_path / "run"
    step = "5" if where == "train_step" else "-2"
    done = run_cli(*STEPS, "--nprocs", "2", "--raise-rank", "1", "--raise-at-step", step,
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "[rank 0] stopping:" in line]
    assert f"rank 1 on {cli_host()} failed: RuntimeError: a bug in {where}" in line, line
    assert "not a lost node, so nothing is requeued" in line and line.endswith("(exit status 1)")
    assert "exit status 5" not in done.stderr
    assert json.loads((run / "outcome.json").read_text())["status"] == "failed"


def cli_host() -> str:
    from dmltrain.launch import hostname

    return hostname()

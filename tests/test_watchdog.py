"""The hang watchdog (dmltrain/features/watchdog.py), with 2 real processes: a rank blocked in
train_step on purpose is named, its stack shows the blocking line, every rank's stacks
are written and the run ends with the lost-peer status (5), which the batch scripts
requeue; a long but healthy step is not a hang."""

import json
import pickle
import subprocess
import sys
import time

import pytest
import torch
from helpers import cli_env, run_cli

from dmltrain.features.watchdog import limits

# 2 processes x 4: 12 steps an epoch
BASE = ["tiny", "--nprocs", "2", "--batch-size", "4", "--epochs", "1", "--progress", "off"]


def test_the_timeout_is_the_flag_or_stays_below_the_collectives_own():
    assert limits(5.0, 60.0) == (5.0, float("inf"))
    assert limits(0.0, 300.0) == (180.0, 240.0)  # auto: a few minutes, below --dist-timeout
    assert limits(0.0, 60.0) == (48.0, 48.0)
    assert limits(0.0, 20.0) == (16.0, 16.0)


def test_a_blocked_rank_is_named_with_its_stack_and_the_run_stops_for_requeue(tmp_path):
    """Rank 1 sleeps in train_step; rank 0 waits in the step's all-reduce. Both write their
    stacks after 3 s; rank 0's collective gives up after --dist-timeout and its line says
    where rank 1 is."""
    began = time.monotonic()
    blocked = ["--hang-timeout", "3", "--dist-timeout", "10", "--pause-at-step", "5",
               "--pause-seconds", "120", "--pause-rank", "1", "--run-dir", "run"]  # fmt: skip
    done = run_cli(*BASE, *blocked, cwd=tmp_path)
    assert done.returncode == 5, done.stderr[-3000:]
    assert time.monotonic() - began < 90  # not the 120 s the rank sleeps
    (line,) = [line for line in done.stderr.splitlines() if "stopping" in line]
    assert "lost contact with rank 1" in line and "rank 1 on " in line, line
    assert "is inside train_step for" in line and "tiny.py:" in line and "hang" in line, line
    assert "rank 0 on" not in line, line  # it waits where the others would: not named
    hang = tmp_path / "run" / "hang"
    stacks = (hang / "rank-1.txt").read_text()
    where = json.loads(stacks.splitlines()[0])
    assert where["rank"] == 1 and where["steps"] == 4 and where["in_train_step_s"] >= 3
    assert where["frame"].endswith("in train_step")
    assert "time.sleep(o.pause_seconds)" in stacks  # the blocking frame
    waiting = json.loads((hang / "rank-0.txt").read_text().splitlines()[0])
    assert waiting["in_train_step_s"] is None and waiting["steps"] == 4


def test_a_hang_no_collective_ends_stops_the_run_itself(tmp_path):
    """One process blocked in train_step: no collective will give up, so the watchdog
    prints the line and leaves with status 5."""
    blocked = ["tiny", "--epochs", "1", "--batch-size", "8", "--progress", "off",
               "--hang-timeout", "2", "--pause-at-step", "3", "--pause-seconds", "120",
               "--run-dir", "run"]  # fmt: skip
    done = run_cli(*blocked, cwd=tmp_path, timeout=60)
    assert done.returncode == 5, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "hang:" in line]
    assert "no step ended for" in line and "rank 0 on " in line, line
    assert "inside train_step" in line and "exit status 5" in line, line
    assert (tmp_path / "run" / "hang" / "report.txt").read_text().strip() == line


def test_a_long_healthy_step_is_not_a_hang(tmp_path):
    """Steps of 0.2 s make the timeout 4 s (20x the slowest); a 3 s step on every rank is
    longer than --hang-timeout, not a hang."""
    long_step = ["--hang-timeout", "2", "--step-sleep", "0.2", "--pause-at-step", "6",
                 "--pause-seconds", "3", "--run-dir", "run"]  # fmt: skip
    done = run_cli(*BASE, *long_step, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hang" not in done.stderr and not (tmp_path / "run" / "hang").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_with_nccl_a_hang_also_dumps_the_flight_recorder(tmp_path):
    """One NCCL rank (torchrun, DDP: a real NCCL process group on one GPU) blocked in
    train_step: besides its stacks it writes NCCL's record of the last collectives."""
    blocked = ["tiny", "--strategy", "ddp", "--epochs", "1", "--batch-size", "8",
               "--progress", "off", "--hang-timeout", "3", "--pause-at-step", "3",
               "--pause-seconds", "120", "--run-dir", "run"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
         "-m", "dmltrain", *blocked],
        cwd=tmp_path, env=cli_env(gpus=True), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "no step ended for" in done.stderr, done.stderr[-3000:]
    hang = tmp_path / "run" / "hang"
    assert "time.sleep(o.pause_seconds)" in (hang / "rank-0.txt").read_text()
    record = pickle.loads((hang / "nccl-rank-0.pkl").read_bytes())
    assert record["entries"], record.keys()  # setup's all-gather at least

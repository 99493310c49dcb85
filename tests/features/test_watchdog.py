"""The hang watchdog (dmltrain/features/watchdog.py), with 2 real processes: a rank blocked in
train_step on purpose is named, its stack shows the blocking line, every rank's stacks
are written and the run ends with the lost-peer status (5), which the batch scripts
requeue; a long but healthy step is not a hang."""

import json
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import cli_env, run_cli, start_ranks

from dmltrain.features.monitor import StepClock
from dmltrain.features.watchdog import Watchdog, limits
from dmltrain.runtime import peers

# 2 processes x 4: 12 steps an epoch
BASE = ["tiny", "--nprocs", "2", "--batch-size", "4", "--epochs", "1", "--progress", "off"]


def test_the_timeout_is_the_flag_or_stays_below_the_collectives_own():
    assert limits(5.0, 60.0) == (5.0, float("inf"))
    assert limits(0.0, 300.0) == (180.0, 240.0)  # auto: a few minutes, below --dist-timeout
    assert limits(0.0, 60.0) == (48.0, 48.0)
    assert limits(0.0, 20.0) == (16.0, 16.0)


def test_a_blocked_rank_is_named_with_its_stack_and_the_run_stops_for_requeue(tmp_path):
    """Rank 1 sleeps in train_step; rank 0 waits in the step's all-reduce. Both write their
    stacks after 3 s, and rank 0 names rank 1 and where it is at once: the run ends long
    before --dist-timeout (60 s) would end the all-reduce."""
    began = time.monotonic()
    blocked = ["--hang-timeout", "3", "--dist-timeout", "60", "--pause-at-step", "5",
               "--pause-seconds", "120", "--pause-rank", "1", "--run-dir", "run"]  # fmt: skip
    done = run_cli(*BASE, *blocked, cwd=tmp_path)
    assert done.returncode == 5, done.stderr[-3000:]
    assert time.monotonic() - began < 50  # not the 60 s of the all-reduce, nor 120 s
    (line,) = [line for line in done.stderr.splitlines() if "hang:" in line]
    assert "rank 1 on " in line and "is inside train_step for" in line, line
    assert "tiny_faults.py:" in line and "exit status 5" in line, line
    assert "rank 0 on" not in line, line  # it waits where the others would: not named
    hang = tmp_path / "run" / "hang"
    assert (hang / "report.txt").read_text().strip() == line
    stacks = (hang / "rank-1.txt").read_text()
    where = json.loads(stacks.splitlines()[0])
    assert where["rank"] == 1 and where["steps"] == 4 and where["in_train_step_s"] >= 3
    assert where["frame"].endswith("in before_step")  # the fault, called by train_step
    assert "time.sleep(o.pause_seconds)" in stacks  # the blocking frame
    waiting = json.loads((hang / "rank-0.txt").read_text().splitlines()[0])
    assert waiting["in_train_step_s"] is None and waiting["steps"] == 4


@pytest.mark.parametrize(("frozen", "timeout"), [(1, "20"), (0, "10")])
def test_a_frozen_rank_is_named_with_its_host_and_the_run_stops_within_a_minute(
    tmp_path, frozen, timeout
):
    """One of 2 ranks stops itself (SIGSTOP: its watchdog thread too, so it writes no
    stack) with --hang-timeout 20 (10 for rank 0, to save time) and the default
    --dist-timeout (300 s). The other names it, its host and its state, and leaves with
    status 5 within 60 s. When rank 0 is the frozen one, rank 1 reports in its place.
    The frozen rank is killed by the test (under srun, by --wait; under torchrun, by its
    agent)."""
    run = tmp_path / "run"
    args = ["tiny", *BASE[3:], "--hang-timeout", timeout, "--pause-at-step", "5", "--pause-stops",
            "--pause-seconds", "1", "--pause-rank", str(frozen), "--run-dir", str(run)]  # fmt: skip
    ranks = start_ranks([sys.executable, "-m", "dmltrain", *args], tmp_path)
    survivor = ranks[1 - frozen]
    began = None
    try:
        while began is None:  # the frozen rank stopped itself: the clock starts
            if peers.local_state(ranks[frozen].pid) == "stopped":
                began = time.monotonic()
            assert survivor.poll() is None and ranks[frozen].poll() is None
            time.sleep(0.1)
        _, err = survivor.communicate(timeout=90)
        took = time.monotonic() - began
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()
    assert survivor.returncode == 5, err[-3000:]
    assert took < 60, took
    (line,) = [line for line in err.splitlines() if "hang:" in line]
    assert f"no stack from rank {frozen} on {socket.gethostname()} (stopped)" in line, line
    assert "exit status 5" in line and (run / "hang" / "report.txt").read_text().strip() == line


def test_an_earlier_jobs_hang_is_kept_apart(tmp_path):
    """A resumed run moves the hang/ of the job before it aside (hang-TIME/): its stacks
    are kept, and not read as the new job's."""
    hang = tmp_path / "run" / "hang"
    hang.mkdir(parents=True)
    (hang / "report.txt").write_text("the earlier hang\n")
    watchdog = Watchdog(
        StepClock(torch.device("cpu")), tmp_path / "run", 0, 2, "here", 5.0, 10.0, 60.0, print
    )
    watchdog.start()
    watchdog.stop()
    (kept,) = (tmp_path / "run").glob("hang-*")
    assert (kept / "report.txt").read_text() == "the earlier hang\n" and not hang.exists()


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


ALONE = """
import time

import torch
import torch.distributed as dist
from tiny import TinyOptions, TinyTrainer

from dmltrain import Callback, register_experiment


class ReduceInOnLog(Callback):
    \"\"\"A collective in on_log, which only rank 0 runs ('wait' stands for one that
    never returns, as NCCL's does; Gloo's meets the others' next one and aborts).\"\"\"

    def __init__(self, wait):
        self.wait = wait

    def on_log(self, trainer, values):
        if self.wait:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))


class Alone(TinyTrainer):
    def create_callbacks(self):
        return [*super().create_callbacks(), ReduceInOnLog(self.opts.dropout > 0)]


EXPERIMENT = register_experiment("alone", Alone, TinyOptions)
"""


@pytest.mark.parametrize("kind", ["abort", "hang"])
def test_a_collective_in_on_log_is_named_as_a_bug_not_a_lost_node(tmp_path, kind):
    """A callback calls a collective in on_log, which rank 0 alone runs: Gloo aborts rank 0
    (its all_reduce meets rank 1's next one), or, where such a call never returns, the
    watchdog finds the ranks stalled. Either way the run names on_log and ends with status
    1, which the batch scripts do not requeue (it said a lost node, exit 5)."""
    experiment = tmp_path / "alone.py"
    experiment.write_text(ALONE)
    wait = ["--dropout", "0.1", "--hang-timeout", "3"] if kind == "hang" else []
    done = run_cli(str(experiment), "--nprocs", "2", "--batch-size", "4", "--epochs", "1",
                   "--log-every", "2", "--progress", "off", "--dist-timeout", "60", *wait,
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    if kind == "abort":
        said = "rank 0 stopped inside the callback event on_log, which only rank 0 runs"
        assert said in done.stderr and "nothing is requeued" in done.stderr, done.stderr[-3000:]
        assert "crashed (SIGABRT" in done.stderr
    else:
        (line,) = [line for line in done.stderr.splitlines() if "hang:" in line]
        assert "rank 0 on " in line and "inside the callback event on_log" in line, line
        assert "alone.py:" in line and "exit status 1: fix the callback" in line, line
    assert "exit status 5" not in done.stderr
    assert (tmp_path / "run" / ".alone-rank-0").read_text() == "on_log"  # the next job's to clear

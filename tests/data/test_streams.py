"""Iterable (streaming) training data (dmltrain/data/streams.py), with real processes.

tiny's ``--stream`` makes its training set a user's ``IterableDataset`` that shards
itself by rank and loader worker: ``stateful`` (``state_dict``/``load_state_dict``),
``stateless`` (a generator), ``unsized`` (stateful, no ``len``). ``--record-samples``
writes which samples each rank trained at each step, so a test sees every sample a
resumed run repeated or skipped.
"""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import AT_ONCE, assert_same_run, cli_env, run_cli

from dmltrain.records.training_log import read_training_log
from dmltrain.runtime.launch import free_port

BASE = ["tiny", "--epochs", "2", "--batch-size", "8", "--save-weights", "--progress", "off",
        "--record-samples"]  # fmt: skip
STOP_AT_STEP_4 = ["--signal-rank", "0", "--signal-at-step", "3", *AT_ONCE]  # of 6 an epoch


def train(run: Path, *args: str, code: int = 0) -> str:
    done = run_cli(*BASE, "--run-dir", str(run), *args, cwd=run.parent)
    assert done.returncode == code, done.stderr[-3000:]
    return done.stdout + done.stderr


def trained(run: Path) -> dict[int, list[str]]:
    """Each rank's lines 'EPOCH STEP INDEX...', over all the run's jobs, in order."""
    return {
        int(record.suffixes[0][1:]): record.read_text().splitlines()
        for record in run.glob("samples.*.txt")
    }


def each_sample_once_an_epoch(run: Path, samples: int = 96, epochs: int = 2) -> None:
    seen: dict[int, Counter] = {}
    for lines in trained(run).values():
        for line in lines:
            epoch, _, *indices = (int(v) for v in line.split())
            seen.setdefault(epoch, Counter()).update(indices)
    assert sorted(seen) == list(range(1, epochs + 1))
    for counts in seen.values():
        assert sorted(counts) == list(range(samples)) and set(counts.values()) == {1}, counts


def test_a_stream_trains_with_the_default_loader_each_sample_once_an_epoch(tmp_path):
    """No sampler, and no len(): an epoch is one pass of the stream."""
    out = train(tmp_path / "run", "--stream", "unsized", "--progress", "log", "--log-every", "4")
    rows = read_training_log(tmp_path / "run" / "training_log.csv")
    assert [r["step"] for r in rows] == [12, 24] and rows[1]["train_loss"] < rows[0]["train_loss"]
    each_sample_once_an_epoch(tmp_path / "run")
    assert "data a stream of training" in out and "until the stream ends" in out
    assert "epoch 1/2 step 4 " in out  # no total to show


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_stream_preempted_mid_epoch_resumes_where_it_was_on_every_rank(tmp_path, workers):
    """--nprocs 2: each rank's stream, each loader worker's too, goes on from the step the
    checkpoint was taken at: the same samples in the same steps as a run never stopped,
    and the same weights, bitwise."""
    args = ["--stream", "stateful", "--nprocs", "2", "--num-workers", workers]
    full, split = tmp_path / "full", tmp_path / "split"
    train(full, *args)
    train(split, *args, *STOP_AT_STEP_4, code=3)
    out = train(split, *args)
    assert "resuming" in out and "the training stream" not in out  # exact: nothing to warn of
    assert trained(split) == trained(full)
    each_sample_once_an_epoch(split)
    assert_same_run(full, split)


def test_a_stream_without_state_is_read_forward_to_its_place_with_one_line(tmp_path):
    args = ["--stream", "stateless", "--nprocs", "2"]
    full, split = tmp_path / "full", tmp_path / "split"
    train(full, *args)
    train(split, *args, *STOP_AT_STEP_4, code=3)
    out = train(split, *args)
    line = "the training stream (StatelessStream) has no state_dict/load_state_dict"
    assert out.count(line) == 1, out  # rank 0 says it, once
    assert trained(split) == trained(full)  # this stream yields the same samples each time
    assert_same_run(full, split)


def test_a_loader_that_cannot_save_its_place_is_said_at_the_resume(tmp_path):
    """A create_dataloader of the user's that returns torch's DataLoader: the stream
    starts again at the resume, and one line says that the epoch's first samples are
    trained again (never silence)."""
    args = ["--stream", "stateful", "--own-loader"]
    run = tmp_path / "run"
    train(run, *args, *STOP_AT_STEP_4, code=3)
    out = train(run, *args)
    assert out.count("starts again from its beginning, so this epoch's first samples") == 1
    first_epoch = [line.split()[2:] for line in trained(run)[0] if line.startswith("1 ")]
    assert first_epoch[4] == first_epoch[0]  # step 5 trained step 1's samples again


def test_steps_per_epoch_reads_the_stream_on_across_epochs_and_resumes_under_torchrun(
    tmp_path,
):
    """An unsized stream on 2 ranks, 4 steps an epoch: epoch 2 goes on where epoch 1's
    stream stopped; a schedule sized by total_steps works. Under torchrun with 2 loader
    workers, a rank killed (kill -9) after a step checkpoint in epoch 2: the run started
    again goes on from that checkpoint's place in each rank's stream, exactly."""
    args = ["--stream", "unsized", "--steps-per-epoch", "4", "--one-cycle"]
    full, split = tmp_path / "full", tmp_path / "split"
    train(full, *args, "--nprocs", "2", "--num-workers", "2")
    firsts = [line.split()[2] for line in trained(full)[0]]  # rank 0: evens, 2 workers' turns
    assert firsts == ["0", "2", "32", "34", "64", "66", "0", "2"]  # epoch 2 at 64, then anew
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), "-m", "dmltrain", *BASE, *args,
                "--run-dir", str(split), "--num-workers", "2"]  # fmt: skip
    kill = ["--checkpoint-every-steps", "2", "--die-rank", "1", "--die-at-step", "6"]
    for extra in (kill, []):
        done = subprocess.run(
            torchrun + extra, cwd=tmp_path, env=cli_env(), capture_output=True, text=True
        )
        assert (done.returncode == 0) == (not extra), done.stderr[-3000:]
    assert "global step 6" in done.stdout, done.stdout[-2000:]  # resumed in epoch 2
    # the steps after the checkpoint ran twice (before the kill, and resumed): the same
    lines = {rank: list(dict.fromkeys(record)) for rank, record in trained(split).items()}
    assert lines == trained(full)
    assert_same_run(full, split)


def test_what_a_stream_cannot_do_is_one_line(tmp_path):
    cases = [
        (["--stream", "unsized", "--nprocs", "2"], "has no len() and 2 processes train on it"),
        (["--stream", "unsized", "--one-cycle"], "total_steps is unknown"),
        (["--steps-per-epoch", "3"], "--steps-per-epoch is for iterable (streaming) datasets"),
    ]
    for i, (args, message) in enumerate(cases):
        out = train(tmp_path / f"run{i}", *args, code=2)
        assert message in out and "Traceback" not in out, out
    stopped = tmp_path / "stopped"
    train(stopped, "--stream", "stateful", "--nprocs", "2", *STOP_AT_STEP_4, code=3)
    out = train(stopped, "--stream", "stateful", "--batch-size", "16", code=2)
    assert "on each of its 2 processes, and this run has 1" in out and "Traceback" not in out
    assert "--restart-streams" in out
    out = train(stopped, "--stream", "stateful", "--batch-size", "16", "--restart-streams")
    assert "each rank's stream begins afresh (--restart-streams)" in out


def test_the_global_batch_size_sets_a_streams_batch_as_for_map_style_data(tmp_path):
    args = ["--stream", "stateful", "--nprocs", "2"]
    train(tmp_path / "batch", *args, "--batch-size", "8")
    train(tmp_path / "global", *args, "--global-batch-size", "16")
    assert trained(tmp_path / "global") == trained(tmp_path / "batch")
    assert_same_run(tmp_path / "batch", tmp_path / "global")


def test_validation_over_a_stream_counts_every_sample_once_over_the_ranks(tmp_path):
    """33 validation samples streamed as 17 and 16 on 2 ranks: each epoch's val_loss is
    the mean over all 33, as with the map-style validation set; FSDP, whose forward is
    collective, is refused in one line."""
    args = ["--nprocs", "2", "--val-samples", "33", "--epochs", "3"]
    train(tmp_path / "map", *args)
    train(tmp_path / "stream", *args, "--val-stream")
    rows = {name: read_training_log(tmp_path / name / "training_log.csv") for name in
            ("map", "stream")}  # fmt: skip
    assert len(rows["stream"]) == 3
    for a, b in zip(rows["map"], rows["stream"], strict=True):
        assert b["train_loss"] == a["train_loss"]
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-6)
    out = train(tmp_path / "fsdp", *args, "--val-stream", "--strategy", "fsdp", code=2)
    assert "validation over a stream under FSDP" in out and "Traceback" not in out


USER_STREAM = str(Path(__file__).with_name("user_stream.py"))


def user_stream(run: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(USER_STREAM, "--epochs", "1", "--batch-size", "4", "--progress", "off",
                   "--run-dir", str(run), *args, cwd=run.parent)  # fmt: skip


def test_a_stream_state_a_checkpoint_cannot_hold_is_one_line_at_the_first_save(tmp_path):
    """A position kept as a numpy scalar: the run stops at its first checkpoint with one
    line naming the value (exit 2), instead of writing checkpoints that never load."""
    done = user_stream(tmp_path / "run", "--numpy-position", "--checkpoint-every-steps", "4")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("dmltrain: error:")]
    assert "['dataset_state']['position'] is a numpy.int64" in line, line
    assert "int(x)" in line
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt-*"))
    fine = user_stream(tmp_path / "fine", "--checkpoint-every-steps", "4")  # an int resumes
    assert fine.returncode == 0, fine.stderr[-3000:]


@pytest.mark.parametrize("sized", [False, True])
def test_a_stream_that_yields_nothing_is_one_line_not_a_run_done(tmp_path, sized):
    """An empty stream (a wrong path, a filter that drops all): exit 2 and one line, not
    0 steps and 'done'."""
    done = user_stream(tmp_path / "run", "--samples", "0", *(["--sized"] if sized else []))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    said = "has no batch: its len() is 0" if sized else "yields no batch on rank 0"
    assert f"the training stream (Numbers) {said}" in done.stderr
    assert "done" not in (tmp_path / "run" / "outcome.json").read_text()

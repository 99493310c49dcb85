"""NaN checks: real 2-process Gloo runs with a NaN injected on one rank.

Each rank runs as its own process (no launcher to clean up after it), so the tests see
every rank's exit status: all must stop in the same step with the NaN status, none may
hang in the next all-reduce or die of a lost peer.
"""

import json
import sys
import time

import pytest
import torch
from helpers import TINY, assert_same_run, start_ranks

from dmltrain.checkpoint.storage import list_checkpoints, load_file
from dmltrain.engine.nan import nonfinite
from dmltrain.errors import EXIT_NONFINITE

ARGS = [*TINY, "--epochs", "2"]
ARGS += ["--check-nans", "--checkpoint-every-steps", "2", "--keep-last", "0"]


def two_ranks(run, *extra, timeout=120):
    """Start rank 0 and rank 1 as plain processes; return [(exit status, stderr)] per rank."""
    command = [sys.executable, "-m", "dmltrain", *ARGS, *extra, "--run-dir", str(run)]
    procs = start_ranks(command, run.parent)
    started = time.monotonic()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append((proc.returncode, out + err))
    return results, time.monotonic() - started


def test_nonfinite_is_one_flag_for_many_tensors():
    good = [torch.ones(3), torch.zeros(2, 2), torch.empty(0)]
    assert not nonfinite(good, torch.device("cpu"))
    assert nonfinite([*good, torch.tensor([1.0, float("nan")])], torch.device("cpu"))
    assert nonfinite([torch.tensor([float("-inf")], dtype=torch.bfloat16)], torch.device("cpu"))
    assert not nonfinite([], torch.device("cpu"))
    # +Inf and -Inf together cancel to NaN, never to a finite value
    assert nonfinite([torch.tensor([float("inf"), float("-inf")])], torch.device("cpu"))
    # large finite half-precision values are reduced in fp32: 100 x 60000 does not overflow
    assert not nonfinite([torch.full((100,), 60000.0, dtype=torch.float16)], torch.device("cpu"))


@pytest.mark.parametrize("into", ["loss", "gradient"])
def test_raise_stops_every_rank_in_the_same_step(tmp_path, into):
    run = tmp_path / "run"
    results, took = two_ranks(run, "--nan-rank", "1", "--nan-at-step", "4", "--nan-into", into)
    # 6 steps an epoch: the NaN is in step 5 of epoch 1 (global step 4, 0-based)
    for status, output in results:
        assert status == EXIT_NONFINITE, output[-2000:]
        assert "lost contact" not in output
    assert took < 100
    report = (run / "nan_report.txt").read_text().splitlines()
    assert len(report) == 1, report
    expected = f"non-finite {into} at epoch 1, step 5 (global step 5) on rank 1"
    assert expected in report[0] and report[0].endswith("stopping")
    if into == "gradient":
        assert "first offending parameters: 2.weight (1, 8)" in report[0]
    # printed once (by rank 0), not once per rank
    assert sum(out.count("NaN check:") for _, out in results) == 1
    # the last good checkpoint (step 4) is kept and names no later step
    latest = list_checkpoints(run / "checkpoints")[0]
    assert load_file(latest)["global_step"] == 4
    assert f"last good checkpoint: {latest}" in results[0][1]


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    run = tmp_path_factory.mktemp("skip") / "run"
    results, _ = two_ranks(run, "--on-nan", "skip", "--nan-rank", "1", "--nan-at-step", "4")
    for status, output in results:
        assert status == 0, output[-2000:]
    return run


def test_skip_drops_the_step_on_every_rank_and_goes_on(skipped, tmp_path):
    report = (skipped / "nan_report.txt").read_text()
    assert "non-finite loss at epoch 1, step 5 (global step 5) on rank 1" in report
    assert "step skipped on every rank" in report
    rows = (skipped / "training_log.csv").read_text().splitlines()
    assert len(rows) == 3 and "nan" not in rows[1].lower()
    clean = tmp_path / "clean"
    results, _ = two_ranks(clean)
    assert [status for status, _ in results] == [0, 0]
    weights = torch.load(skipped / "final_weights.pt", weights_only=True)
    unchanged = torch.load(clean / "final_weights.pt", weights_only=True)
    assert not torch.equal(weights["0.weight"], unchanged["0.weight"])  # one step fewer
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_rollback_reloads_and_continues_past_the_bad_batch(skipped, tmp_path):
    """Roll back to the checkpoint of step 4, replay, drop step 5: the same run as skip."""
    run = tmp_path / "run"
    results, _ = two_ranks(run, "--on-nan", "rollback", "--nan-rank", "1", "--nan-at-step", "4")
    for status, output in results:
        assert status == 0, output[-2000:]
    assert "rolled back to" in results[0][1] and "epoch 1 step 5 will be skipped" in results[0][1]
    assert "rolling back to the last checkpoint" in (run / "nan_report.txt").read_text()
    assert_same_run(skipped, run)


def test_rollback_from_the_first_steps_uses_the_start_checkpoint(tmp_path):
    run = tmp_path / "run"
    injection = ["--nan-rank", "0", "--nan-at-step", "0", "--nan-into", "gradient"]
    results, _ = two_ranks(run, "--on-nan", "rollback", *injection, "--listen-all")
    for status, output in results:
        assert status == 0, output[-2000:]
    assert "rolled back to" in results[0][1] and "ckpt-000000-00000000.pt" in results[0][1]
    assert "epoch 1 step 1 will be skipped" in results[0][1]
    for rank in (0, 1):  # the callbacks were told, as on a resume
        seen = json.loads((run / f"events.{rank}.json").read_text())
        assert seen["loaded"] == [["ckpt-000000-00000000.pt", 0]]
        assert seen["saved_at"][0] == 0  # the start checkpoint


def test_detect_anomaly_names_the_backward_op_that_made_the_nan(tmp_path):
    from helpers import run_cli

    args = ["tiny", "--epochs", "1", "--progress", "off", "--nan-rank", "0", "--nan-at-step", "1"]
    plain = run_cli(*args, "--run-dir", str(tmp_path / "plain"), cwd=tmp_path)
    assert plain.returncode == 0  # a NaN loss goes unnoticed without checks
    done = run_cli(*args, "--detect-anomaly", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 1
    assert "returned nan values in its 0th output" in done.stderr


def test_a_deferred_check_is_read_at_the_next_log_interval(tmp_path):
    """No checkpoint in between: the NaN of step 5 is read with the metrics at the log
    interval of step 8, and the run stops there; the update of step 5 was skipped on the
    device (the fused default optimizer), so no parameter went bad meanwhile."""
    from helpers import run_cli

    run = tmp_path / "run"
    done = run_cli(*TINY, "--epochs", "1", "--check-nans", "--log-every", "4",
                   "--checkpoint-every-steps", "0", "--nan-rank", "0", "--nan-at-step", "4",
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == EXIT_NONFINITE, done.stderr[-2000:]
    report = (run / "nan_report.txt").read_text()
    assert "non-finite loss at epoch 1, step 5 (global step 5) on rank 0" in report
    assert "read at global step 8; stopping" in report
    assert "parameter" not in report


def test_skip_under_a_manual_step_on_the_device(tmp_path):
    """The manual step (two fused optimizers, each its own update): the NaN step's updates
    are skipped on every rank, the epoch's loss stays finite, no rank waits per step."""
    run = tmp_path / "run"
    extra = ["--two-optimizers", "manual", "--fused", "--on-nan", "skip", "--nan-rank", "1",
             "--nan-at-step", "4"]  # fmt: skip
    results, _ = two_ranks(run, *extra)
    for status, output in results:
        assert status == 0, output[-2000:]
        assert "cannot skip a step on the device" not in output
    report = (run / "nan_report.txt").read_text()
    assert "non-finite loss at epoch 1, step 5 (global step 5) on rank 1" in report
    assert "step skipped on every rank" in report
    assert "nan" not in (run / "training_log.csv").read_text().lower()
    weights = torch.load(run / "final_weights.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_an_optimizer_that_cannot_skip_on_the_device_is_named_and_waits(tmp_path):
    """Two non-fused optimizers: said once; each step then reads its check, and the NaN
    step is dropped at once (the report has no later reading step)."""
    from helpers import run_cli

    run = tmp_path / "run"
    done = run_cli(*TINY, "--epochs", "1", "--check-nans", "--on-nan", "skip",
                   "--two-optimizers", "auto", "--nan-rank", "0", "--nan-at-step", "4",
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert said.count("Adam, SGD cannot skip a step on the device") == 1, said[-2000:]
    report = (run / "nan_report.txt").read_text()
    assert "global step 5) on rank 0; step skipped on every rank" in report

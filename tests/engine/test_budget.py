"""When a run is done (dmltrain/engine/budget.py): --max-steps, --max-time over all the jobs of
a run, early stopping, and steps.csv. Real processes (--nprocs 2), each stopped by a
signal in the middle of what it controls and resumed: equal to an uninterrupted run,
bitwise."""

import csv
from pathlib import Path

import pytest
from helpers import AT_ONCE, RANDOM, assert_same_run, log_numbers, run_cli

from dmltrain.checkpoint.storage import list_checkpoints, load_file

# 2 processes x 4: 12 steps an epoch
BASE = ["tiny", "--nprocs", "2", "--batch-size", "4", "--save-weights", "--progress", "log",
        "--log-every", "5", *RANDOM]  # fmt: skip


def train(run: Path, *args: str, code: int = 0) -> str:
    done = run_cli(*BASE, "--run-dir", str(run), *args, cwd=run.parent)
    assert done.returncode == code, done.stderr[-3000:]
    return done.stdout + done.stderr


def signal_at(step: int) -> list[str]:
    return ["--signal-rank", "1", "--signal-at-step", str(step), *AT_ONCE]


def steps_csv(run: Path) -> list[dict[str, str]]:
    with open(run / "steps.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def resumed_equals_uninterrupted(tmp_path: Path, args: list[str], stop_at: int) -> Path:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out = train(whole, *args)
    train(cut, *args, *signal_at(stop_at), code=3)
    assert train(cut, *args) and (cut / "final_weights.pt").is_file()
    assert_same_run(whole, cut)
    return out


def test_max_steps_ends_mid_epoch_and_a_resume_equals_the_uninterrupted_run(tmp_path):
    """--max-steps 20 of 3 epochs of 12: the run ends in epoch 2 with a row for it so far;
    a OneCycleLR over self.total_steps (20) would raise if stepped more; steps.csv has a
    row every 5 steps of an epoch (and at its end), the same after a resume."""
    args = ["--epochs", "3", "--max-steps", "20", "--one-cycle", "--grad-clip", "1.0"]
    out = resumed_equals_uninterrupted(tmp_path, args, stop_at=15)
    assert "dmltrain: done: --max-steps 20 reached (epoch 2, global step 20)" in out
    rows = log_numbers(tmp_path / "whole")
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 12), (2, 20)]
    whole, cut = steps_csv(tmp_path / "whole"), steps_csv(tmp_path / "cut")
    assert [r["step"] for r in whole] == ["5", "10", "12", "17"]  # every 5 steps of an epoch
    assert list(whole[0]) == ["step", "epoch", "loss", "steps_per_s", "data_wait",
                              "samples_per_s", "lr", "grad_norm"]  # fmt: skip
    timing = ("steps_per_s", "data_wait", "samples_per_s")  # the clock's, not the run's
    same = [{k: v for k, v in r.items() if k not in timing} for r in whole]
    assert same == [{k: v for k, v in r.items() if k not in timing} for r in cut]
    # Run again: nothing left; raise the limit: it goes on inside epoch 2
    again = train(tmp_path / "whole", *args)
    assert "the run is done already (--max-steps 20 reached" in again
    train(tmp_path / "whole", "--epochs", "3", "--max-steps", "30", "--grad-clip", "1.0")
    rows = log_numbers(tmp_path / "whole")
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 12), (2, 20), (2, 24), (3, 30)]


def test_max_steps_alone_sets_the_length_of_the_run(tmp_path):
    """--max-steps 30 at 2 steps an epoch (as a port that counts iterations runs it):
    the run takes 30 steps, over 15 epochs, and its schedule is sized for 30; the default
    --epochs capped it at 20 and called the run done."""
    run = tmp_path / "run"
    done = run_cli("tiny", "--batch-size", "48", "--max-steps", "30", "--one-cycle",
                   "--progress", "log", "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dmltrain: done: --max-steps 30 reached (epoch 15, global step 30)" in done.stdout
    rows = log_numbers(run)
    assert [(r["epoch"], r["step"]) for r in rows][-1] == (15, 30)
    assert "epochs: 15" in (run / "config.yaml").read_text()  # as resolved


def test_epochs_that_end_the_run_before_max_steps_are_said_before_and_at_the_end(tmp_path):
    """Both given, --epochs ending first: a warning before training and the done line say
    which budget ended the run (on the bundled MNIST: 2 steps an epoch of 2,000 digits)."""
    run = tmp_path / "run"
    done = run_cli("mnist", "--no-download", "--epochs", "1", "--batch-size", "2000",
                   "--max-steps", "5", "--progress", "log", "--run-dir", str(run),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING: --epochs 1 (2 steps of 2) ends the run before --max-steps 5" in done.stderr
    assert "dmltrain: done: --epochs 1 reached at global step 2, before --max-steps 5" in (
        done.stdout
    )


def test_max_time_counts_the_training_time_of_every_job(tmp_path):
    """--max-time 4 s: a first job trains about 1 s and is preempted; the second ends once
    both together trained 4 s; every rank stops at the same step (exit 0 from both)."""
    run = tmp_path / "run"
    args = ["--epochs", "1000", "--step-sleep", "0.05", "--max-time", "0:04"]
    train(run, *args, *signal_at(20), code=3)
    first = load_file(list_checkpoints(run / "checkpoints")[0])["train_seconds"]
    assert 0.5 < first < 3.5, first
    out = train(run, *args)
    assert "dmltrain: done: --max-time 0:04 of training reached" in out
    state = load_file(list_checkpoints(run / "checkpoints")[0])
    assert 4.0 <= state["train_seconds"] < 6.0, state["train_seconds"]
    assert "the run is done already (--max-time 0:04" in train(run, *args)


def test_early_stopping_keeps_its_patience_across_a_resume(tmp_path):
    """Patience 2 and a minimum improvement no validation reaches: validations 2 and 3
    do not count as improvements, so the run ends after epoch 3. Preempted in epoch 3
    (one validation without improvement counted), the resumed run still ends after epoch
    3: the count was in the checkpoint."""
    args = ["--epochs", "10", "--early-stop-patience", "2", "--early-stop-min-delta", "1000"]
    out = resumed_equals_uninterrupted(tmp_path, args, stop_at=30)
    assert [r["epoch"] for r in log_numbers(tmp_path / "whole")] == [1, 2, 3]
    best = min(log_numbers(tmp_path / "whole"), key=lambda r: r["val_loss"])
    assert (
        "dmltrain: done: early stop: val_loss did not improve by more than 1000.0 in 2 "
        f"validation(s); the best was {best['val_loss']:.6g} at epoch {int(best['epoch'])}, "
        f"global step {int(best['step'])}"
    ) in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--max-time", "soon"],
            "--max-time 'soon': give a duration like 2-00:00:00, 12:00:00 or 90 (minutes)",
        ),
        (["--max-steps", "-1"], "--max-steps must be >= 0 (got -1)"),
        (["--early-stop-patience", "-2"], "--early-stop-patience must be >= 0 (got -2)"),
    ],
)
def test_bad_budgets_are_one_line(tmp_path, args, message):
    done = run_cli("tiny", *args, "--run-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == f"dmltrain: error: {message}"


def test_validation_every_n_steps_inside_epochs_survives_a_preemption_right_after_one(
    tmp_path,
):
    """--val-every-steps 5 (12 steps an epoch): rows at global steps 5, 10, 12 (the end),
    15, 20, 24; preempted right after the validation at step 5 (the signal in step 5, the
    ranks agree at every step), the resumed run neither repeats nor skips one. Early
    stopping counts these validations too."""
    args = ["--epochs", "2", "--val-every-steps", "5"]
    resumed_equals_uninterrupted(tmp_path, args, stop_at=4)
    rows = log_numbers(tmp_path / "cut")
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 5), (1, 10), (1, 12), (2, 15),
                                                        (2, 20), (2, 24)]  # fmt: skip
    best = load_file(tmp_path / "cut" / "checkpoints" / "best.pt")
    assert best["best_value"] == min(r["val_loss"] for r in rows)
    assert best["global_step"] == next(
        r["step"] for r in rows if r["val_loss"] == best["best_value"]
    )
    early = tmp_path / "early"
    out = train(early, "--epochs", "5", "--val-every-steps", "5", "--early-stop-patience", "2",
                "--early-stop-min-delta", "1000")  # fmt: skip
    assert [r["step"] for r in log_numbers(early)] == [5, 10, 12]
    assert "dmltrain: done: early stop: val_loss did not improve" in out

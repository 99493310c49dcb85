"""The user's path: `dmltrain mnist` on the bundled sample, as a new user runs it."""

import itertools
import math

import pytest

from conftest import run_cli
from dmltrain.training_log import read_training_log

COLUMNS = ["epoch", "train_loss", "val_loss", "val_acc", "lr", "epoch_time_s"]


def test_one_epoch_on_the_sample(tmp_path, http_dir):
    _, url = http_dir  # an empty mirror: the download fails at once, as offline
    run = tmp_path / "run"
    done = run_cli(
        "mnist",
        "--epochs",
        "1",
        "--run-dir",
        str(run),
        "--data-dir",
        str(tmp_path / "data"),
        "--mirrors",
        url,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "training on the bundled 5,000-digit sample" in done.stderr
    text = (run / "training_log.csv").read_text()
    assert text.splitlines()[0] == ",".join(COLUMNS)
    (row,) = read_training_log(run / "training_log.csv")
    assert row["epoch"] == 1
    assert row["train_loss"] < math.log(10) and row["val_loss"] < row["train_loss"]
    assert row["val_acc"] > 0.85
    assert "epoch 1/1 train_loss" in done.stdout


@pytest.mark.slow
def test_ten_epochs_reach_the_accuracy_target(tmp_path):
    run = tmp_path / "run"
    done = run_cli(
        "mnist", "--epochs", "10", "--run-dir", str(run), "--no-download", cwd=tmp_path, timeout=900
    )
    assert done.returncode == 0, done.stderr
    rows = read_training_log(run / "training_log.csv")
    assert [r["epoch"] for r in rows] == list(range(1, 11))
    losses = [r["train_loss"] for r in rows]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert rows[2]["val_acc"] >= 0.95, rows[2]
    assert rows[9]["val_acc"] >= 0.96, rows[9]

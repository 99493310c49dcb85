import math

from dmltrain.records.training_log import read_training_log, write_training_log


def test_rows_rewritten_whole_with_full_precision(tmp_path):
    path = tmp_path / "training_log.csv"
    rows = [{"epoch": 1, "train_loss": 0.1234567890123, "lr": 0.001}]
    write_training_log(path, rows)
    assert read_training_log(path) == [{"epoch": 1.0, "train_loss": 0.1234567890123, "lr": 0.001}]
    rows.append({"epoch": 2, "train_loss": 0.05, "val_acc": 0.9, "lr": 0.001})
    write_training_log(path, rows)
    rows = read_training_log(path)
    assert [r["epoch"] for r in rows] == [1.0, 2.0]
    assert math.isnan(rows[0]["val_acc"]) and rows[1]["val_acc"] == 0.9
    assert path.read_text().splitlines()[0] == "epoch,train_loss,lr,val_acc"
    assert not list(tmp_path.glob("*.tmp"))


def test_steps_csv_takes_a_scalar_first_logged_late_and_logged_rows_in_their_step(tmp_path):
    """steps.csv's columns grow as scalars appear (none is left out); a scalar logged
    between log intervals is a row of its own step, and one logged at an interval's step
    joins that row."""
    import csv

    from dmltrain.records.training_log import StepsLog

    log = StepsLog(tmp_path / "steps.csv", resumed_at=0)
    for step in (10, 20, 30, 40):
        log.write({"step": step, "epoch": 1, "loss": 1.0 / step})
    log.add(47, 1, {"grad_noise": 0.5})  # first logged at step 47, then at 50
    log.add(50, 1, {"grad_noise": 0.25})
    log.write({"step": 50, "epoch": 1, "loss": 0.02})
    log.add(53, 1, {"grad_noise": 0.125})
    log.write()  # the end of the run: what was logged after the last interval
    with open(tmp_path / "steps.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["step", "epoch", "loss", "grad_noise"]
    assert [r["step"] for r in rows] == ["10", "20", "30", "40", "47", "50", "53"]
    assert [r["grad_noise"] for r in rows] == ["", "", "", "", "0.5", "0.25", "0.125"]
    assert rows[5]["loss"] == "0.02" and rows[4]["loss"] == ""

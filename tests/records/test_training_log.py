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

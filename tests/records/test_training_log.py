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


def test_a_link_put_where_a_record_goes_is_never_written_through(tmp_path):
    """A neighbour's symlink at steps.csv (a group-writable run directory): replaced when
    the log starts, said once; one made later fails its append (said, training goes on),
    and the link's target is never written."""
    from dmltrain.records.training_log import StepsLog

    victim = tmp_path / "victim.txt"
    victim.write_text("theirs\n")
    path = tmp_path / "steps.csv"
    path.symlink_to(victim)
    said = []
    log = StepsLog(path, resumed_at=0, warn=said.append)
    log.write({"step": 1, "epoch": 1, "loss": 0.5})
    assert not path.is_symlink() and path.read_text() == "step,epoch,loss\n1,1,0.5\n"
    assert said == [f"{path} was a link to {victim}, which dmltrain did not make: replaced by "
                    "a file of this run's own (the link's target is untouched)"]  # fmt: skip
    path.unlink()
    path.symlink_to(victim)  # during the run
    log.write({"step": 2, "epoch": 1, "loss": 0.25})
    assert "cannot write" in said[1] and "training goes on" in said[1]
    assert victim.read_text() == "theirs\n"


def test_a_run_makes_its_files_with_the_users_umask(tmp_path):
    """Under umask 077 no file or folder of the run (checkpoints, records, steps.csv,
    the monitor's rows) is readable or writable by others: nothing is chmod-ed wider."""
    import subprocess
    import sys

    from helpers import TINY, cli_env

    run = tmp_path / "run"
    command = [sys.executable, "-m", "dmltrain", *TINY, "--epochs", "1", "--log-every", "1",
               "--run-dir", str(run)]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          preexec_fn=lambda: __import__("os").umask(0o077))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    made = [run, *run.rglob("*")]
    assert len(made) > 10 and (run / "steps.csv").is_file()
    wider = [f"{p} {p.lstat().st_mode & 0o777:o}" for p in made
             if not p.is_symlink() and p.lstat().st_mode & 0o077]  # fmt: skip
    assert wider == []

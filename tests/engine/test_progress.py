import io

from dmltrain.engine.progress import Progress


def _run(progress, steps=5):
    reads = []

    def read():
        reads.append(1)
        return {"loss": 0.5}

    for step, _ in enumerate(progress.epoch(range(steps), 1, 1, steps), start=1):
        progress.step(step, step * 2, read)
    progress.epoch_summary({"epoch": 1, "train_loss": 0.5})
    return reads


def test_log_mode_reports_at_interval_and_last_step():
    out = io.StringIO()
    reads = _run(Progress("log", enabled=True, log_every=2, stream=out))
    lines = out.getvalue().splitlines()
    assert [line.split()[3] for line in lines[:-1]] == ["2/5", "4/5", "5/5"]
    assert len(reads) == 3  # metrics (a device sync) read only at the interval
    assert lines[-1] == "epoch 1/1 train_loss 0.5"


def test_a_long_epoch_line_is_one_line_a_group_of_columns():
    """An epoch's row with EMA and many validation metrics: the training columns on the
    epoch's line, validation and its average's each on indented lines, none over 100
    characters; a short row stays one line."""
    out = io.StringIO()
    progress = Progress("log", enabled=True, log_every=1, stream=out)
    progress._epochs = 3
    many = {f"val_score{i}": 0.123456 for i in range(12)}
    row = {"epoch": 2, "step": 40, "train_loss": 1.374, **many, "val_ema_loss": 2.044,
           "val_ema_acc": 0.712, "lr": 0.001, "world_size": 2, "epoch_time_s": 1.853}  # fmt: skip
    progress.epoch_summary(row, partial=True)
    lines = out.getvalue().splitlines()
    assert lines[0] == "epoch 2/3 (step 40) train_loss 1.374 lr 0.001 epoch_time_s 1.853"
    assert lines[1].startswith("  val_score0 0.1235 val_score1 0.1235")
    assert lines[-1] == "  val_ema_loss 2.044 val_ema_acc 0.712"
    assert all(len(line) <= 100 for line in lines) and len(lines) == 5, lines
    shown = " ".join(line.strip() for line in lines[1:-1]).split()
    assert shown == [part for i in range(12) for part in (f"val_score{i}", "0.1235")]
    short = io.StringIO()
    progress.stream = short
    progress.epoch_summary({"epoch": 1, "train_loss": 0.5, "val_loss": 0.25, "lr": 0.001})
    assert short.getvalue() == "epoch 1/3 train_loss 0.5 val_loss 0.25 lr 0.001\n"


def test_non_main_rank_prints_and_syncs_nothing():
    out = io.StringIO()
    reads = _run(Progress("log", enabled=False, log_every=1, stream=out))
    assert out.getvalue() == "" and reads == []


def test_bar_mode_draws_tqdm_on_stderr_and_keeps_stdout_for_summaries(capsys):
    out = io.StringIO()
    reads = _run(Progress("bar", enabled=True, log_every=2, stream=out))
    assert len(reads) == 3
    assert "epoch 1/1" in capsys.readouterr().err  # tqdm's description
    assert out.getvalue().splitlines() == ["epoch 1/1 train_loss 0.5"]


def test_after_a_mid_epoch_resume_throughput_and_epoch_time_are_those_of_a_whole_run(tmp_path):
    """The first interval after a resume counts only the samples trained since (not the
    epoch's before it), and the resumed epoch's time includes the part before the resume:
    both within the range of an uninterrupted run's."""
    import csv
    import statistics

    from helpers import AT_ONCE, run_cli

    args = ["tiny", "--epochs", "1", "--batch-size", "8", "--step-sleep", "0.05", "--progress",
            "log", "--log-every", "1"]  # fmt: skip

    def rows(run, name):
        with open(run / name) as file:
            return list(csv.DictReader(file))

    whole = tmp_path / "whole"
    assert run_cli(*args, "--run-dir", str(whole), cwd=tmp_path).returncode == 0
    resumed = tmp_path / "resumed"
    stop = ["--signal-rank", "0", "--signal-at-step", "8", *AT_ONCE]
    assert run_cli(*args, *stop, "--run-dir", str(resumed), cwd=tmp_path).returncode == 3
    done = run_cli(*args, "--run-dir", str(resumed), cwd=tmp_path)
    assert done.returncode == 0 and "resuming from" in done.stdout, done.stderr
    rates = [float(r["samples_per_s"]) for r in rows(whole, "steps.csv")]
    typical = statistics.median(rates)
    after = [float(r["samples_per_s"]) for r in rows(resumed, "steps.csv")]
    assert len(after) == 12
    # wide bounds for a loaded machine: the fault was 9x, and half the time
    assert all(typical / 3 < rate < 2.5 * typical for rate in after), (typical, after)
    took = float(rows(whole, "training_log.csv")[0]["epoch_time_s"])
    resumed_took = float(rows(resumed, "training_log.csv")[0]["epoch_time_s"])
    assert 0.6 * took < resumed_took < 1.7 * took, (took, resumed_took)

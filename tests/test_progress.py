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

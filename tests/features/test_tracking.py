"""Weights & Biases tracking with the real wandb in offline mode; the .wandb files are read
back record by record (tests/wandb_records.py) instead of mocking wandb."""

import json
import os
import time

import pytest
from helpers import AT_ONCE, cli_env, run_cli, tensorboard_scalars

from dmltrain.checkpoint.storage import load_file
from wandb_records import read_run, runs_in

TINY = ["tiny", "--epochs", "2", "--batch-size", "8", "--progress", "off", "--log-every", "3"]


def wandb_env(tmp_path, **extra):
    """wandb's own files (settings, caches) in the test's directory, not in $HOME."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        "HOME": str(home),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        **extra,
    }


def train(tmp_path, run, *args, **env):
    done = run_cli(*TINY, *args, "--run-dir", str(run), cwd=tmp_path, timeout=240,
                   **wandb_env(tmp_path, **env))  # fmt: skip
    return done


def test_offline_run_has_the_config_and_the_logged_metrics(tmp_path):
    run = tmp_path / "run"
    done = train(tmp_path, run, "--precision", "fp16", WANDB_MODE="offline")
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = runs_in(run)
    logged = read_run(path)
    assert path.name == f"run-{logged.run_id}.wandb"
    assert logged.config["train"]["precision"] == "fp16" and logged.config["train"]["epochs"] == 2
    steps = [row for row in logged.history if "train/loss" in row]
    # 12 steps an epoch, logged every 3 steps: global steps 3, 6, ..., 24
    assert [row["global_step"] for row in steps] == list(range(3, 25, 3))
    for key in ("train/lr", "train/samples_per_s", "train/grad_scale", "train/skipped_steps"):
        assert key in steps[0], key
    epochs = [row for row in logged.history if "val_loss" in row]
    assert [(row["epoch"], row["global_step"]) for row in epochs] == [(1, 12), (2, 24)]
    best = min(epochs, key=lambda row: row["val_loss"])
    assert logged.summary["best_val_loss"] == best["val_loss"]
    assert logged.summary["best_epoch"] == best["epoch"]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    """... also on another number of processes (2 x 4, then 1 x 8: the same global batch)."""
    run = tmp_path / "run"
    first = train(tmp_path, run, "--signal-rank", "0", "--signal-at-step", "16", *AT_ONCE,
                  "--nprocs", "2", "--batch-size", "4", WANDB_MODE="offline")  # fmt: skip
    assert first.returncode == 3, first.stderr[-2000:]
    second = train(tmp_path, run, WANDB_MODE="offline")
    assert second.returncode == 0, second.stderr[-2000:]
    before, after = (read_run(path) for path in runs_in(run))
    assert before.run_id == after.run_id
    assert before.preempting and not after.preempting
    steps_before = [row["global_step"] for row in before.history]
    steps_after = [row["global_step"] for row in after.history]
    assert max(steps_before) <= 17 < min(steps_after) and max(steps_after) == 24
    assert [row["world_size"] for row in after.history if "val_loss" in row] == [1]


def test_only_rank_0_creates_a_run(tmp_path):
    run = tmp_path / "run"
    done = train(tmp_path, run, "--nprocs", "2", "--batch-size", "4", WANDB_MODE="offline")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(runs_in(run)) == 1


def test_auto_mode_follows_wandb_mode_and_the_flag_wins(tmp_path):
    off = tmp_path / "off"
    done = train(tmp_path, off)  # no WANDB_MODE: disabled
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (off / "wandb").exists()
    flag = tmp_path / "flag"
    done = train(tmp_path, flag, "--wandb-mode", "offline", WANDB_MODE="disabled")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(runs_in(flag)) == 1


def test_online_without_credentials_falls_back_to_offline(tmp_path):
    run = tmp_path / "run"
    started = time.monotonic()
    done = train(tmp_path, run, "--wandb-mode", "online")
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 120
    lines = [line for line in done.stdout.splitlines() if "wandb could not start online" in line]
    assert len(lines) == 1 and "logging offline to" in lines[0]
    assert len(runs_in(run)) == 1


def test_online_with_an_unreachable_server_falls_back_and_does_not_hang(tmp_path):
    run = tmp_path / "run"
    started = time.monotonic()
    done = train(
        tmp_path,
        run,
        "--wandb-mode",
        "online",
        "--wandb-init-timeout",
        "15",
        WANDB_API_KEY="0" * 40,
        WANDB_BASE_URL="http://127.0.0.1:9",  # nothing listens there
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 150
    assert "wandb could not start online" in done.stdout
    assert "logging offline to" in done.stdout
    assert len(runs_in(run)) == 1


def test_without_wandb_installed_training_goes_on(tmp_path):
    """The one stand-in here: a ``wandb`` package that fails to import, as a missing one
    does (uninstalling the real one would break the other tests)."""
    fake = tmp_path / "nowandb" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    path = os.pathsep.join([str(fake.parent), cli_env()["PYTHONPATH"]])
    run = tmp_path / "run"
    done = train(tmp_path, run, WANDB_MODE="offline", PYTHONPATH=path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wandb is not installed (pip install wandb): tracking is off" in done.stdout


def test_tensorboard_continues_its_curves_across_a_requeue(tmp_path):
    """--tensorboard on 2 processes, preempted in epoch 2 (rank 1 signalled at step 16),
    then resumed from the end of epoch 1 (step 12), as after a kill: the events the first
    job wrote after step 12 are purged, and TensorBoard reads one curve per scalar with
    each step once, the values wandb got last (here both, --tracker wandb,tensorboard)."""
    run = tmp_path / "run"
    args = ["--nprocs", "2", "--batch-size", "4", "--tracker", "wandb,tensorboard"]
    first = train(tmp_path, run, *args, "--signal-rank", "1", "--signal-at-step", "16",
                  *AT_ONCE, WANDB_MODE="offline")  # fmt: skip
    assert first.returncode == 3, first.stderr[-2000:]
    epoch_end = run / "checkpoints" / "ckpt-000001-00000012.pt"
    second = train(tmp_path, run, *args, "--resume", str(epoch_end), WANDB_MODE="offline")
    assert second.returncode == 0, second.stderr[-2000:]
    scalars = tensorboard_scalars(run)
    loss = [step for step, _ in scalars["train/loss"]]
    assert loss == list(range(3, 25, 3)), loss  # every 3 steps of 2 epochs of 12, once each
    assert [step for step, _ in scalars["val_loss"]] == [12, 24]
    logged = [read_run(path) for path in runs_in(run)]
    wandb_loss = {
        r["global_step"]: r["train/loss"] for w in logged for r in w.history if "train/loss" in r
    }  # fmt: skip (the second job's value wins)
    assert {step: value for step, value in scalars["train/loss"]} == pytest.approx(wandb_loss)
    assert "summary/best_val_loss" in scalars


def test_tensorboard_alone_and_a_bad_tracker_name(tmp_path):
    run = tmp_path / "run"
    done = train(tmp_path, run, "--tensorboard", "--tracker", "")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (run / "wandb").exists() and "val_loss" in tensorboard_scalars(run)
    bad = train(tmp_path, tmp_path / "bad", "--tracker", "wandb,neptune")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "dmltrain: error: --tracker: unknown neptune; choose from wandb, tensorboard, failing, "
        "jsonl, mlflow (or install one under the entry-point group dmltrain.trackers)"
    )


def test_an_installed_tracker_is_named_and_continues_its_run_after_a_requeue(tmp_path):
    """``--tracker jsonl``, installed by entry point (tests/tiny.py's JsonlTracker), on 2
    processes beside wandb: preempted at step 8, resumed; rank 0 alone tracks, the same
    run id both jobs, each step's scalars once (2 epochs of 12 steps, a log line every
    3); both trackers' run ids are kept in the checkpoint."""
    run = tmp_path / "run"
    args = ["--nprocs", "2", "--batch-size", "4", "--tracker", "jsonl,wandb"]
    first = train(tmp_path, run, *args, "--signal-rank", "1", "--signal-at-step", "8",
                  *AT_ONCE, WANDB_MODE="offline")  # fmt: skip
    assert first.returncode == 3, first.stderr[-2000:]
    second = train(tmp_path, run, *args, WANDB_MODE="offline")
    assert second.returncode == 0, second.stderr[-2000:]
    records = [json.loads(line) for line in (run / "tracked.jsonl").read_text().splitlines()]
    starts = [r for r in records if "start" in r]
    assert [(r["step"], r["lr"]) for r in starts] == [(0, 1e-3), (9, 1e-3)]
    assert starts[0]["start"] == starts[1]["start"]  # one run over both jobs
    assert [r["preempted"] for r in records if "finish" in r] == [True, False]
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == list(range(3, 25, 3))  # 12 steps an epoch; no step twice
    assert [r["step"] for r in records if "val_loss" in r] == [12, 24]
    kept = load_file(run / "checkpoints" / "latest.pt")["tracker_run_ids"]
    assert sorted(kept) == ["jsonl", "wandb"] and kept["jsonl"] == starts[0]["start"]


def test_a_failing_installed_tracker_is_one_line_and_training_goes_on(tmp_path):
    done = train(tmp_path, tmp_path / "run", "--tracker", "failing")
    assert done.returncode == 0, done.stderr[-2000:]
    said = "the tracker failing failed to log (the tracking server went away): it is off"
    assert (done.stdout + done.stderr).count(said) == 1


def test_images_logged_at_validation_reach_tensorboard_and_wandb(tmp_path):
    """``trainer.log_image`` from a callback's on_validation_end (tests/tiny.py's
    WeightImages): an 8 x 4 tensor and a 2 x 2 inch matplotlib figure at each validation,
    read back from TensorBoard's event file and from the offline wandb run and its media."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    done = train(tmp_path, run, "--val-images", "--tracker", "wandb,tensorboard",
                 WANDB_MODE="offline")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    shown = {
        tag: [(image.step, image.width, image.height) for image in events.Images(tag)]
        for tag in events.Tags()["images"]
    }
    assert shown == {
        "val/weights": [(12, 4, 8), (24, 4, 8)],
        "val/weights_figure": [(12, 200, 200), (24, 200, 200)],
    }
    (path,) = runs_in(run)
    history = read_run(path).history  # an image's fields are keys of their own
    logged = [
        (row["global_step"], name, row[f"{name}/width"], row[f"{name}/height"])
        for row in history
        for name in ("val/weights", "val/weights_figure")
        if row.get(f"{name}/_type") == "image-file"
    ]
    assert logged == [
        (12, "val/weights", 4, 8),
        (12, "val/weights_figure", 200, 200),
        (24, "val/weights", 4, 8),
        (24, "val/weights_figure", 200, 200),
    ]
    for row in history:
        for key in (k for k in row if k.endswith("/path")):
            media = path.parent / "files" / row[key]
            assert media.read_bytes()[:4] == b"\x89PNG", media

"""The bundled weather example (experiments/forecast.py) as a CREDIT user runs it: its own
synthetic archive, a transformer with spectral norm, rollouts lengthening by a schedule,
latitude-weighted loss, RMSE and ACC per channel and lead; with CREDIT's starter settings
(EMA, activation checkpointing, FSDP with bf16) on 2 processes with 2 loader workers each."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import AT_ONCE, log_numbers, read_training_log, run_cli

pytest.importorskip("zarr")
pytest.importorskip("torchmetrics")

STOPPING = textwrap.dedent("""
    import os
    import signal
    from dataclasses import dataclass, field

    from dmltrain import register_experiment
    from dmltrain_experiments.forecast import ForecastOptions, ForecastTrainer


    @dataclass(frozen=True)
    class Options(ForecastOptions):
        stop_at_step: int = field(default=-1, metadata={"help": "rank 0 sends itself SIGUSR1"})


    class Stopping(ForecastTrainer):
        def train_step(self, batch):
            if self.dist.rank == 0 and self.global_step == self.options.stop_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().train_step(batch)


    EXPERIMENT = register_experiment("forecast-stopping", Stopping, Options)
""")
# 116 training samples, 58 a rank: 8 steps a pass; rollouts of 1, then 2 from step 8 (the
# second pass), then 3 from step 14
CREDIT = ["--nprocs", "2", "--strategy", "fsdp", "--precision", "bf16", "--ema-decay", "0.99",
          "--activation-checkpointing", "--num-workers", "2", "--batch-size", "8",
          "--epochs", "3", "--rollout", "0:1,8:2,14:3", "--progress", "off"]  # fmt: skip


def consolidated(run: Path) -> dict:
    """The run's latest checkpoint as one file, by `dmltrain consolidate`."""
    out = run / "latest.pt"
    done = subprocess.run(
        [sys.executable, "-m", "dmltrain", "consolidate", str(run / "checkpoints" / "latest.dcp"),
         "-o", str(out)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=False)


def recomputed_scores(run: Path, weights: dict, data: Path, leads: int) -> dict[str, float]:
    """RMSE and ACC of each channel and lead over every validation sample, from the saved
    weights, in this process and in float64 numpy: the formulas written out."""
    from dmltrain.data.normalise import Stats
    from dmltrain.data.zarr_windows import ZarrWindows
    from dmltrain.weather.rollout import forecast
    from dmltrain_experiments import forecast as example

    stats = Stats.load(run / "stats.json")
    leads_list, store = list(range(1, leads + 1)), str(data / "forecast-era.zarr")
    windows = ZarrWindows(store, example.VARIABLES, window=2, lead=leads_list,
                          levels=example.LEVELS, static=example.STATIC,
                          period=example.VALIDATION, stats=stats)  # fmt: skip
    channels = windows.target_channels
    model = example.WeatherTransformer(len(windows.channels), len(channels), 64, 2,
                                       stats.module(channels))  # fmt: skip
    model.load_state_dict(weights)
    model.eval()
    samples = [(x.clone(), y.clone()) for x, y in windows]
    inputs, targets = (torch.stack(parts) for parts in zip(*samples, strict=True))
    with torch.no_grad():
        predicted = forecast(model, inputs, leads, len(channels))
    mean, std = (np.array(v, dtype=np.float64).reshape(-1, 1, 1) for v in stats.of(channels))
    p = predicted.double().numpy() * std + mean
    t = targets.double().numpy() * std + mean
    w = np.cos(np.radians(example.LATITUDES))
    w = (w / w.mean())[:, None]
    rmse = np.sqrt(((p - t) ** 2 * w).mean(axis=(-2, -1)).mean(axis=0))
    a, b = p - mean, t - mean  # anomalies from each channel's training mean
    acc = (w * a * b).sum(axis=(0, -2, -1)) / np.sqrt(
        (w * a * a).sum(axis=(0, -2, -1)) * (w * b * b).sum(axis=(0, -2, -1))
    )
    scores = {}
    for k in range(leads):
        for j, channel in enumerate(channels):
            scores[f"val_rmse_{channel}_lead{k + 1}"] = float(rmse[k, j])
            scores[f"val_acc_{channel}_lead{k + 1}"] = float(acc[k, j])
    return scores


def test_credit_settings_on_2_processes_resume_bitwise_after_sigusr1(tmp_path):
    """FSDP bf16, EMA, activation checkpointing, rollouts lengthening at step 8: SIGUSR1
    at step 9 (the second pass, its first rollouts of 2), started again, the run ends with
    the same weights, EMA weights and log as one never stopped, bitwise. Its logged
    scores are those of its weights over the whole validation set (to bf16's precision)."""
    data = tmp_path / "data"
    (tmp_path / "stopping.py").write_text(STOPPING)
    runs = {name: tmp_path / name for name in ("full", "split")}
    for what, run, extra, code in (
        ("forecast", runs["full"], [], 0),
        ("stopping.py", runs["split"], ["--stop-at-step", "9", *AT_ONCE], 3),
        ("stopping.py", runs["split"], [], 0),
    ):
        done = run_cli(what, *CREDIT, *extra, "--data-dir", str(data), "--run-dir", str(run),
                       cwd=tmp_path, timeout=600)  # fmt: skip
        assert done.returncode == code, done.stderr[-3000:]
    assert "resuming" in done.stdout + done.stderr
    assert log_numbers(runs["full"]) == log_numbers(runs["split"])
    full, split = consolidated(runs["full"]), consolidated(runs["split"])
    for part in ("model", "ema"):
        assert list(full[part]) == list(split[part])
        for key in full[part]:
            assert torch.equal(full[part][key], split[part][key]), (part, key)
    last = read_training_log(runs["full"] / "training_log.csv")[-1]
    assert last["val_ema_loss"] < 3 * last["val_loss"]  # spectral norm's vectors not averaged
    scores = recomputed_scores(runs["full"], full["model"], data, leads=3)
    for name, value in scores.items():
        assert last[name] == pytest.approx(value, rel=0.03, abs=0.01), name


def test_the_logged_scores_are_the_saved_weights_over_the_whole_validation_set(tmp_path):
    """One process in float32: every logged RMSE and ACC (5 channels x 2 leads) equals the
    formula written out in numpy over all 36 validation samples, from the saved weights."""
    data, run = tmp_path / "data", tmp_path / "run"
    done = run_cli("forecast", "--epochs", "1", "--batch-size", "16", "--rollout", "0:1,3:2",
                   "--data-dir", str(data), "--run-dir", str(run), "--progress", "off",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    from dmltrain.checkpoint.storage import load_file

    weights = load_file(run / "checkpoints" / "latest.pt")["model"]
    last = read_training_log(run / "training_log.csv")[-1]
    scores = recomputed_scores(run, weights, data, leads=2)
    assert len(scores) == 20
    for name, value in scores.items():
        assert last[name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rollout", "1:2"], "--rollout '1:2': a rollout schedule starts at step 0"),
        (["--rollout", "0-1"], "--rollout '0-1': write STEP:STEPS pairs"),
        (["--width", "10"], "--width must be a multiple of 4"),
        (["--archive", "nowhere.zarr"], "nowhere.zarr cannot be opened as an archive"),
    ],
)
def test_bad_options_are_one_line(tmp_path, flags, message):
    done = run_cli("forecast", *flags, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr

"""--gradient-noise-scale (dmltrain/features/gradient_noise.py): the estimate of a known
noise scale, and a run that logs it to steps.csv while training exactly as without it."""

import csv
import math

import pytest
import torch

from dmltrain import TrainConfig
from dmltrain.config import ConfigError
from dmltrain.features.gradient_noise import GradientNoiseScale
from dmltrain_experiments.mnist import MnistOptions, MnistTrainer
from tiny import TinyOptions, TinyTrainer


def test_the_estimate_finds_a_known_noise_scale():
    """Gradients G + noise of per-sample variance s2 in each of d coordinates, at batch B:
    tr(Σ) = d·s2, so B_simple = d·s2/|G|² (64 here)."""
    d, batch, window = 2000, 16, 4
    generator = torch.Generator().manual_seed(0)
    true = torch.randn(d, generator=generator)
    s2 = 64 * true.square().sum().item() / d
    parameter = torch.nn.Parameter(torch.zeros(d))
    noise = GradientNoiseScale([parameter], window, batch, all_reduce_sum=lambda t: t)
    assert noise.scalars(None) == {}  # no window closed yet
    for _ in range(200 * window):
        parameter.grad = true + torch.randn(d, generator=generator) * math.sqrt(s2 / batch)
        noise.on_before_optimizer_step(None)
    estimate = float(noise.scalars(None)["gradient_noise_scale"])
    assert estimate == pytest.approx(64, rel=0.1)


def test_a_window_with_a_non_finite_gradient_is_left_out():
    parameter = torch.nn.Parameter(torch.zeros(3))
    noise = GradientNoiseScale([parameter], 2, 4, all_reduce_sum=lambda t: t)
    for grad in ([1.0, 2.0, 3.0], [1.5, 2.0, 2.5], [float("inf"), 0.0, 0.0], [1.0, 1.0, 1.0]):
        parameter.grad = torch.tensor(grad)
        noise.on_before_optimizer_step(None)
    assert math.isfinite(float(noise.scalars(None)["gradient_noise_scale"]))


def test_a_run_logs_it_to_steps_csv_and_trains_as_without_it(tmp_path):
    weights = {}
    for name, window in (("plain", 0), ("noise", 2)):
        config = TrainConfig(run_dir=str(tmp_path / name), epochs=2, batch_size=8, log_every=3,
                             progress="off", gradient_noise_scale=window)  # fmt: skip
        trainer = TinyTrainer(config, TinyOptions())
        trainer.fit()
        weights[name] = trainer.unwrapped_model.state_dict()
    for key, value in weights["plain"].items():
        assert torch.equal(value, weights["noise"][key]), key
    with open(tmp_path / "noise" / "steps.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    values = [float(r["gradient_noise_scale"]) for r in rows if r["gradient_noise_scale"]]
    assert len(values) >= len(rows) - 1 and all(math.isfinite(v) for v in values)
    with open(tmp_path / "plain" / "steps.csv", newline="") as handle:
        assert "gradient_noise_scale" not in next(csv.reader(handle))


def test_the_mnist_cnn_trains_bit_for_bit_as_without_it(tmp_path):
    weights, logged = {}, {}
    for window in (0, 4):
        config = TrainConfig(run_dir=str(tmp_path / str(window)), data_dir=str(tmp_path / "data"),
                             epochs=1, max_steps=20, batch_size=64, log_every=10,
                             progress="off", gradient_noise_scale=window)  # fmt: skip
        trainer = MnistTrainer(config, MnistOptions(download=False))
        trainer.fit()
        weights[window] = trainer.unwrapped_model.state_dict()
        with open(tmp_path / str(window) / "steps.csv", newline="") as handle:
            logged[window] = [row.get("gradient_noise_scale") for row in csv.DictReader(handle)]
    for key, value in weights[0].items():
        assert torch.equal(value, weights[4][key]), key
    assert logged[0] == [None, None] and all(math.isfinite(float(v)) for v in logged[4])


def test_a_window_of_one_step_is_refused():
    said = r"--gradient-noise-scale must be 0 \(off\) or at least 2"
    with pytest.raises(ConfigError, match=said):
        TrainConfig(gradient_noise_scale=1)

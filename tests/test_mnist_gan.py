"""Several models and optimizers (dmltrain/engine/step.py's ManualStep, experiments/mnist_gan.py):
the bundled DCGAN trains, and preempted mid-epoch under DDP and FSDP it resumes bitwise
(under FSDP with its activations recomputed, sharded in groups of one rank: HSDP);
bf16 and fp16 run with both optimizers. On tiny (tests/tiny.py --two-optimizers), a step
that calls each layer on its own keeps the ranks' weights equal, and equal to one
process at the same global batch, under DDP, FSDP and Horovod (horovodrun), updated by the
loop or by hand."""

import csv
import math
import subprocess

import pytest
import torch
from helpers import (
    AT_ONCE,
    TINY,
    assert_same_mnist,
    cli_env,
    log_numbers,
    own_port,
    require,
    run_cli,
    signal_at_line,
)

from dmltrain.checkpoint.storage import load_file
from dmltrain.records.training_log import read_training_log

GAN = ["mnist-gan", "--epochs", "1", "--no-download", "--progress", "log", "--log-every", "4",
       "--nprocs", "2"]  # fmt: skip


def test_one_epoch_trains_both_halves(tmp_path):
    run = tmp_path / "run"
    done = run_cli("mnist-gan", "--epochs", "1", "--no-download", "--save-samples",
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = read_training_log(run / "training_log.csv")
    assert set(row) >= {"train_loss", "train_d_loss", "val_loss", "val_d_loss", "val_d_acc"}
    assert math.isfinite(row["train_loss"]) and row["train_d_loss"] < 2 * math.log(2)
    samples = torch.load(run / "samples.pt", weights_only=True)
    assert samples.shape == (64, 1, 28, 28) and samples.std() > 0.1  # digits, not a blank
    state = load_file(run / "checkpoints" / "latest.pt")
    g, d = state["optimizer"]["param_groups"]  # both optimizers, by parameter name
    assert all(n.startswith("generator.") for n in g["params"])
    assert all(n.startswith("discriminator.") for n in d["params"])


def consolidated(run, tmp_path):
    out = tmp_path / f"{run.name}.pt"
    done = run_cli("consolidate", str(run / "checkpoints" / "latest.dcp"), "-o", str(out),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return load_file(out)["model"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_gan_resumed_mid_epoch_ends_bitwise_equal(tmp_path, strategy):
    args = [*GAN, "--strategy", strategy]
    reference = tmp_path / "reference"
    done = run_cli(*args, "--run-dir", str(reference), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    if strategy == "fsdp":  # recomputed, on a (2 x 1) mesh: the maths of FSDP over 2
        args += ["--activation-checkpointing", "--fsdp-shard-size", "1"]
    stop = [*args, "--run-dir", str(run), *AT_ONCE]
    code, err = signal_at_line(stop, "epoch 1/1 step 12/", "SIGUSR1", tmp_path)
    assert code == 3, err
    resumed = run_cli(*args, "--run-dir", str(run), cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert "(epoch 1, 0 steps" not in resumed.stdout  # it stopped mid-epoch
    if strategy == "ddp":
        assert_same_mnist(reference, run)
        return
    assert log_numbers(reference) == log_numbers(run)  # sharded checkpoints: made whole
    a, b = consolidated(reference, tmp_path), consolidated(run, tmp_path)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_gan_in_mixed_precision(tmp_path, precision):
    run = tmp_path / "run"
    small = ["--max-steps", "6", "--width", "8"]
    done = run_cli(*GAN, "--precision", precision, *small, "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    steps = list(csv.DictReader((run / "steps.csv").open()))
    assert steps and all(math.isfinite(float(s["loss"])) for s in steps)
    if precision == "fp16":  # one scaler for both optimizers
        assert float(steps[-1]["grad_scale"]) > 0 and "skipped_steps" in steps[-1]


@pytest.mark.parametrize("mode", ["auto", "manual"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "horovod"])
def test_two_optimizers_keep_ranks_equal_and_equal_one_process(tmp_path, mode, strategy):
    args = [*TINY, "--epochs", "2", "--two-optimizers", mode, "--rank-weights"]
    one = tmp_path / "one"
    done = run_cli(*args, "--batch-size", "16", "--run-dir", str(one), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    two = tmp_path / "two"
    shape = ["--batch-size", "8", "--strategy", strategy, "--run-dir", str(two)]
    if strategy == "horovod":  # under horovodrun, as users launch it
        require("horovodrun")
        done = subprocess.run(
            ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", "dmltrain", *args, *shape],
            cwd=tmp_path, env=cli_env(**own_port()), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    else:
        done = run_cli(*args, *shape, "--nprocs", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    alone = torch.load(one / "final_weights.0.pt", weights_only=True)
    ranks = [torch.load(two / f"final_weights.{r}.pt", weights_only=True) for r in (0, 1)]
    for key in alone:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        torch.testing.assert_close(ranks[0][key], alone[key], rtol=1e-5, atol=1e-6)


def test_calling_around_the_ddp_wrapper_is_one_line(tmp_path):
    """Automatic mode under DDP, a train_step that calls the layers around the wrapper:
    refused at the first step, before the ranks drift apart."""
    done = run_cli(*TINY, "--two-optimizers", "bypass", "--nprocs", "2", "--run-dir",
                   str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2
    assert "train_step did not call self.model: under DDP only its forward" in done.stderr
    alone = run_cli(*TINY, "--two-optimizers", "bypass", "--run-dir", str(tmp_path / "one"),
                    cwd=tmp_path)  # fmt: skip
    assert alone.returncode == 0, alone.stderr  # one process: nothing to keep in step

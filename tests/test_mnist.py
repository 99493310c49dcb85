"""The user's path: `dmltrain mnist` on the bundled sample, as a new user runs it."""

import csv
import itertools
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import (
    AT_ONCE,
    assert_same_mnist,
    cli_env,
    log_numbers,
    own_port,
    require,
    run_cli,
    signal_at_line,
)

from dmltrain.checkpoint.objects import mirror
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime.launch import free_port
from dmltrain_experiments import mnist_data

COLUMNS = ["epoch", "step", "train_loss", "val_loss", "val_acc", "lr", "world_size", "epoch_time_s"]


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
    # MNIST states its FLOPs a sample: the achieved TFLOP/s is logged (MFU needs a GPU's peak)
    steps = list(csv.DictReader((run / "steps.csv").open()))
    assert steps and all(float(row["tflops"]) > 0 for row in steps)
    assert "mfu" not in steps[0]


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
    # steeply down at first; later epochs may tick up by a hair (epoch 9: +0.0004), the
    # last is the lowest
    assert all(b < a for a, b in itertools.pairwise(losses[:5])), losses
    assert losses[-1] == min(losses), losses
    assert rows[2]["val_acc"] >= 0.95, rows[2]
    assert rows[9]["val_acc"] >= 0.96, rows[9]


# The promises once on the model users run (dropout, thread-dependent convolutions): the
# sample, one epoch, 2 processes.
MNIST = ["mnist", "--epochs", "1", "--no-download", "--progress", "log", "--log-every", "4"]
NPROCS = [*MNIST, "--nprocs", "2"]


@pytest.fixture(scope="module")
def mnist_reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("mnist") / "run"
    done = run_cli(*NPROCS, "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_mnist_resumed_mid_epoch_ends_bitwise_equal(mnist_reference, tmp_path, name):
    """A signal to the --nprocs parent at step 12 of 32: checkpoint, exit 3, and the
    resumed run draws the same dropout masks as the uninterrupted one."""
    run = tmp_path / "run"
    args = [*NPROCS, "--run-dir", str(run)]
    code, err = signal_at_line([*args, *AT_ONCE], "epoch 1/1 step 12/", name, tmp_path)
    assert code == 3, err
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert "(epoch 1, 0 steps" not in resumed.stdout  # it stopped mid-epoch
    assert_same_mnist(mnist_reference, run)


def test_mnist_resumed_mid_epoch_from_s3_on_another_machine_ends_bitwise_equal(
    mnist_reference, s3, tmp_path
):
    """--run-dir s3://...: stopped at step 12 of 32, its checkpoint in the store (moto's
    S3 on 127.0.0.1); the job that goes on starts without the local records folder."""
    env, client, _ = s3
    uri = "s3://bucket/mnist"
    args = [*NPROCS, "--run-dir", uri]
    code, err = signal_at_line([*args, *AT_ONCE], "epoch 1/1 step 12/", "SIGUSR1", tmp_path,
                               **env)  # fmt: skip
    assert code == 3, err
    shutil.rmtree(tmp_path / "runs")  # another machine
    resumed = run_cli(*args, cwd=tmp_path, **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {uri}/checkpoints/ckpt-000001-" in resumed.stdout
    assert "(epoch 1, 0 steps" not in resumed.stdout  # it stopped mid-epoch
    local = tmp_path / mirror(uri)
    pointer = client.get_object(Bucket="bucket", Key="mnist/checkpoints/latest")["Body"].read()
    key = f"mnist/checkpoints/{json.loads(pointer)['checkpoint']}"  # the store's, fetched
    latest = client.get_object(Bucket="bucket", Key=key)["Body"].read()
    (local / "checkpoints" / "latest.pt").write_bytes(latest)
    assert_same_mnist(mnist_reference, local)


def test_mnist_through_the_node_local_tier_resumed_mid_epoch_ends_bitwise_equal(
    mnist_reference, tmp_path
):
    """--local-checkpoint-dir: the checkpoints drained to the run directory, the local
    folder left empty, and the resumed run equal to one never stopped."""
    run = tmp_path / "run"
    args = [*NPROCS, "--run-dir", str(run), "--local-checkpoint-dir", str(tmp_path / "local")]
    code, err = signal_at_line([*args, *AT_ONCE], "epoch 1/1 step 12/", "SIGUSR1", tmp_path)
    assert code == 3, err
    assert (run / "checkpoints" / "latest.pt").resolve().name.startswith("ckpt-000001-")
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert_same_mnist(mnist_reference, run)
    assert not [p for p in (tmp_path / "local").rglob("*") if p.is_file()]


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "srun"])
def test_mnist_under_every_launcher_ends_bitwise_equal(
    mnist_reference, tmp_path, launcher, request
):
    """The same command under torchrun, mpirun and srun as under --nprocs 2: each process
    takes its share of the cores (dmltrain.runtime.threads), so the same kernels add up in the
    same order."""
    run = tmp_path / "run"
    dmltrain = [sys.executable, "-m", "dmltrain", *MNIST, "--run-dir", str(run)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(free_port()), *dmltrain[1:]]  # fmt: skip
    elif launcher == "mpirun":
        require("mpirun")
        command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", *dmltrain]
    else:
        request.getfixturevalue("slurm")
        script = tmp_path / "job.sh"
        script.write_text(f"#!/bin/bash\nsrun {' '.join(dmltrain)}\n")
        command = ["sbatch", "--wait", "-n", "2", "-o", str(tmp_path / "out"), str(script)]
    done = subprocess.run(command, env=cli_env(**own_port()), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    out = (tmp_path / "out").read_text() if (tmp_path / "out").exists() else ""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + out[-2000:]
    ranks = json.loads((run / "diagnostics.json").read_text())["ranks"]
    reference = json.loads((mnist_reference / "diagnostics.json").read_text())["ranks"]
    assert [r["threads"] for r in ranks] == [r["threads"] for r in reference]
    assert_same_mnist(mnist_reference, run)


def test_mnist_evaluate_and_predict_count_every_digit_once(mnist_reference, tmp_path):
    """--evaluate and --predict of the reference's checkpoint on 3 FSDP ranks, whose
    validation shards are padded (1,000 digits): the metrics of the run's last validation
    (2 ranks, no padding), and a prediction for each digit in the dataset's order."""
    checkpoint = str(mnist_reference / "checkpoints" / "latest.pt")
    three = ["--nprocs", "3", "--strategy", "fsdp", "--progress", "off"]
    done = run_cli(*MNIST, *three, "--evaluate", checkpoint, "--run-dir", "eval", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    row = log_numbers(mnist_reference)[-1]
    assert metrics["val_samples"] == 1000
    assert metrics["val_loss"] == pytest.approx(row["val_loss"], rel=1e-5)
    assert metrics["val_acc"] == pytest.approx(row["val_acc"], abs=1e-9)
    done = run_cli(*MNIST, *three, "--predict", checkpoint, "--run-dir", "pred", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = torch.load(tmp_path / "pred" / "predictions" / "predictions.pt")
    assert torch.equal(merged["indices"], torch.arange(1000))
    digits, logits = merged["outputs"]["digit"], merged["outputs"]["logits"]
    assert logits.shape == (1000, 10) and torch.equal(digits, logits.argmax(dim=1))
    labels = mnist_data.load(tmp_path / "none", True, "not here", None)[1].tensors[1]
    assert int((digits == labels).sum()) == round(row["val_acc"] * 1000)


def test_mnist_from_webdataset_shards_resumes_mid_epoch_where_each_rank_was(tmp_path):
    """The bundled sample written as real WebDataset tar shards (8 of 500 digits), read by
    `dmltrain mnist --shards` as a stream on 2 processes with 2 loader workers each (a
    shard each): SIGUSR1 at step 12 of 24, then the same command again, ends with the
    same log and weights, bitwise, as a run never stopped; and it learns."""
    pytest.importorskip("webdataset")
    from dmltrain_experiments import mnist_data
    from dmltrain_experiments.mnist_shards import write_shards

    arrays, _ = mnist_data.read_dir(mnist_data.SAMPLE_DIR)
    images, labels = arrays["train_images"], arrays["train_labels"]
    assert write_shards(images, labels, str(tmp_path / "train-%06d.tar"), 500) == 8
    args = [*NPROCS, "--num-workers", "2", "--shards", str(tmp_path / "train-*.tar"),
            "--steps-per-epoch", "24"]  # fmt: skip
    full, split = tmp_path / "full", tmp_path / "split"
    done = run_cli(*args, "--run-dir", str(full), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_training_log(full / "training_log.csv")[0]["val_acc"] > 0.8
    code, err = signal_at_line(
        [*args, "--run-dir", str(split), *AT_ONCE], "epoch 1/1 step 12/", "SIGUSR1", tmp_path
    )
    assert code == 3, err[-3000:]
    resumed = run_cli(*args, "--run-dir", str(split), cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert "the training stream" not in resumed.stdout + resumed.stderr  # nothing to warn of
    assert_same_mnist(full, split)


def test_the_logged_step_loss_is_every_ranks_not_rank_0s(tmp_path):
    """--nprocs 2, 4 steps of 2 x 500 digits: the loss of steps.csv at the epoch's last step,
    the epoch's running mean, is the training log's train_loss over both ranks (it was
    rank 0's own running mean)."""
    run = tmp_path / "run"
    done = run_cli("mnist", "--no-download", "--nprocs", "2", "--epochs", "1",
                   "--batch-size", "500", "--log-every", "2", "--progress", "off",
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(run / "steps.csv", newline="") as handle:
        steps = list(csv.DictReader(handle))
    (row,) = read_training_log(run / "training_log.csv")
    assert [r["step"] for r in steps] == ["2", "4"]
    assert float(steps[-1]["loss"]) == pytest.approx(row["train_loss"], rel=1e-6)


def test_drop_last_leaves_out_the_short_batch_of_an_epoch(tmp_path):
    """4,000 training digits in batches of 1,500: 2 steps an epoch with --drop-last (the
    last 1,000 left out), 3 without; validation still counts all 1,000."""
    for flag, steps in (("--drop-last", 2), ("--no-drop-last", 3)):
        run = tmp_path / flag
        done = run_cli("mnist", "--no-download", "--epochs", "1", "--batch-size", "1500", flag,
                       "--progress", "off", "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"{steps} steps an epoch" in done.stdout
        (row,) = read_training_log(run / "training_log.csv")
        assert row["step"] == steps


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "empty", "foreign", "none"])
def test_broken_shards_are_one_line(tmp_path, damage):
    """--shards with one shard that is junk, cut short, empty or a tar of other files, or
    a glob that matches nothing: one line naming it (exit 2), with 2 loader workers too;
    it was a tarfile traceback, or 'fewer than the 1 processes... write smaller ones'."""
    pytest.importorskip("webdataset")
    import io
    import tarfile

    from dmltrain_experiments import mnist_data
    from dmltrain_experiments.mnist_shards import write_shards

    arrays, _ = mnist_data.read_dir(mnist_data.SAMPLE_DIR)
    assert write_shards(arrays["train_images"][:400], arrays["train_labels"][:400],
                        str(tmp_path / "train-%06d.tar"), 200) == 2  # fmt: skip
    shard = tmp_path / "train-000001.tar"
    if damage == "corrupt":
        shard.write_bytes(b"not a tar file")
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "empty":
        shard.write_bytes(b"")
    elif damage == "foreign":
        with tarfile.open(shard, "w") as tar:
            info = tarfile.TarInfo("notes.txt")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
    pattern = str(tmp_path / ("nothing-*.tar" if damage == "none" else "train-*.tar"))
    done = run_cli("mnist", "--no-download", "--epochs", "1", "--batch-size", "100",
                   "--num-workers", "2", "--shards", pattern, "--progress", "off",
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("dmltrain: error:")]
    if damage == "none":
        assert f"--shards {pattern} matches no file" in line, line
    else:
        assert str(shard) in line and "leave it out of the glob" in line, line

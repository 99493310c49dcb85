"""--evaluate and --predict (dmltrain/engine/evaluation.py): metrics and predictions from a
checkpoint count every sample once, under every strategy (FSDP pads its ranks' shards),
checked against the same numbers computed here from the checkpoint's weights; the
predictions merged in the dataset's order; bad requests as one line."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import cli_env, run_cli
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dmltrain import TrainConfig, UserError
from dmltrain.data.samples import ShardSampler, keyed
from dmltrain.engine.evaluation import real_batches, take
from dmltrain.hooks import TrainerHooks
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime.launch import free_port
from tiny import TinyOptions, TinyTrainer, tiny_data

# 13 validation and 7 test samples: odd, so FSDP's 2 ranks get one padded sample each
SETS = ["--val-samples", "13", "--test-samples", "7"]
TINY = ["tiny", "--progress", "off", *SETS]


def test_padding_is_trimmed_and_every_rank_runs_as_many_batches():
    dataset = keyed(TensorDataset(torch.arange(13.0), torch.arange(13)), seed=0)
    for batch_size in (1, 3, 4, 13):
        seen, batches = [], []
        for rank in (0, 1):
            sampler = ShardSampler(dataset, rank, 2, pad=True)
            loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
            kept = list(real_batches(loader, loader))
            batches.append(len(kept))
            for batch, n in kept:
                assert len(batch[0]) == len(batch[1]) == n or n == 0
                if n:
                    seen += batch[1].tolist()
        assert batches[0] == batches[1]  # FSDP's collective forwards stay matched
        assert sorted(seen) == list(range(13))  # each sample once
    batch = {"x": torch.zeros(4, 2), "names": ["a", "b", "c", "d"], "pair": [torch.ones(4)] * 2}
    cut = take(batch, 3)
    assert cut["x"].shape == (3, 2) and cut["names"] == ["a", "b", "c"]
    assert [t.shape for t in cut["pair"]] == [(3,), (3,)]


def _model(weights):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model.load_state_dict(weights)
    return model.eval()


def _expected(weights):
    """val_loss, test_loss, test_mae and the test predictions, computed directly."""
    x, y = tiny_data(TinyOptions(val_samples=13, test_samples=7))
    model = _model(weights)
    with torch.no_grad():
        val = F.mse_loss(model(x[96:109]), y[96:109]).item()
        out = model(x[109:])
    test, mae = F.mse_loss(out, y[109:]).item(), F.l1_loss(out, y[109:]).item()
    return {"val_loss": val, "test_loss": test, "test_mae": mae}, out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch on 2 FSDP ranks: a sharded checkpoint, and the final weights as one file."""
    run = tmp_path_factory.mktemp("evaluation") / "run"
    done = run_cli(*TINY, "--epochs", "1", "--batch-size", "4", "--nprocs", "2", "--strategy",
                   "fsdp", "--save-weights", "--run-dir", str(run), cwd=run.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_validation_under_fsdp_counts_each_sample_once(trained):
    expected, _ = _expected(torch.load(trained / "final_weights.pt"))
    row = read_training_log(trained / "training_log.csv")[-1]
    assert row["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)


@pytest.mark.parametrize(
    "how",
    [
        [],
        ["--nprocs", "2", "--batch-size", "4"],
        ["--nprocs", "2", "--strategy", "fsdp", "--batch-size", "4"],
        ["--nprocs", "2", "--strategy", "fsdp", "--batch-size", "1"],  # a batch of padding
        ["torchrun", "--strategy", "fsdp", "--batch-size", "3"],
    ],
    ids=["one-process", "ddp", "fsdp", "fsdp-padding-batch", "torchrun-fsdp"],
)
def test_evaluate_is_exact_under_every_strategy(trained, tmp_path, how):
    checkpoint = sorted((trained / "checkpoints").glob("ckpt-*"))[-1]  # sharded (FSDP's)
    run = tmp_path / "eval"
    args = [*TINY, "--evaluate", str(checkpoint), "--run-dir", str(run)]
    if how[:1] == ["torchrun"]:
        port = str(free_port())
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", port, "-m", "dmltrain", *args, *how[1:]]  # fmt: skip
        done = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    else:
        done = run_cli(*args, *how, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dmltrain: evaluated {checkpoint}: val_loss" in done.stdout
    assert not (run / "checkpoints").exists() and not (run / "training_log.csv").exists()
    metrics = json.loads((run / "eval_metrics.json").read_text())
    expected, _ = _expected(torch.load(trained / "final_weights.pt"))
    assert metrics["val_samples"] == 13 and metrics["test_samples"] == 7
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6), name


def test_predict_merges_the_ranks_in_dataset_order(trained, tmp_path):
    run = tmp_path / "predict"
    done = run_cli(*TINY, "--predict", str(trained / "checkpoints" / "latest.dcp"), "--nprocs",
                   "2", "--strategy", "fsdp", "--batch-size", "3", "--run-dir", str(run),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _, expected = _expected(torch.load(trained / "final_weights.pt"))
    merged = torch.load(run / "predictions" / "predictions.pt")
    assert torch.equal(merged["indices"], torch.arange(7))  # the test set, each sample once
    torch.testing.assert_close(merged["outputs"]["y"], expected, rtol=1e-5, atol=1e-6)
    ranks = [torch.load(run / "predictions" / f"rank-{r}.pt") for r in (0, 1)]
    assert [part["indices"].tolist() for part in ranks] == [[0, 2, 4, 6], [1, 3, 5]]


def test_evaluate_from_python_and_what_is_refused(trained, tmp_path):
    latest = trained / "checkpoints" / "latest.dcp"
    options = TinyOptions(val_samples=13, test_samples=7)
    config = TrainConfig(run_dir=str(tmp_path / "py"), progress="off", batch_size=5)
    metrics = TinyTrainer(config, options).evaluate(latest)
    expected, _ = _expected(torch.load(trained / "final_weights.pt"))
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6), name

    class NoPredictions(TinyTrainer):
        predict_step = TrainerHooks.predict_step

    config = config.replace(run_dir=str(tmp_path / "none"))
    with pytest.raises(UserError, match="defines no predict_step"):
        NoPredictions(config, options).predict(latest)
    with pytest.raises(UserError, match="holds no averaged weights"):
        TinyTrainer(config, options).evaluate(latest, ema=True)

    for flags, line in [
        (["--evaluate", str(latest), "--predict", str(latest)], "separate runs"),
        (["--evaluate", str(latest), "--load-weights", str(latest)], "drop --load-weights"),
        (["--evaluate", str(tmp_path / "missing.pt")], "does not exist"),
    ]:
        done = run_cli(*TINY, *flags, "--run-dir", str(tmp_path / "refused"), cwd=tmp_path)
        assert done.returncode == 2 and line in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_preempted_evaluation_stops_for_requeue_and_runs_again_whole(trained, tmp_path):
    """SIGUSR1 to rank 1 at its first validation batch (tiny signals in train_step, which
    its val_step calls): every rank stops at the same batch with exit status 3 and writes
    nothing; run again, it gives the uninterrupted evaluation's numbers."""
    checkpoint = str(sorted((trained / "checkpoints").glob("ckpt-*"))[-1])
    args = ["tiny", "--progress", "off", "--val-samples", "40", "--nprocs", "2",
            "--strategy", "fsdp", "--batch-size", "1", "--evaluate", checkpoint]  # fmt: skip
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    signal = ["--signal-rank", "1", "--signal-at-step", "0"]
    cut = run_cli(*args, *signal, "--run-dir", "cut", cwd=tmp_path)
    assert cut.returncode == 3, cut.stderr[-3000:]
    assert "preempted during the evaluation" in cut.stderr
    assert not (tmp_path / "cut" / "eval_metrics.json").exists()
    again = run_cli(*args, "--run-dir", "cut", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = (
        json.loads((tmp_path / run / "eval_metrics.json").read_text()) for run in ("whole", "cut")
    )
    assert a == b and a["val_samples"] == 40

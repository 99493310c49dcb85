"""The averaged weights (dmltrain/features/ema.py): the update rule, and a run of 2 real processes
with dropout and augmentation preempted mid-epoch and resumed, equal to an uninterrupted
one bitwise, the average included (under DDP and FSDP); best.pt by the average's
validation; consolidate --ema and --load-weights --ema."""

import pytest
import torch
from helpers import AT_ONCE, RANDOM, TINY, assert_same_run, log_numbers, run_cli
from torch import nn

from dmltrain.checkpoint.storage import consolidate, list_checkpoints, load_file
from dmltrain.features.ema import EMA
from dmltrain.records.training_log import read_training_log

# 2 processes x 4: 12 steps an epoch
BASE = ["tiny", "--nprocs", "2", "--batch-size", "4", "--epochs", "2", "--save-weights",
        "--progress", "off", "--ema-decay", "0.9", "--ema-warmup-steps", "3",
        "--ema-every-steps", "2", *RANDOM]  # fmt: skip


def test_the_average_copies_during_warm_up_then_moves_by_one_minus_decay():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = EMA(model, decay=0.75, warmup_steps=2, every_steps=2)
    weight = model[0].weight
    for step in range(1, 7):
        with torch.no_grad():
            weight.add_(1.0)  # an optimizer step
        before = ema.state_dict()["0.weight"]
        ema.update(step)
        after = ema.state_dict()["0.weight"]
        if step % 2:  # not this step
            assert torch.equal(after, before)
        elif step <= 2:  # warm-up: a copy
            assert torch.equal(after, weight.detach())
        else:
            assert torch.allclose(after, before + 0.25 * (weight.detach() - before))
    state = ema.state_dict()
    assert set(state) == set(model.state_dict())  # num_batches_tracked copied, not averaged
    with ema.swapped_in():
        assert torch.equal(model[0].weight, state["0.weight"])
    assert not torch.equal(model[0].weight, state["0.weight"])  # the weights are back


def test_a_resumed_run_keeps_its_average_bit_for_bit(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = run_cli(*BASE, "--run-dir", str(whole), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    stop = ["--signal-rank", "1", "--signal-at-step", "8", *AT_ONCE]
    assert run_cli(*BASE, "--run-dir", str(cut), *stop, cwd=tmp_path).returncode == 3
    done = run_cli(*BASE, "--run-dir", str(cut), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(whole, cut)  # weights, and the log with val_ema_loss
    a, b = (load_file(list_checkpoints(run / "checkpoints")[0])["ema"] for run in (whole, cut))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    rows = log_numbers(whole)
    assert all("val_ema_loss" in row for row in rows)
    best = load_file(whole / "checkpoints" / "best.pt")
    assert best["best_value"] == min(row["val_ema_loss"] for row in rows)

    # One file whose model is the average, and a run that starts from it
    done = run_cli("consolidate", "--ema", str(whole / "checkpoints" / "latest.pt"), "-o",
                   str(tmp_path / "avg.pt"), cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    averaged = torch.load(tmp_path / "avg.pt", weights_only=True)["model"]
    assert all(torch.equal(averaged[k], a[k]) for k in a)
    done = run_cli("tiny", "--epochs", "1", "--progress", "off", "--run-dir",
                   str(tmp_path / "plain"), cwd=tmp_path)  # fmt: skip
    no_average = run_cli("tiny", "--run-dir", str(tmp_path / "x"), "--load-weights",
                         str(tmp_path / "plain" / "checkpoints" / "latest.pt"), "--ema",
                         cwd=tmp_path)  # fmt: skip
    assert no_average.returncode == 2
    assert "holds no averaged weights (trained without --ema-decay)" in no_average.stderr


def test_under_fsdp_each_rank_averages_its_shard_and_a_resume_keeps_it(tmp_path):
    """FSDP: every rank averages its shard of each weight; a full checkpoint holds the
    whole average (gathered), a sharded one every rank's shards of it (nothing gathered:
    trainer.pt has none), and a resumed run equals an uninterrupted one bitwise, the
    average included, in both. consolidate --ema of the sharded one gives the average."""

    def average(checkpoint):
        if checkpoint.suffix == ".pt":
            return load_file(checkpoint)["ema"]
        assert "ema" not in load_file(checkpoint)
        out = consolidate(checkpoint, tmp_path / f"{checkpoint.parent.parent.name}.pt", ema=True)
        return torch.load(out, weights_only=True)["model"]

    averages = {}
    for kind in ("full", "sharded"):
        args = [*BASE, "--strategy", "fsdp", "--checkpoint-format", kind]
        whole, cut = tmp_path / f"whole-{kind}", tmp_path / f"cut-{kind}"
        assert run_cli(*args, "--run-dir", str(whole), cwd=tmp_path).returncode == 0
        stop = ["--signal-rank", "0", "--signal-at-step", "8", *AT_ONCE]
        assert run_cli(*args, "--run-dir", str(cut), *stop, cwd=tmp_path).returncode == 3
        done = run_cli(*args, "--run-dir", str(cut), cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert_same_run(whole, cut)
        a, b = (average(list_checkpoints(r / "checkpoints")[0]) for r in (whole, cut))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        averages[kind] = a
    full, sharded = averages["full"], averages["sharded"]
    assert all(torch.allclose(full[k], sharded[k], rtol=1e-5, atol=1e-7) for k in full)
    newest = list_checkpoints(tmp_path / "cut-sharded" / "checkpoints")[0]
    done = run_cli(
        "consolidate",
        "--ema",
        str(newest),
        "-o",
        str(tmp_path / "avg.pt"),
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    model = torch.load(tmp_path / "avg.pt", weights_only=True)["model"]
    assert all(torch.equal(model[k], sharded[k]) for k in sharded)


@pytest.mark.parametrize("api", ["old", "new"])
def test_spectral_norms_vectors_are_copied_so_the_average_validates_like_the_model(tmp_path, api):
    """An average of power-iteration vectors is no unit vector: the averaged model's sigma
    would be wrong. Buffers are the live model's, so the average's loss stays in range."""
    run = tmp_path / "run"
    args = [*TINY, "--blocks", "--spectral", api, "--ema-decay", "0.99", "--run-dir", str(run)]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    state = load_file(run / "checkpoints" / "latest.pt")
    vectors = [k for k in state["model"] if k.endswith(("_u", "_v"))]
    assert len(vectors) == 4
    for key in vectors:
        assert torch.equal(state["ema"][key], state["model"][key]), key
        assert torch.linalg.vector_norm(state["ema"][key]).item() == pytest.approx(1.0)
    model = state["model"]
    averaged = {k for k in model if not torch.equal(state["ema"][k], model[k])}
    assert averaged and all(k.endswith(("weight", "weight_orig", "original", "bias"))
                            for k in averaged), averaged  # fmt: skip
    rows = read_training_log(run / "training_log.csv")
    live = [r["val_loss"] for r in rows]
    assert all(r["val_ema_loss"] < 1.2 * max(live) for r in rows), rows

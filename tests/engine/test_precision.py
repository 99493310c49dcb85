"""Mixed precision, gradient accumulation, clipping and torch.compile."""

import subprocess
import sys

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import SAMPLE, assert_same_run, cli_env, own_port, require, run_cli
from torch.utils.data import DataLoader, DistributedSampler

from dmltrain import TrainConfig, UserError
from dmltrain.checkpoint.storage import load_file
from dmltrain.engine.precision import Precision, check_available
from dmltrain.records.training_log import read_training_log
from tiny import TinyOptions, TinyTrainer

TINY = [*helpers.TINY, "--batch-size", "64"]


def run_tiny(run, *args, ok=True):
    done = run_cli(*TINY, *args, "--run-dir", str(run), cwd=run.parent)
    if ok:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_unavailable_precision_is_a_clear_error():
    # autocast has no "meta" device: the same path as fp16 on a CPU torch without it
    with pytest.raises(UserError, match=r"--precision fp16 is not available on meta .*use"):
        check_available("fp16", torch.device("meta"))
    check_available("fp32", torch.device("meta"))


@pytest.mark.parametrize("kind", ["fp32", "fp16", "bf16"])
def test_forward_computes_in_the_chosen_dtype(kind):
    precision = Precision(kind, torch.device("cpu"))
    out = precision.forward(lambda x: x @ x, torch.ones(4, 4))
    assert out.dtype == (precision.dtype or torch.float32)
    assert (precision.scaler is not None) == (kind == "fp16")
    assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.float32  # autocast left


def test_fp16_overflow_is_skipped_and_counted_not_a_nan(tmp_path):
    """An enormous loss overflows fp16 gradients: the scaler drops those steps and lowers
    its scale; --check-nans does not call that a NaN."""
    run = tmp_path / "run"
    run_tiny(run, "--precision", "fp16", "--check-nans", "--batch-size", "8", "--epochs", "1")
    rows = read_training_log(run / "training_log.csv")
    skipped = rows[0]["skipped_steps"]
    assert skipped >= 1  # the initial scale, 2**16, overflows at least once on step 1
    assert not (run / "nan_report.txt").exists()
    scaler = load_file(run / "checkpoints" / "latest.pt")["scaler"]
    assert scaler["skipped"] == skipped and scaler["scaler"]["scale"] < 2.0**16


def test_scaler_state_survives_checkpoint_and_resume_bit_exactly(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    args = ["--precision", "fp16", "--batch-size", "8"]
    run_tiny(full, *args)
    first = run_tiny(split, *args, "--epochs-per-job", "2", ok=False)
    assert first.returncode == 3, first.stderr
    mid = load_file(split / "checkpoints" / "latest.pt")["scaler"]
    assert mid is not None and mid["scaler"]["scale"] > 0
    run_tiny(split, *args)
    assert_same_run(full, split)
    a = load_file(full / "checkpoints" / "latest.pt")["scaler"]
    b = load_file(split / "checkpoints" / "latest.pt")["scaler"]
    assert a == b
    # fine-tuning: --load-scaler takes the calibrated scale (and its count) along
    source = str(full / "checkpoints" / "latest.pt")
    tuned = tmp_path / "tuned"
    run_tiny(tuned, *args, "--epochs", "1", "--load-weights", source, "--load-scaler")
    after = load_file(tuned / "checkpoints" / "latest.pt")["scaler"]
    # calibrated already: no overflow in its 12 steps, and the scaler counts on from there
    assert after["skipped"] == a["skipped"] and after["scaler"]["scale"] == a["scaler"]["scale"]
    assert after["scaler"]["_growth_tracker"] == a["scaler"]["_growth_tracker"] + 12


def test_grad_accumulation_equals_a_larger_batch(tmp_path):
    one = tmp_path / "one"
    run_tiny(one, "--batch-size", "16")
    accum = tmp_path / "accum"
    run_tiny(accum, "--batch-size", "4", "--grad-accum", "4")
    assert_same_run(one, accum, rel=1e-5)
    # and with DDP (no_sync on the non-final micro-batches): 2 ranks x 2 x 4 = 16
    ddp = tmp_path / "ddp"
    run_tiny(ddp, "--batch-size", "4", "--grad-accum", "2", "--nprocs", "2")
    assert_same_run(one, ddp, rel=1e-5)


def test_grad_accumulation_with_a_short_last_group(tmp_path):
    """96 samples in batches of 8 with 5 micro-batches per step: the last step of an
    epoch has 2; its loss is averaged over those 2, as one batch of 16 would be."""
    run = tmp_path / "run"
    run_tiny(run, "--batch-size", "8", "--grad-accum", "5", "--epochs", "1")
    state = load_file(run / "checkpoints" / "latest.pt")
    assert state["global_step"] == 3  # ceil(12 batches / 5)


def hand_written_clipped_loop(epochs, batch_size, clip, seed=0):
    """What a researcher would write: same model, data, order and optimizer as tiny."""
    trainer = TinyTrainer(TrainConfig(), TinyOptions())
    train_set, _ = trainer.create_datasets()
    torch.manual_seed(seed)
    model = trainer.create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # as the default
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
    return model.state_dict()


def test_clipping_equals_manual_clipping(tmp_path):
    run = tmp_path / "run"
    run_tiny(run, "--batch-size", "8", "--grad-clip", "0.05")
    ours = torch.load(run / "final_weights.pt", weights_only=True)
    manual = hand_written_clipped_loop(epochs=3, batch_size=8, clip=0.05)
    for key in manual:
        assert torch.equal(ours[key], manual[key]), key
    unclipped = tmp_path / "unclipped"
    run_tiny(unclipped, "--batch-size", "8")
    other = torch.load(unclipped / "final_weights.pt", weights_only=True)
    assert not torch.equal(ours["0.weight"], other["0.weight"])  # clipping was active


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_and_fp16_with_two_processes(tmp_path, strategy):
    """Both precisions run under DDP and FSDP (its mixed-precision policy) and stay close
    to the fp32 run."""
    base = ["--batch-size", "8", "--nprocs", "2", "--strategy", strategy]
    fp32 = tmp_path / "fp32"
    run_tiny(fp32, *base)
    ref = read_training_log(fp32 / "training_log.csv")[-1]["val_loss"]
    for kind in ("bf16", "fp16"):
        run = tmp_path / kind
        run_tiny(run, *base, "--precision", kind, "--grad-clip", "1.0", "--check-nans")
        last = read_training_log(run / "training_log.csv")[-1]["val_loss"]
        assert last == pytest.approx(ref, rel=0.1), kind


def test_horovod_with_fp16_accumulation_and_clipping(tmp_path):
    """Horovod's path: gradients synchronized before unscaling and clipping, the step under
    skip_synchronize, reduction every --grad-accum backward passes; same run as DDP."""
    require("horovodrun")
    args = ["--batch-size", "4", "--grad-accum", "2", "--precision", "fp16", "--grad-clip", "0.5"]
    ddp = tmp_path / "ddp"
    run_tiny(ddp, *args, "--nprocs", "2")
    hvd = tmp_path / "hvd"
    done = subprocess.run(
        ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
         "dmltrain", *TINY, *args, "--strategy", "horovod", "--run-dir", str(hvd)],
        cwd=tmp_path, env=cli_env(**own_port()), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert_same_run(ddp, hvd, rel=1e-4)


def test_compile_composes_with_precision_and_ddp(tmp_path):
    plain = tmp_path / "plain"
    run_tiny(plain, "--batch-size", "8", "--nprocs", "2", "--epochs", "2")
    compiled = tmp_path / "compiled"
    run_tiny(compiled, "--batch-size", "8", "--nprocs", "2", "--epochs", "2", "--compile")
    assert_same_run(plain, compiled, rel=1e-4)
    # checkpoints of a compiled model have plain keys and resume into a compiled model
    state = load_file(compiled / "checkpoints" / "latest.pt")
    assert sorted(state["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    more = run_tiny(compiled, "--batch-size", "8", "--nprocs", "2", "--epochs", "3", "--compile")
    assert "dmltrain: resuming from" in more.stdout
    bf16 = tmp_path / "bf16"
    run_tiny(bf16, "--batch-size", "8", "--epochs", "1", "--compile", "--precision", "bf16")


@pytest.mark.slow
def test_mnist_bf16_and_fp16_reach_fp32_accuracy(tmp_path):
    """Same steps, same seed: mixed precision within 1 accuracy point of fp32 over the
    first 20 steps (about 82% here). Not a whole epoch: CPU autocast runs the CNN's bf16
    and fp16 kernels many times slower than fp32 (test_mnist trains to the accuracy
    target in fp32)."""
    accuracy = {}
    steps = 20
    for kind in ("fp32", "bf16", "fp16"):
        run = tmp_path / kind
        done = run_cli(
            "mnist",
            "--epochs",
            "1",
            "--max-steps",
            str(steps),
            "--precision",
            kind,
            "--data-dir",
            str(SAMPLE),
            "--progress",
            "off",
            "--run-dir",
            str(run),
            cwd=tmp_path,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        rows = read_training_log(run / "training_log.csv")
        assert rows[-1]["step"] == steps, rows[-1]
        accuracy[kind] = rows[-1]["val_acc"]
    assert accuracy["fp32"] > 0.75, accuracy
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01, accuracy
    assert abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.01, accuracy


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_mixed_precision_on_a_gpu_with_nccl(tmp_path, kind, strategy):
    """NCCL DDP and FSDP on the GPU(s); fp16 with its scaler: resumes bit-exactly after a
    stop."""
    n = str(min(torch.cuda.device_count(), 2))
    args = [*TINY, "--batch-size", "8", "--precision", kind, "--nprocs", n, "--check-nans"]
    args += ["--strategy", strategy]
    full, split = tmp_path / "full", tmp_path / "split"
    for run, extra in ((full, []), (split, ["--epochs-per-job", "2"]), (split, [])):
        done = run_cli(*args, *extra, "--run-dir", str(run), cwd=tmp_path, gpus=True)
        assert done.returncode in (0, 3), done.stderr[-2000:]
    assert_same_run(full, split)
    state = load_file(full / "checkpoints" / ("latest.dcp" if strategy == "fsdp" else "latest.pt"))
    assert state["config"]["train"]["precision"] == kind
    assert (state["scaler"] is not None) == (kind == "fp16")


def test_matmul_precision_is_set_on_a_gpu_and_left_alone_on_the_cpu():
    """torch's process-wide setting, read by CUDA matmuls (set here without a GPU: it is
    a setting only); the CPU's results stay fp32, as the bitwise tests need."""
    from dmltrain.engine.precision import set_matmul_precision

    before = torch.get_float32_matmul_precision()
    try:
        set_matmul_precision("medium", torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == before
        set_matmul_precision("medium", torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)

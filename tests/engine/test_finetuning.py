"""Fine-tuning as users run it: pretrained weights mapped into a new model, frozen parts,
learning rates by group and LoRA adapters, under one process and two (DDP, FSDP,
Horovod), resumed after a preemption, exported as safetensors."""

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import (
    AT_ONCE,
    TINY,
    assert_same_run,
    cli_env,
    final_weights,
    require,
    run_cli,
    signal_at_line,
)

from dmltrain.checkpoint.storage import load_file

MNIST = ["mnist", "--no-download", "--progress", "off"]
TRANSFORMER = [*TINY, "--transformer", "--epochs", "2"]
LORA = ["--lora-targets", "blocks.*.q", "blocks.*.v", "--lora-rank", "2"]


def _ok(done):
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def pretrained_mnist(tmp_path_factory):
    """The bundled MNIST CNN trained one epoch: the weights a fine-tune starts from."""
    run = tmp_path_factory.mktemp("pretrain") / "run"
    _ok(run_cli(*MNIST, "--epochs", "1", "--run-dir", str(run), cwd=run.parent, timeout=600))
    return run / "checkpoints" / "latest.pt"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "horovod"])
def test_a_new_head_on_frozen_convolutions_leaves_them_bitwise_as_pretrained(
    pretrained_mnist, tmp_path, strategy
):
    """The done-when run: a 5-way head on the 5-class subset, the convolutions frozen."""
    args = [*MNIST, "--epochs", "1", "--max-steps", "12", "--classes", "5", "--load-partial"]
    args += ["--load-weights", str(pretrained_mnist), "--freeze", "conv*", "--checkpoint-format"]
    args += ["full", "--run-dir", str(tmp_path / "run"), "--strategy", strategy]
    if strategy == "horovod":  # Horovod's own launcher, as its users start it
        require("horovodrun")
        command = ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", sys.executable]
        done = subprocess.run([*command, "-m", "dmltrain", *args], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        _ok(done)
    else:
        done = _ok(run_cli(*args, "--nprocs", "2", cwd=tmp_path, timeout=600))
    said = done.stdout + done.stderr
    assert "shape differs 2 (fc2.weight (10, 128) in file vs (5, 128) in model" in said
    report = json.loads((tmp_path / "run" / "load_report.json").read_text())
    assert [line.split()[0] for line in report["shapes"]] == ["fc2.weight", "fc2.bias"]
    assert report["loaded"] == [
        f"{n}.{p}" for n in ("conv1", "conv2", "fc1") for p in ("bias", "weight")
    ]
    before = load_file(pretrained_mnist)["model"]
    after = final_weights(tmp_path / "run")
    for name in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"):
        assert torch.equal(before[name], after[name]), name
    assert not torch.equal(before["fc1.weight"], after["fc1.weight"])  # the rest trained
    assert after["fc2.weight"].shape == (5, 128)
    state = load_file(tmp_path / "run" / "checkpoints" / "latest.pt")
    trained = [n for g in state["optimizer"]["param_groups"] for n in g["params"]]
    assert trained == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # frozen: left out


def _hf_layout(folder, weights, shards=2):
    """``weights`` as Hugging Face saves a large model: safetensors shards and their index."""
    from safetensors.torch import save_file

    folder.mkdir()
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n].contiguous() for n in names[i::shards]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_safetensors_in_the_hf_layout_load_under_a_map_and_train(tmp_path):
    """A model saved elsewhere under other names (a ``model.`` prefix, another layer name)."""
    torch.manual_seed(1)
    from tiny_models import Transformer

    theirs = {f"model.{k}".replace(".blocks.", ".layers."): v.clone()
              for k, v in Transformer(4).state_dict().items()}  # fmt: skip
    _hf_layout(tmp_path / "hf", theirs)
    run = tmp_path / "run"
    args = [*TRANSFORMER, "--epochs", "1", "--run-dir", str(run), "--checkpoint-every-steps", "1"]
    args += ["--load-weights", str(tmp_path / "hf"), "--load-map", "model.=", "layers.=blocks."]
    done = _ok(run_cli(*args, "--max-steps", "1", cwd=tmp_path))
    assert f"(safetensors shards): loaded {len(theirs)};" in done.stdout
    first = load_file(run / "checkpoints" / "latest.pt")["model"]
    embed = theirs["model.embed.weight"]
    assert not torch.equal(first["embed.weight"], embed)  # one step trained from it...
    assert torch.allclose(first["embed.weight"], embed, atol=2e-3)  # ...not from anew
    unmapped = _fails(run_cli(*TRANSFORMER, "--run-dir", str(tmp_path / "r2"), "--load-weights",
                              str(tmp_path / "hf"), cwd=tmp_path))  # fmt: skip
    assert "does not fit this model: missing keys blocks.0.down.bias" in unmapped
    assert "rename keys with --load-map OLD=NEW" in unmapped


def _fails(done):
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def pretrained_transformer(tmp_path_factory):
    run = tmp_path_factory.mktemp("transformer") / "run"
    _ok(run_cli(*TRANSFORMER, "--run-dir", str(run), cwd=run.parent))
    return run / "checkpoints" / "latest.pt"


def _lora_model(weights):
    import peft

    from tiny_models import Transformer

    model = peft.inject_adapter_in_model(
        peft.LoraConfig(target_modules=["blocks.0.q", "blocks.0.v", "blocks.1.q", "blocks.1.v"],
                        r=2, lora_alpha=16), Transformer(4))  # fmt: skip
    model.load_state_dict(weights, strict=True)
    return model.eval()


@pytest.mark.slow
def test_lora_trains_only_its_adapters_resumes_bitwise_and_exports_merged(
    pretrained_transformer, tmp_path
):
    from safetensors.torch import load_file as load_safetensors

    from tiny_models import Transformer

    source = tmp_path / "pretrained.pt"  # removed before the resume: it reads its own files
    source.write_bytes(pretrained_transformer.read_bytes())
    args = [*TRANSFORMER, "--epochs", "3", "--load-weights", str(source), *LORA]
    whole = tmp_path / "whole"
    _ok(run_cli(*args, "--run-dir", str(whole), cwd=tmp_path))
    # only the adapters changed: the frozen base is the pretrained model, bitwise
    before = load_file(pretrained_transformer)["model"]
    base = load_safetensors(whole / "base.safetensors")
    assert sorted(base) == sorted(
        k.replace(".q.", ".q.base_layer.").replace(".v.", ".v.base_layer.") for k in before
    )
    for key, value in base.items():
        assert torch.equal(value, before[key.replace("base_layer.", "")]), key
    state = load_file(whole / "checkpoints" / "latest.pt")
    adapters = state["model"]
    assert sorted(adapters) == sorted(
        f"blocks.{b}.{m}.lora_{x}.default.weight" for b in (0, 1) for m in "qv" for x in "AB"
    )
    assert all(adapters[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # trained
    # smaller by the expected ratio: a rank-2 adapter of a 64x64 layer holds 2 x (64 + 64)
    numel = sum(v.numel() for v in adapters.values())
    assert numel == 4 * 2 * (64 + 64)
    full = sum(v.numel() for v in before.values())
    assert numel / full == pytest.approx(1024 / full)
    lora_size = (whole / "checkpoints" / "latest.pt").stat().st_size
    assert lora_size < pretrained_transformer.stat().st_size / 10
    # a SIGUSR1 mid-epoch, then a resume: bitwise the run that was never stopped
    run = tmp_path / "stopped"
    stop = [*args, "--run-dir", str(run), "--progress", "log", "--log-every", "1", *AT_ONCE]
    status, err = signal_at_line(stop, "epoch 2/3 step 5/", "SIGUSR1", tmp_path)
    assert status == 3, err
    source.unlink()
    resumed = _ok(run_cli(*args, "--run-dir", str(run), cwd=tmp_path))
    assert "resuming from" in resumed.stdout and "weights from" not in resumed.stdout
    assert "(epoch 2, 0 steps" not in resumed.stdout  # it stopped mid-epoch
    assert_same_run(whole, run)
    # exported merged: the plain model's outputs equal the adapted model's
    merged = tmp_path / "merged.safetensors"
    _ok(run_cli("export", str(whole), "--merge-lora", "-o", str(merged), cwd=tmp_path))
    plain = Transformer(4).eval()
    plain.load_state_dict(load_safetensors(merged), strict=True)
    adapted = _lora_model({**base, **adapters})
    x = torch.randn(16, 4)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), adapted(x), rtol=1e-5, atol=1e-6)
    unmerged = tmp_path / "unmerged.safetensors"
    _ok(run_cli("export", str(whole), "-o", str(unmerged), cwd=tmp_path))
    assert load_safetensors(unmerged).keys() == {**base, **adapters}.keys()


def _lrs(checkpoint):
    return [group["lr"] for group in load_file(checkpoint)["optimizer"]["param_groups"]]


def test_lr_scale_gives_each_group_its_rate_at_step_1_and_after_a_resume(tmp_path):
    """A cosine schedule over 12 steps scales both groups; a resume keeps them."""
    args = [*TINY, "--epochs", "1", "--schedule", "cosine", "--lr-scale", "0.*=0.1"]
    args += ["--checkpoint-every-steps", "1", "--keep-last", "0"]
    whole = tmp_path / "whole"
    _ok(run_cli(*args, "--run-dir", str(whole), cwd=tmp_path))
    first = _lrs(whole / "checkpoints" / "ckpt-000001-00000001.pt")
    cosine = 1e-3 * (1 + math.cos(math.pi / 12)) / 2
    assert first == pytest.approx([cosine, 0.1 * cosine], rel=1e-12)
    state = load_file(whole / "checkpoints" / "ckpt-000001-00000001.pt")
    groups = [g["params"] for g in state["optimizer"]["param_groups"]]
    assert groups == [["2.weight", "2.bias"], ["0.weight", "0.bias"]]
    run = tmp_path / "stopped"
    stopping = [*args, "--run-dir", str(run), "--signal-rank", "0", "--signal-at-step", "5"]
    assert run_cli(*stopping, *AT_ONCE, cwd=tmp_path).returncode == 3
    _ok(run_cli(*args, "--run-dir", str(run), cwd=tmp_path))
    for step in (5, 6, 12):
        name = f"ckpt-000001-{step:08d}.pt"
        assert _lrs(run / "checkpoints" / name) == _lrs(whole / "checkpoints" / name), step
    assert_same_run(whole, run)


@pytest.mark.slow
def test_lora_under_fsdp_resumes_its_sharded_adapters_and_exports_ddps_model(
    pretrained_transformer, tmp_path
):
    """Frozen and trained parameters in one FSDP unit (the blocks), the pretrained weights
    sent out by the sharded initialisation; a resume reads the adapters' shards alone."""
    args = [*TRANSFORMER, "--load-weights", str(pretrained_transformer), *LORA, "--nprocs", "2"]
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    sharded = [*args, "--strategy", "fsdp", "--run-dir", str(fsdp)]
    _ok(run_cli(*sharded, "--epochs", "2", cwd=tmp_path))
    resumed = _ok(run_cli(*sharded, "--epochs", "3", cwd=tmp_path))
    assert "resuming from" in resumed.stdout
    _ok(run_cli(*args, "--epochs", "3", "--run-dir", str(ddp), cwd=tmp_path))
    for run in (fsdp, ddp):
        _ok(run_cli("export", str(run), "--merge-lora", "-o", f"{run}.safetensors", cwd=tmp_path))
    from safetensors.torch import load_file as load_safetensors

    a, b = (load_safetensors(f"{run}.safetensors") for run in (fsdp, ddp))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


@pytest.mark.quick
@pytest.mark.parametrize(
    "flags, says",
    [
        (["--freeze", "conv*"], "--freeze 'conv*' matches no parameter of the model"),
        (["--freeze", "*"], "--freeze * freezes every parameter of the model"),
        (["--lr-scale", "head*=0.1"], "--lr-scale 'head*' matches no parameter"),
        (["--lr-scale", "0.*"], "--lr-scale takes PATTERN=FACTOR"),
        (["--load-map", "model."], "--load-map takes OLD=NEW"),
        (["--lora-targets", "attn*"], "--lora-targets 'attn*' matches no module of the model"),
        (["--lora-targets", "1"], "--lora-targets: PEFT cannot adapt 1"),
        (["--lora-targets", "0", "--ema-decay", "0.9"], "does not work with --ema-decay"),
        (
            ["--load-weights", "w.pt", "--load-partial", "--load-optimizer"],
            "go on with a checkpoint",
        ),
        (["--load-weights", "missing.pt"], "--load-weights missing.pt does not exist"),
    ],
)
def test_bad_fine_tuning_input_is_one_line(tmp_path, flags, says):
    torch.save({"0.weight": torch.ones(8, 4)}, tmp_path / "w.pt")
    line = _fails(run_cli(*TINY, "--run-dir", str(tmp_path / "run"), *flags, cwd=tmp_path))
    assert says in line, line

"""Models that do not fit (dmltrain/runtime/sharding.py): activation checkpointing, FSDP's
sharded initialisation, hybrid sharding (HSDP) and CPU offload.

Real processes (``--nprocs``, Gloo on the CPU). tiny's ``--blocks`` model has dropout, a
batch norm and buffers (one left out of the state dict) inside the recomputed modules:
with ``--activation-checkpointing`` every run ends bitwise equal to the run without it,
under one process, DDP and FSDP, while each block's forward runs once more a step. Under
FSDP, rank 0 alone builds the model; the others build it on the meta device and receive
their shards, bitwise the weights of one process. HSDP (4 ranks as 2 x 2) ends within
float rounding of FSDP over 4 (the gradients are summed in another order); preempted and
resumed with activation checkpointing it ends bitwise equal to the uninterrupted run, and
its sharded checkpoint resumes under FSDP on 2 and DDP on 1. CPU offload needs a GPU:
mocked nowhere; its test runs when one is lent.
"""

import math
import shutil

import pytest
import torch
from helpers import AT_ONCE, RANDOM, TINY, assert_same_run, final_weights, run_cli
from torch import nn

from dmltrain.config import DistConfig, MemoryConfig
from dmltrain.errors import UserError
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime import sharding
from dmltrain.runtime.launch import DistInfo
from dmltrain.runtime.strategies import create_strategy

BLOCKS = [*TINY, *RANDOM, "--blocks"]  # 3 epochs of 12 steps at a global batch of 8
STEPS = 36
AC = "--activation-checkpointing"


def shape(nprocs: int, strategy: str) -> list[str]:
    return ["--nprocs", str(nprocs), "--batch-size", str(8 // nprocs), "--strategy", strategy]


def train(run, *args: str, code: int = 0) -> None:
    done = run_cli(*args, "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == code, done.stderr[-3000:]


@pytest.mark.parametrize(
    "memory, strategy, world, device, says",
    [
        (MemoryConfig(fsdp_shard_size=2), "ddp", 4, "cpu", "--fsdp-shard-size needs --strategy"),
        (MemoryConfig(fsdp_shard_size=3), "fsdp", 4, "cpu", "must divide the number of processes"),
        (MemoryConfig(fsdp_shard_size=8), "fsdp", 4, "cpu", "must divide the number of processes"),
        (MemoryConfig(cpu_offload=True), "fsdp", 2, "cpu", "this run is on the CPU"),
        (MemoryConfig(cpu_offload=True), "ddp", 2, "cpu", "--cpu-offload needs --strategy fsdp"),
    ],
)  # fmt: skip
def test_settings_that_cannot_run_are_refused_before_any_process_starts(
    memory, strategy, world, device, says
):
    parent = DistInfo(world_size=world, launcher="spawn", device=device, workers=world)
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
        create_strategy(parent, DistConfig(strategy=strategy), memory)


def test_the_refusal_is_one_line(tmp_path):
    done = run_cli(*TINY, "--cpu-offload", "--nprocs", "2", "--strategy", "fsdp", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dmltrain: error: --cpu-offload moves the sharded state of GPUs to CPU memory; this run "
        "is on the CPU, where it is already: leave --cpu-offload out"
    ]


def test_a_model_that_needs_real_tensors_names_the_way_out():
    def create():
        layer = nn.Linear(2, 2)
        assert layer.weight.abs().sum().item() > 0  # reads a value: no meta tensor has one
        return layer

    assert isinstance(sharding.build(create, meta=False), nn.Linear)
    with pytest.raises(UserError, match="create_model failed on the meta device") as error:
        sharding.build(create, meta=True)
    assert "--no-sharded-init" in str(error.value)
    kept = nn.Linear(2, 2)
    kept.mask = torch.ones(2)
    with pytest.raises(UserError, match=r"keeps a tensor in 0.mask, not as a parameter or buffer"):
        sharding.check_plain_tensors(nn.Sequential(kept))
    with pytest.raises(UserError, match="checkpointed_modules named no modules"):
        sharding.checkpoint_activations([], "checkpointed_modules")


def test_recomputed_blocks_draw_the_same_dropout_and_count_each_batch_once():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Tanh())

    plain, recomputed = model(), model()
    sharding.checkpoint_activations([recomputed], "checkpointed_modules")
    calls = []
    recomputed[0].register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(8, 4)
    for net in (plain, recomputed):
        torch.manual_seed(1)
        net(x).pow(2).sum().backward()
    assert len(calls) == 2  # the forward, then again in the backward
    for a, b in zip(plain.parameters(), recomputed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(plain.buffers(), recomputed.buffers(), strict=True):
        assert torch.equal(a, b)  # running mean, variance and the batch count: once


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each strategy with and without activation checkpointing: {(strategy, ac): run}."""
    made = {}
    for strategy, nprocs in (("single", 1), ("ddp", 2), ("fsdp", 2)):
        for ac in (False, True):
            run = tmp_path_factory.mktemp(f"{strategy}-{ac}") / "run"
            train(run, *BLOCKS, *shape(nprocs, strategy), *([AC] if ac else []))
            made[strategy, ac] = run
    return made


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_activation_checkpointing_recomputes_and_changes_nothing(runs, strategy):
    plain, recomputed = runs[strategy, False], runs[strategy, True]
    assert_same_run(plain, recomputed)
    for rank in range(1 if strategy == "single" else 2):
        forwards = [int((run / f"forwards.{rank}").read_text()) for run in (plain, recomputed)]
        per_rank = STEPS * 2  # steps x blocks, recomputed in each backward
        assert forwards[1] - forwards[0] == per_rank, forwards


def test_fsdp_builds_the_model_on_rank_0_alone_with_the_weights_of_one_process(runs):
    one = torch.load(runs["single", False] / "initial_weights.pt", weights_only=True)
    for strategy in ("ddp", "fsdp"):
        first = torch.load(runs[strategy, False] / "initial_weights.pt", weights_only=True)
        assert list(first) == list(one)
        assert all(torch.equal(first[k], one[k]) for k in one), strategy
    built = [(runs["fsdp", False] / f"built.{rank}").read_text() for rank in (0, 1)]
    assert built == ["cpu", "meta"]
    assert [(runs["ddp", False] / f"built.{rank}").read_text() for rank in (0, 1)] == ["cpu"] * 2


# HSDP and the moves of its checkpoints: tiny's plain model without dropout, whose maths
# do not depend on the number of processes at a global batch of 8.
PLAIN = [*TINY, "--epochs", "2", "--augment"]
STOP = ["--signal-rank", "0", "--signal-at-step", "3", *AT_ONCE]  # after step 4 of epoch 1
HSDP = [*shape(4, "fsdp"), "--fsdp-shard-size", "2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The plain model on one process: where every move of a checkpoint must end."""
    run = tmp_path_factory.mktemp("single") / "run"
    train(run, *PLAIN, *shape(1, "single"))
    return run


def test_hsdp_equals_fsdp_and_resumes_bitwise_with_recomputation(tmp_path, single):
    fsdp = tmp_path / "fsdp"
    train(fsdp, *PLAIN, *shape(4, "fsdp"))
    hsdp = tmp_path / "hsdp"
    train(hsdp, *PLAIN, *HSDP)
    # Gradients summed within pairs, then across them: the rounding of another order.
    assert_same_run(fsdp, hsdp, rel=1e-6)

    stopped = tmp_path / "stopped"
    train(stopped, *PLAIN, *HSDP, AC, *STOP, code=3)
    assert (stopped / "checkpoints" / "ckpt-000001-00000004.dcp").is_dir()
    moved = {name: tmp_path / name for name in ("fsdp2", "ddp1")}
    for run in moved.values():
        shutil.copytree(stopped, run, symlinks=True)
    train(stopped, *PLAIN, *HSDP, AC)
    assert_same_run(hsdp, stopped)

    # The sharded checkpoint of 4 ranks in pairs, on 2 ranks sharded and on 1 whole.
    train(moved["fsdp2"], *PLAIN, *shape(2, "fsdp"))
    train(moved["ddp1"], *PLAIN, *shape(1, "ddp"))
    for run in moved.values():
        assert_same_run(single, run, rel=1e-5)


def test_a_ddp_checkpoint_resumes_under_hsdp(tmp_path, single):
    run = tmp_path / "run"
    train(run, *PLAIN, *shape(2, "ddp"), *STOP, code=3)
    assert (run / "checkpoints" / "ckpt-000001-00000004.pt").is_file()
    train(run, *PLAIN, *HSDP)
    assert_same_run(single, run, rel=1e-5)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_cpu_offload_on_a_gpu_trains_like_fsdp(tmp_path):
    """FSDP on one GPU with its sharded state in CPU memory: the same run within rounding
    (the optimizer steps on the CPU)."""
    fsdp, offloaded = tmp_path / "fsdp", tmp_path / "offloaded"
    for run, extra in ((fsdp, []), (offloaded, ["--cpu-offload"])):
        done = run_cli(*BLOCKS, *shape(1, "fsdp"), *extra, "--run-dir", str(run),
                       cwd=tmp_path, gpus=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(fsdp, offloaded, rel=1e-5)


@pytest.mark.parametrize("api", ["old", "new"])
def test_recomputed_spectral_norm_starts_its_power_iteration_where_the_forward_did(tmp_path, api):
    """The recomputed forward runs spectral norm's power iteration again: from the vectors
    the forward started with, so weights, vectors and statistics end bitwise equal."""
    plain, recomputed = tmp_path / "plain", tmp_path / "recomputed"
    args = [*BLOCKS, "--spectral", api, "--epochs", "2"]
    train(plain, *args)
    train(recomputed, *args, AC)
    assert_same_run(plain, recomputed)
    assert any(k.endswith("_u") for k in final_weights(plain))


def test_spectral_norm_trains_under_fsdp_in_bf16(tmp_path):
    """FSDP's mixed precision gathers the weight in bf16, its vectors stay fp32: the power
    iteration runs in theirs. The old API, a plain tensor, is refused in one line."""
    run = tmp_path / "run"
    args = [*TINY, "--spectral", "new", "--strategy", "fsdp", "--precision", "bf16"]
    done = run_cli(*args, "--nprocs", "2", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [row["train_loss"] for row in read_training_log(run / "training_log.csv")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    old = run_cli(*TINY, "--spectral", "old", "--strategy", "fsdp", "--nprocs", "2",
                  "--run-dir", str(tmp_path / "old"), cwd=tmp_path)  # fmt: skip
    assert old.returncode == 2
    assert "use torch.nn.utils.parametrizations.spectral_norm" in old.stderr

"""Profiles on request (dmltrain/features/profiling.py): torch.profiler over a window of steps on
the ranks asked for, with real processes; the CUDA allocator's snapshot and a real CUDA
out-of-memory error on a GPU (skipped without one); on CPU, where no out-of-memory error
exists, the tiny experiment raises torch.OutOfMemoryError itself to show the one line."""

import json
import pickle

import pytest
import torch
from helpers import TINY, assert_same_run, run_cli

from dmltrain.checkpoint.storage import load_file
from dmltrain.config import ProfilingConfig
from dmltrain.errors import ConfigError, UserError
from dmltrain.features.profiling import profiled


def test_the_window_is_a_pair_of_global_steps_and_the_ranks_a_list():
    assert ProfilingConfig().window() is None and ProfilingConfig().ranks() == {0}
    assert ProfilingConfig(profile_steps="20:25").window() == (20, 25)
    assert ProfilingConfig(profile_ranks="all").ranks() is None
    assert ProfilingConfig(profile_ranks="0,3").ranks() == {0, 3}
    assert profiled(ProfilingConfig(profile_ranks="all"), 4) == []  # nothing asked for
    assert profiled(ProfilingConfig(profile_steps="1:2", profile_ranks="all"), 3) == [0, 1, 2]
    assert profiled(ProfilingConfig(profile_steps="1:2", profile_ranks="3,1"), 4) == [1, 3]
    assert profiled(ProfilingConfig(memory_snapshot=True), 2) == [0]
    with pytest.raises(UserError, match="--profile-ranks 3: this run has 2 process"):
        profiled(ProfilingConfig(profile_steps="1:2", profile_ranks="3"), 2)
    for steps in ("20", "25:20", "a:b", "3:3"):
        with pytest.raises(ConfigError, match="--profile-steps"):
            ProfilingConfig(profile_steps=steps)
    for ranks in ("", "x", "0,-1"):
        with pytest.raises(ConfigError, match="--profile-ranks"):
            ProfilingConfig(profile_ranks=ranks)


def test_the_ranks_asked_for_write_a_trace_and_the_top_operators(tmp_path):
    """2 processes, rank 1 profiled over global steps 3 to 6: its Chrome/TensorBoard trace
    holds the model's operators, its table is printed and written; rank 0 records nothing."""
    args = [*TINY, "--epochs", "1", "--nprocs", "2", "--profile-steps", "3:6"]
    done = run_cli(*args, "--profile-ranks", "1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = tmp_path / "run" / "profile"
    (trace,) = profile.glob("rank-1.*.pt.trace.json")
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"aten::addmm", "aten::mse_loss"} <= names
    table = (profile / "rank-1-ops.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert "profile of rank 1, steps 3:6" in done.stdout and table.strip() in done.stdout
    assert {p.name for p in profile.iterdir()} == {trace.name, "rank-1-ops.txt"}


def test_a_profiled_run_trains_the_same_and_an_unprofiled_one_records_nothing(tmp_path):
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    done = run_cli(*TINY, "--epochs", "1", "--run-dir", str(plain), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    args = [*TINY, "--epochs", "1", "--profile-steps", "0:8", "--run-dir", str(profiled)]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(plain, profiled)
    assert (profiled / "profile" / "rank-0-ops.txt").exists()
    assert not (plain / "profile").exists()


def test_an_allocator_snapshot_on_cpu_is_refused_in_one_line_before_anything_runs(tmp_path):
    done = run_cli(*TINY, "--memory-snapshot", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "dmltrain: error: --memory-snapshot records the CUDA allocator; this run is on cpu: "
        "drop the flag (--profile-steps profiles CPU runs)"
    ]
    assert not (tmp_path / "run").exists()


def test_out_of_memory_is_one_line_with_the_batch_and_what_to_try(tmp_path):
    """Mocked on CPU (no GPU here): tiny raises torch.OutOfMemoryError in step 5."""
    args = [*TINY, "--checkpoint-every-steps", "2", "--oom-at-step", "5", "--run-dir", "run"]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "out of memory" in line]
    assert line.startswith("dmltrain: error: out of memory in step 5 on rank 0 with --batch-size 8")
    assert "no allocator snapshot (not on CUDA)" in line and "--grad-accum" in line
    assert "--precision bf16" in line and "checkpoints so far are intact" in line
    # no snapshot to say what holds the memory: the activations' remedies first
    assert line.index("--activation-checkpointing") < line.index("--strategy fsdp")
    state = load_file(tmp_path / "run" / "checkpoints" / "latest.pt")
    assert state["global_step"] == 4  # the work before it is kept


def test_the_advice_names_sharding_first_when_the_training_state_holds_the_memory():
    from dmltrain.config import TrainConfig
    from dmltrain.features.profiling import memory_advice

    plain = TrainConfig()
    assert memory_advice(plain, "ddp", 0.8)[0].startswith("--strategy fsdp (with --fsdp-shard")
    assert memory_advice(plain, "ddp", 0.2)[:2] == [
        "--activation-checkpointing",
        "a smaller --batch-size with --grad-accum to keep the global batch",
    ]
    assert memory_advice(plain, "ddp", None)[0] == "--activation-checkpointing"
    hybrid = TrainConfig(fsdp_shard_size=4, activation_checkpointing=True, precision="bf16")
    assert memory_advice(hybrid, "fsdp", 0.9) == [
        "a larger --fsdp-shard-size than 4, or 0",
        "--cpu-offload",
        "or a smaller --batch-size with --grad-accum to keep the global batch",
    ]


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_the_allocator_history_and_a_real_out_of_memory_are_snapshots(tmp_path):
    profiled = [*TINY, "--profile-steps", "2:4", "--memory-snapshot", "--run-dir", "a"]
    done = run_cli(*profiled, cwd=tmp_path, gpus=True)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = tmp_path / "a" / "profile"
    snapshot = pickle.loads((profile / "memory-rank-0.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # history recorded
    assert "Self CUDA" in (profile / "rank-0-ops.txt").read_text()
    done = run_cli(*TINY, "--oom-at-step", "3", "--run-dir", "b", cwd=tmp_path, gpus=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the allocator's snapshot is" in done.stderr
    assert (tmp_path / "b" / "profile" / "oom-rank-0.pickle").stat().st_size > 0

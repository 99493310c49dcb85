"""Profiles on request, and a CUDA out-of-memory error told in one line.

``--profile-steps A:B`` runs ``torch.profiler`` from global step A to global step B (the
B-A steps after the first A) on the ranks ``--profile-ranks`` names, writes each one's
trace to ``RUN_DIR/profile/rank-N.*.pt.trace.json`` (Chrome's about://tracing, Perfetto
and TensorBoard's profiler read it) and its top operators to ``rank-N-ops.txt``; rank 0
prints its table. ``--memory-snapshot`` records the CUDA allocator's history from the
start and writes ``RUN_DIR/profile/memory-rank-N.pickle`` (https://pytorch.org/memory_viz)
at step B, or at the end. Neither costs anything when not asked for: the loop holds no
``Profiler`` then.

A CUDA out-of-memory error becomes ``out_of_memory``'s one line: where the allocator's
snapshot is, the batch size, how much of the memory the training state holds and the flags
to try, in the order that share makes likeliest to help.
"""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain import compat
from dmltrain.config import ProfilingConfig, TrainConfig
from dmltrain.errors import UserError, first_line

ROW_LIMIT = 15  # operators in the printed table
MEMORY_ENTRIES = 100_000  # allocator events kept by --memory-snapshot (as PyTorch suggests)


def check_available(config: ProfilingConfig, device: torch.device, world_size: int) -> None:
    """Refuse what this device or job cannot record, before anything starts."""
    if config.memory_snapshot and device.type != "cuda":
        raise UserError(
            f"--memory-snapshot records the CUDA allocator; this run is on {device.type}: "
            "drop the flag (--profile-steps profiles CPU runs)"
        )
    profiled(config, world_size)


def profiled(config: ProfilingConfig, world_size: int) -> list[int]:
    """The ranks, of ``world_size``, that record anything (none when nothing is asked)."""
    if config.window() is None and not config.memory_snapshot:
        return []
    ranks = config.ranks()
    beyond = sorted(r for r in ranks or () if r >= world_size)
    if beyond:
        raise UserError(
            f"--profile-ranks {config.profile_ranks}: this run has {world_size} process(es), "
            f"ranks 0 to {world_size - 1}; rank {beyond[0]} would profile nothing"
        )
    return [r for r in range(world_size) if ranks is None or r in ranks]


class Profiler:
    """One rank's profile: ``at(step)`` after each global step (and before the first)."""

    def __init__(
        self,
        config: ProfilingConfig,
        directory: Path,
        rank: int,
        device: torch.device,
        show: Callable[[str], None] | None = None,
    ) -> None:
        self.window, self.memory = config.window(), config.memory_snapshot
        self.directory, self.rank, self.device, self.show = directory, rank, device, show
        self._profile: Any = None
        self._done = False
        directory.mkdir(parents=True, exist_ok=True)
        if self.memory:
            compat.record_memory_history(MEMORY_ENTRIES)

    def at(self, step: int) -> None:
        """After global step ``step``: start or stop the window."""
        window = self.window
        if self._done or window is None:
            return
        if self._profile is None and window[0] <= step < window[1]:
            self._start()
        elif self._profile is not None and step >= window[1]:
            self._stop()

    def close(self) -> None:
        """The run ended (or failed): whatever is recording is written now."""
        if self._profile is not None:
            self._stop()
        if self.memory and not self._done:
            self._dump_memory()
        self._done = True

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(
            str(self.directory), worker_name=f"rank-{self.rank}"
        )
        self._profile = torch.profiler.profile(activities=activities, on_trace_ready=handler)
        self._profile.__enter__()

    def _stop(self) -> None:
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)  # writes the trace
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profile.key_averages().table(sort_by=sort, row_limit=ROW_LIMIT)
        (self.directory / f"rank-{self.rank}-ops.txt").write_text(table)
        if self.show is not None:
            start, stop = self.window or (0, 0)
            self.show(
                f"dmltrain: profile of rank {self.rank}, steps {start}:{stop} "
                f"(trace in {self.directory}):\n{table}"
            )
        if self.memory:
            self._dump_memory()
        self._done = True

    def _dump_memory(self) -> None:
        compat.dump_memory_snapshot(str(self.directory / f"memory-rank-{self.rank}.pickle"))
        compat.record_memory_history(None)


def out_of_memory(
    exc: BaseException,
    directory: Path,
    rank: int,
    device: torch.device,
    step: int,
    config: TrainConfig,
    strategy: str,
    state_bytes: int,
) -> UserError:
    """The one line for a CUDA out-of-memory error at global step ``step``, after writing
    the allocator's snapshot (its history too when ``--memory-snapshot`` recorded it): what
    the training state holds of the memory in use, and what to try in that light."""
    where, allocated = "no allocator snapshot (not on CUDA)", 0
    if device.type == "cuda":
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"oom-rank-{rank}.pickle"
        try:
            compat.dump_memory_snapshot(str(path))
            allocated = sum(s["allocated_size"] for s in torch.cuda.memory_snapshot())
            where = (
                f"the allocator's snapshot is {path} (open it at https://pytorch.org/memory_viz)"
            )
        except Exception as failed:  # the dump itself may need memory
            where = f"no allocator snapshot ({type(failed).__name__}: {failed})"
    share = state_bytes / allocated if allocated else None
    held = ""
    if share is not None:
        held = (
            f"; weights, gradients and optimizer state hold {min(share, 1):.0%} of the "
            f"{allocated / 2**30:.1f} GiB in use"
        )
    return UserError(
        f"out of memory in step {step + 1} on rank {rank} with --batch-size {config.batch_size} "
        f"per process ({first_line(exc)}){held}; {where}; try "
        f"{', '.join(memory_advice(config, strategy, share))}; the checkpoints so far are intact"
    )


def memory_advice(config: TrainConfig, strategy: str, state_share: float | None) -> list[str]:
    """The flags that would lower the memory, not yet set, in the order most likely to help:
    sharding first when the training state holds most of it (``state_share``), else what
    shrinks the activations (also when the share is unknown: no snapshot)."""
    memory = config.memory
    activations = []
    if not memory.activation_checkpointing:
        activations.append("--activation-checkpointing")
    activations.append("a smaller --batch-size with --grad-accum to keep the global batch")
    if config.precision == "fp32":
        activations.append("--precision bf16")
    state = []
    if strategy != "fsdp":
        state.append(
            "--strategy fsdp (with --fsdp-shard-size set to the GPUs of a node to keep its "
            "all-gathers inside nodes)"
        )
    elif memory.fsdp_shard_size:
        state.append(f"a larger --fsdp-shard-size than {memory.fsdp_shard_size}, or 0")
    if not memory.cpu_offload:
        state.append("--cpu-offload")
    ordered = (
        state + activations
        if state_share is not None and state_share > 0.5
        else activations + state
    )
    return [*ordered[:-1], f"or {ordered[-1]}"] if len(ordered) > 1 else ordered


def training_state_bytes(model: nn.Module, optimizers: Sequence[Any]) -> int:
    """Bytes this rank holds of the weights, their gradients and the optimizers' state
    (its own shards under FSDP)."""

    def local(tensor: Tensor) -> int:
        part = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return part.numel() * part.element_size()

    total = 0
    for param in model.parameters():
        total += local(param) + (local(param.grad) if param.grad is not None else 0)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(local(v) for v in state.values() if isinstance(v, Tensor))
    return total

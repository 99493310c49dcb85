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
snapshot is, the batch size and what to try.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dmltrain import compat
from dmltrain.config import ProfilingConfig
from dmltrain.errors import UserError, first_line

ROW_LIMIT = 15  # operators in the printed table
MEMORY_ENTRIES = 100_000  # allocator events kept by --memory-snapshot (as PyTorch suggests)


def check_available(config: ProfilingConfig, device: torch.device) -> None:
    """Refuse what this device cannot record, before anything starts."""
    if config.memory_snapshot and device.type != "cuda":
        raise UserError(
            f"--memory-snapshot records the CUDA allocator; this run is on {device.type}: "
            "drop the flag (--profile-steps profiles CPU runs)"
        )


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
    batch_size: int,
    precision: str,
) -> UserError:
    """The one line for a CUDA out-of-memory error at global step ``step``, after writing
    the allocator's snapshot (its history too when ``--memory-snapshot`` recorded it)."""
    where = "no allocator snapshot (not on CUDA)"
    if device.type == "cuda":
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"oom-rank-{rank}.pickle"
        try:
            compat.dump_memory_snapshot(str(path))
            where = (
                f"the allocator's snapshot is {path} (open it at https://pytorch.org/memory_viz)"
            )
        except Exception as failed:  # the dump itself may need memory
            where = f"no allocator snapshot ({type(failed).__name__}: {failed})"
    tried = first_line(exc)
    fixes = ["a smaller --batch-size with --grad-accum to keep the global batch"]
    if precision == "fp32":
        fixes.append("--precision bf16")
    fixes.append("or activation checkpointing (torch.utils.checkpoint) in the model")
    return UserError(
        f"out of memory in step {step + 1} on rank {rank} with --batch-size {batch_size} per "
        f"process ({tried}); {where}; try {', '.join(fixes)}; the checkpoints so far are intact"
    )

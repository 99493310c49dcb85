"""Seeing inside a running job at each log interval: throughput, data stalls, stragglers.

Every step, each rank's host clock takes the time spent waiting for the next batch (in
the loader's ``next()``) and the time in the experiment's ``train_step`` (the forward and
the loss: no collective runs there under DDP, so a slow rank's own work shows in it; on a
GPU, CUDA events around it, read at the log interval, as the host only queues kernels).
Nothing is synchronised per step.

At each log interval, one small collective of a fixed size (on the control group:
``dmltrain.runtime.control``) brings the largest share of time spent waiting for data, the
slowest rank and the sum of every rank's time: the same few numbers whatever the number of
ranks. Every rank's numbers are gathered only when the slowest is slower than the mean of
the others by ``--straggler-factor``. Rank 0 then

- adds ``steps_per_s``, ``data_wait`` (the share of the interval spent waiting for
  batches, the slowest rank's: the others wait for it) and, where the experiment states
  ``flops_per_sample()``, ``tflops`` per device and ``mfu`` against the device's peak, to
  the progress line, ``steps.csv`` and the tracker;
- warns once when data waiting took over ``STALL_SHARE`` of the time for
  ``STALL_INTERVALS`` intervals in a row, with the numbers and what to change;
- warns when a rank's own time (data wait + ``train_step``) exceeds the median of the
  other ranks' by ``--straggler-factor`` for ``STALL_INTERVALS`` intervals in a row,
  naming the rank, its host and whether data or compute made it slow; and writes every
  rank's numbers of those intervals to ``RUN_DIR/ranks.csv``.
"""

import csv
import io
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from dmltrain.records.files import append_own
from dmltrain.runtime import control

STALL_SHARE = 0.2  # of the interval's time spent waiting for data
STALL_INTERVALS = 2  # in a row, before a warning
STALL_SECONDS = 0.002  # the least wait a step that is a stall (reading, decoding)
_US = 1e5  # the collectives' unit of time: 10 us
_PPM = 1_000_000  # of a share
_RANKS = 2**20  # the slowest rank rides in the low bits of its time (int64)


def _ticks(seconds: float) -> int:
    return min(int(seconds * _US), 2**31 - 1)


# Dense peak FLOP/s a device, by a substring of torch.cuda.get_device_name and the
# precision (vendors' data sheets; fp32 without TF32).
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s at ``precision``; None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


def workers_hint(cpus: int, workers: int) -> str:
    """What to change when waiting for data: ``cpus`` this process has of its own (its
    threads and loader workers, counted from its affinity and SLURM_CPUS_PER_TASK by
    ``dmltrain.runtime.threads``)."""
    if cpus - 1 > workers:
        return (
            f"raise --num-workers (now {workers}; this process has {cpus} CPU(s) of its own: "
            f"try {min(cpus - 1, 8)})"
        )
    return (
        f"this process has {cpus} CPU(s) of its own (its affinity, SLURM_CPUS_PER_TASK): ask "
        "for more a task (sbatch --cpus-per-task) and raise --num-workers, or make loading "
        "a sample cheaper"
    )


class StepClock:
    """This rank's time in the loader and in ``train_step`` since the last ``read``."""

    def __init__(self, device: torch.device, timing: bool = True) -> None:
        """``timing`` False (``--no-monitor``): only when steps end (for the watchdog)."""
        self.cuda, self.timing = device.type == "cuda", timing
        self._events: list[tuple[Any, Any]] = []
        self.restart()

    # read by the hang watchdog (dmltrain.features.watchdog), from its thread
    slowest = 0.0  # the longest step so far, in seconds
    steps_done = 0
    inside_since: float | None = None  # when the running train_step started
    alone_in: str | None = None  # the callback event only this rank runs, while in it

    def restart(self) -> None:
        """A new interval starts now (after validation, at an epoch's start)."""
        self._started = self.last_end = perf_counter()
        self._wait = self._compute = 0.0
        self._steps_before = self.steps_done  # the interval's steps: steps_done past this
        self._events = []

    def batches(self, batches: Iterable[Any]) -> Iterable[Any]:
        """``batches``, timing each ``next()`` (as they are without ``timing``)."""
        return self._timed(batches) if self.timing else batches

    def _timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        began = perf_counter()
        for batch in batches:
            self._wait += perf_counter() - began
            yield batch
            began = perf_counter()

    def timed(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` (the experiment's ``train_step``), timed."""
        if not self.timing:
            return fn
        if self.cuda:
            return self._timed_on_gpu(fn)

        def call(batch: Any) -> Any:
            self.inside_since = began = perf_counter()
            result = fn(batch)
            self._compute += perf_counter() - began
            self.inside_since = None
            return result

        return call

    def _timed_on_gpu(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` between CUDA events, read at the log interval (the host only queues)."""

        def call(batch: Any) -> Any:
            self.inside_since = perf_counter()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            result = fn(batch)
            end.record()
            self._events.append((start, end))
            self.inside_since = None
            return result

        return call

    def step(self) -> None:
        """A step ended."""
        now = perf_counter()
        took, self.last_end = now - self.last_end, now
        if took > self.slowest:
            self.slowest = took
        self.steps_done += 1

    def read(self) -> tuple[int, float, float, float]:
        """(steps, seconds, waiting, computing) of the interval; starts the next one."""
        if self._events:  # the last one done means all are: one sync, at the interval
            self._events[-1][1].synchronize()
            self._compute = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        steps = self.steps_done - self._steps_before
        read = (steps, perf_counter() - self._started, self._wait, self._compute)
        self.restart()
        return read


@dataclass
class Monitor:
    """The log interval's numbers of all ranks (``interval``, every rank calls it)."""

    clock: StepClock
    over_ranks: Callable[[list[int], list[str]], list[int]]  # element-wise, by each one's op
    rank: int
    hosts: list[str]  # of every rank
    factor: float  # --straggler-factor
    warn: Callable[[str], None]
    ranks_csv: Path | None  # rank 0's
    flops_per_sample: float | None = None
    peak: float | None = None  # of one device
    workers_hint: str = ""  # what --num-workers could be
    global_batch: int = 0  # samples an optimizer step, all ranks
    # rank 0's plain line: a straggler among ranks that share one host is said here, not
    # warned of (other processes on its cores are the usual cause, and it passes)
    say: Callable[[str], None] | None = None
    _stalled: int = 0
    _slow: tuple[int, int] = (-1, 0)  # the slowest rank, and for how many intervals in a row
    _warned: set[Any] = field(default_factory=set)

    def interval(self, step: int) -> dict[str, float]:
        """Every rank, at the log interval: one collective of a fixed size (the largest
        data-wait share and the slowest rank; the sum of the ranks' times), and every
        rank's numbers only when one rank is slower than the mean of the others by the
        factor. Rank 0 gets the values to show and track; the others an empty dict."""
        if not self.clock.timing:  # --no-monitor
            return {}
        steps, seconds, wait, compute = self.clock.read()
        world, own = len(self.hosts), _ticks(wait + compute)
        share = int(wait / seconds * _PPM) if seconds > 0 else 0
        most, slowest, total = self.over_ranks(
            [share, own * _RANKS + self.rank, own], [control.MAX, control.MAX, control.SUM]
        )
        slowest, slow_own = slowest % _RANKS, slowest // _RANKS
        others = (total - slow_own) / (world - 1) if world > 1 else 0.0
        per_rank = None
        if others > 0 and slow_own > self.factor * others:  # the same on every rank
            table = [0] * (3 * world)
            table[3 * self.rank : 3 * self.rank + 3] = [
                _ticks(seconds), _ticks(wait), _ticks(compute)
            ]  # fmt: skip
            table = self.over_ranks(table, [control.MAX] * len(table))
            per_rank = [
                (table[3 * r] / _US, table[3 * r + 1] / _US, table[3 * r + 2] / _US)
                for r in range(world)
            ]
        if self.rank != 0 or steps == 0 or seconds <= 0:
            return {}
        waiting = most / _PPM
        values = {"steps_per_s": steps / seconds, "data_wait": waiting}
        if self.flops_per_sample and self.global_batch:
            achieved = self.flops_per_sample * self.global_batch * steps / seconds / world
            values["tflops"] = achieved / 1e12
            if self.peak:
                values["mfu"] = achieved / self.peak
        self._check_stall(waiting, steps / seconds)
        self._check_straggler(step, steps, per_rank)
        return values

    def _check_stall(self, waiting: float, steps_per_s: float) -> None:
        # in-memory data's own batching is a share of a tiny step, never milliseconds
        stalled = waiting > STALL_SHARE and waiting / steps_per_s > STALL_SECONDS
        self._stalled = self._stalled + 1 if stalled else 0
        if self._stalled >= STALL_INTERVALS and "stall" not in self._warned:
            self._warned.add("stall")
            self.warn(
                f"data loading is the bottleneck: over {STALL_SHARE:.0%} of the time went to "
                f"waiting for batches in {STALL_INTERVALS} log intervals in a row (the last: "
                f"{waiting:.0%}, {steps_per_s:.3g} steps/s); {self.workers_hint}"
            )

    def _check_straggler(
        self, step: int, steps: int, per_rank: list[tuple[float, float, float]] | None
    ) -> None:
        """The rank slower than the median of the others by the factor, two intervals in a
        row (with 2 ranks, the other one); ``per_rank``: every rank's numbers, gathered
        only when one looked slow."""
        if per_rank is None:
            self._slow = (-1, 0)
            return
        if self.ranks_csv is not None:
            self._write(step, steps, per_rank)
        own = [wait + compute for _, wait, compute in per_rank]
        rank = max(range(len(own)), key=own.__getitem__)
        others = [r for r in range(len(own)) if r != rank]
        median = statistics.median(own[r] for r in others)
        if not (median > 0 and own[rank] > self.factor * median):
            self._slow = (-1, 0)
            return
        self._slow = (rank, self._slow[1] + 1 if self._slow[0] == rank else 1)
        if self._slow[1] < STALL_INTERVALS or ("slow", rank) in self._warned:
            return
        self._warned.add(("slow", rank))
        _, wait, compute = per_rank[rank]
        mid_wait = statistics.median(per_rank[r][1] for r in others)
        mid_compute = statistics.median(per_rank[r][2] for r in others)
        cause = "data" if wait - mid_wait > compute - mid_compute else "compute"
        numbers = (
            f"({cause}: {wait / steps * 1e3:.1f} ms waiting for data and "
            f"{compute / steps * 1e3:.1f} ms in train_step a step, against "
            f"{mid_wait / steps * 1e3:.1f} and {mid_compute / steps * 1e3:.1f} ms)"
        )
        value = own[rank]
        if len(set(self.hosts)) == 1 and self.say is not None:
            self.say(
                f"dmltrain: straggler: rank {rank} is {value / median:.2f}x slower than "
                f"the others {numbers}; they share {self.hosts[rank]}, where other "
                "processes on its cores (another job on a shared node) are the usual "
                f"cause, and it passes when they end ({self.ranks_csv})"
            )
            return
        self.warn(
            f"straggler: rank {rank} on {self.hosts[rank]} is {value / median:.2f}x "
            f"slower than the median of the other ranks {numbers}; every rank waits "
            f"for it ({self.ranks_csv})"
        )

    def _write(self, step: int, steps: int, per_rank: list[tuple[float, float, float]]) -> None:
        assert self.ranks_csv is not None
        new = not self.ranks_csv.exists()
        rows = io.StringIO()
        writer = csv.writer(rows)
        if new:
            writer.writerow(["step", "rank", "host", "step_s", "data_wait_s", "compute_s"])
        for rank, (seconds, wait, compute) in enumerate(per_rank):
            writer.writerow(
                [
                    step,
                    rank,
                    self.hosts[rank],
                    f"{seconds / steps:.6g}",
                    f"{wait / steps:.6g}",
                    f"{compute / steps:.6g}",
                ]
            )
        append_own(self.ranks_csv, rows.getvalue().encode())

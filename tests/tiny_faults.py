"""Faults the tiny experiment injects on request: a rank killed, raising, signalled, slow,
paused or frozen; a NaN; a full disk; an out-of-memory error; a slow data pipeline."""

import atexit
import os
import shutil
import signal
import time
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class FaultOptions:
    die_rank: int = field(default=-1, metadata={"help": "this rank kills itself (SIGKILL)"})
    die_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    raise_rank: int = field(default=-1, metadata={"help": "a bug: this rank raises an error"})
    raise_at_step: int = field(default=-1, metadata={"help": "... in train_step at this global "
                               "step (-1: never; -2: in create_model)"})  # fmt: skip
    signal_rank: int = field(default=-1, metadata={"help": "this rank sends itself SIGUSR1"})
    signal_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    step_sleep: float = field(default=0.0, metadata={"help": "seconds to sleep each step"})
    slow_rank: int = field(default=-1, metadata={"help": "this rank sleeps --slow-seconds more"})
    slow_seconds: float = field(default=0.0, metadata={"help": "... in each train_step"})
    pause_at_step: int = field(default=0, metadata={"help": "sleep in this global step's"})
    pause_seconds: float = field(default=0.0, metadata={"help": "... train_step this long"})
    pause_rank: int = field(default=-1, metadata={"help": "... on this rank (-1: every rank)"})
    pause_stops: bool = field(
        default=False, metadata={"help": "... by stopping itself (SIGSTOP) instead: a frozen rank"}
    )
    data_sleep: float = field(
        default=0.0, metadata={"help": "seconds to sleep loading each training sample"}
    )
    data_sleep_rank: int = field(default=-1, metadata={"help": "... on this rank only"})
    first_job_only: bool = field(
        default=False,
        metadata={"help": "--step-sleep only in a Slurm job's first run (not once requeued)"},
    )
    nan_rank: int = field(default=-1, metadata={"help": "this rank injects a NaN"})
    nan_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    nan_into: str = field(default="loss", metadata={"help": "... into: loss or gradient"})
    exit_note: str = field(
        default="", metadata={"help": "an atexit handler writes PATH.RANK as the process ends"}
    )
    fill_disk_at_step: int = field(
        default=0, metadata={"help": "rank 0 fills the run directory's disk at this step"}
    )
    free_disk_at_step: int = field(default=0, metadata={"help": "... and frees it at this step"})
    fill_disk_leave: int = field(default=64, metadata={"help": "... leaving this many KiB"})
    oom_at_step: int = field(
        default=0,
        metadata={
            "help": "run out of memory in this global step's train_step (on CUDA for real; "
            "on CPU, where no such error exists, by raising torch.OutOfMemoryError)"
        },
    )


class SlowSamples(Dataset):
    """Each sample takes ``seconds`` to load (a data-bound run)."""

    def __init__(self, inner: Dataset, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.inner[index]


def at_model(trainer, o: FaultOptions) -> None:
    """In create_model: a bug there, and an experiment's own clean-up at exit."""
    if trainer.dist.rank == o.raise_rank and o.raise_at_step == -2:
        raise RuntimeError("a bug in create_model")
    if o.exit_note:  # as a user would register it
        note = f"{o.exit_note}.{trainer.dist.rank}"
        atexit.register(lambda: open(note, "w").close())


def slowed(train: Dataset, trainer, o: FaultOptions) -> Dataset:
    """The training set, slow to load on the ranks asked for."""
    if o.data_sleep and o.data_sleep_rank in (-1, trainer.dist.rank):
        return SlowSamples(train, o.data_sleep)
    return train


def before_step(trainer, o: FaultOptions) -> None:
    """At the start of train_step, before the batch is used."""
    rank, step = trainer.dist.rank, trainer.global_step
    if rank == o.die_rank and step == o.die_at_step:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == o.raise_rank and step == o.raise_at_step:
        raise RuntimeError(f"a bug in train_step at step {step}")
    if rank == o.signal_rank and step == o.signal_at_step:
        os.kill(os.getpid(), signal.SIGUSR1)
    if trainer.dist.is_main and step in {o.fill_disk_at_step, o.free_disk_at_step} - {0}:
        filler = trainer.run_dir / "filler"
        if step == o.free_disk_at_step:
            filler.unlink()
        else:  # 64 KiB by default: a checkpoint no longer fits, the training log does
            with open(filler, "wb") as handle:
                free = shutil.disk_usage(trainer.run_dir).free
                os.posix_fallocate(handle.fileno(), 0, free - (o.fill_disk_leave << 10))
    requeued = os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
    if o.step_sleep and not (o.first_job_only and requeued):
        time.sleep(o.step_sleep)  # a slow step, so a test can signal mid-run
    if rank == o.slow_rank:
        time.sleep(o.slow_seconds)  # a straggler
    if step + 1 == o.pause_at_step and o.pause_rank in (-1, rank):
        if o.pause_stops:  # its threads stop too: no stack, no answer
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(o.pause_seconds)  # a long step, or a rank blocked (a hang)
    if step + 1 == o.oom_at_step:
        if trainer.device.type == "cuda":
            torch.empty(1 << 50, device=trainer.device)  # a petabyte: a real allocator failure
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 TiB")


def injecting(trainer, o: FaultOptions, into: str) -> bool:
    """Whether this rank's step gets a NaN ``into`` the loss or the gradient."""
    return (o.nan_into, trainer.dist.rank, trainer.global_step) == (into, o.nan_rank, o.nan_at_step)


def after_backward(trainer, o: FaultOptions) -> None:
    if injecting(trainer, o, "gradient"):  # after DDP's all-reduce: this rank alone sees it
        trainer.strategy.eval_model(trainer.model)[-1].weight.grad[0, 0] = float("inf")

"""Distributed strategies: process-group setup, model wrapping, samplers and reductions.

``--strategy``: ``single`` (one process), ``ddp`` (DistributedDataParallel), ``fsdp``
(FSDP2 ``fully_shard``) or ``horovod``; ``auto`` picks horovod under ``horovodrun``, ddp
for more than one process and single otherwise. ``--backend auto`` is NCCL with CUDA and
Gloo on the CPU.

FSDP wrap policy: every direct child module that owns parameters becomes its own FSDP
unit, then the root; an experiment can name other units by overriding
``BaseTrainer.fsdp_units``.
"""

from collections.abc import Callable

import torch

from dmltrain.config import DistConfig, MemoryConfig
from dmltrain.errors import UserError
from dmltrain.runtime import sharding
from dmltrain.runtime.launch import DistInfo
from dmltrain.runtime.strategies.base import Strategy, resolve_backend, unwrap
from dmltrain.runtime.strategies.ddp import DDPStrategy
from dmltrain.runtime.strategies.fsdp import FSDPStrategy
from dmltrain.runtime.strategies.horovod import HorovodStrategy

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "HorovodStrategy",
    "Strategy",
    "check_gpus_for_workers",
    "create_strategy",
    "resolve_backend",
    "unwrap",
]


STRATEGIES: dict[str, Callable[[DistInfo, DistConfig, MemoryConfig], Strategy]] = {
    "single": Strategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "horovod": HorovodStrategy,
}


def create_strategy(
    info: DistInfo, config: DistConfig, memory: MemoryConfig | None = None
) -> Strategy:
    name = config.strategy
    if name == "auto":
        name = "horovod" if info.launcher == "horovod" else "ddp" if info.distributed else "single"
    if name == "single" and info.distributed:
        raise UserError(
            f"--strategy single cannot run {info.world_size} processes; use ddp, fsdp or horovod"
        )
    if name != "horovod":
        # fail early and clearly; two processes on one GPU: preflight, which sees them all
        backend = resolve_backend(config.backend, info.device)
        if backend == "nccl" and info.starts_workers:
            check_gpus_for_workers(info.workers, torch.cuda.device_count())
    memory = memory if memory is not None else MemoryConfig()
    sharding.check(memory, name, info.world_size, info.device)
    return STRATEGIES[name](info, config, memory)


def check_gpus_for_workers(workers: int, gpus: int) -> None:
    """A ``--nprocs`` parent gives each NCCL worker one of the GPUs it sees: refused here,
    before any starts, when there are fewer (ranks from other launchers: preflight)."""
    if workers > gpus:
        raise UserError(
            f"{workers} processes to start here and {gpus} GPU(s) visible: NCCL needs one GPU "
            f"per process: start at most {gpus} here (--nprocs), or use --backend gloo"
        )

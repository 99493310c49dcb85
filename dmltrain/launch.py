"""Who am I in this job? The only module that reads environment variables.

Everything else receives the frozen ``DistInfo`` this module produces.
"""

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job, decided once at start."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"
    device: str = "cpu"
    job_id: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def default_device(local_rank: int = 0) -> str:
    """One process per GPU: local rank N uses cuda:N; CPU when CUDA is absent."""
    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


def job_id(env: dict[str, str] | None = None) -> str | None:
    """The batch system's id for this job (Slurm array tasks as ``<array id>_<task id>``)."""
    env = dict(os.environ) if env is None else env
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    for key in ("SLURM_JOB_ID", "PBS_JOBID"):
        if env.get(key):
            return env[key].split(".")[0]
    return None


def single_process(env: dict[str, str] | None = None) -> DistInfo:
    """A plain ``python`` run: one process, rank 0, the first GPU or the CPU."""
    return DistInfo(device=default_device(0), job_id=job_id(env))

"""The strategy a run without peers uses, and what every strategy provides (``Strategy``)."""

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from dmltrain.compat import uncompiled
from dmltrain.config import DistConfig, MemoryConfig
from dmltrain.data.samples import ResumableSampler, ShardSampler
from dmltrain.errors import PeerFailed, PeerLost, UserError, first_line
from dmltrain.runtime import control, peers
from dmltrain.runtime.launch import DistInfo, RunEnvironment, hostname
from dmltrain.runtime.model_state import (
    check_model_fits,
    load_optimizers_state_by_name,
    optimizers_state_by_name,
    shapes_of,
)


def unwrap(model: nn.Module) -> nn.Module:
    """The experiment's own module inside torch.compile's and DDP's wrappers: its
    parameter names carry no wrapper prefix (a submodule named ``module`` keeps its name)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif uncompiled(model) is not model:
            model = uncompiled(model)
        else:
            return model


def resolve_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if backend == "mpi" and not dist.is_mpi_available():
        raise UserError(
            "--backend mpi: this torch was built without MPI (the PyPI wheels are); launch "
            "with mpirun/mpiexec and --backend gloo (CPU) or nccl (GPU), "
            "or use --strategy horovod for Horovod over MPI"
        )
    if backend == "nccl" and not (device.startswith("cuda") and dist.is_nccl_available()):
        raise UserError("--backend nccl needs CUDA GPUs; use --backend gloo on the CPU")
    return backend


class Strategy:
    """One process, nothing to synchronise. The base of the distributed strategies."""

    name = "single"

    def __init__(
        self, info: DistInfo, config: DistConfig, memory: MemoryConfig | None = None
    ) -> None:
        self.info = info
        self.config = config
        # FSDP's mesh and offload (dmltrain.runtime.sharding)
        self.memory = memory if memory is not None else MemoryConfig()
        self.peers: list[tuple[str, int]] = []  # (host, pid) of every rank, gathered at setup
        # After a lost peer: whether rank 0's process was still there (its store answered
        # the roll call), so that it, not this rank, writes the job's status (cli).
        self.rank0_alive = False
        self.store: Any = None  # the process group's key-value store (dist.TCPStore)

    def setup(self, environment: RunEnvironment | None = None) -> DistInfo:
        return self.info

    def started(self) -> None:
        """The job has started (set up, resumed): collectives now wait --dist-timeout,
        no longer --init-timeout."""

    def backend(self) -> str:
        """The collective backend in use (after setup)."""
        return "none"

    def flight_recorder(self) -> Callable[[], bytes] | None:
        """What dumps the NCCL flight recorder's buffer (a hang's record), where there is one."""
        return None

    def background_group(self) -> Any:
        """A process group for collectives made in a background thread while the loop's go
        on (an asynchronous sharded save's): None, the default, with one process."""
        return None

    def wrap_model(
        self,
        model: nn.Module,
        units: list[nn.Module],
        param_dtype: torch.dtype | None = None,
        manual: bool = False,
    ) -> nn.Module:
        """The model to train; ``param_dtype`` is the compute dtype of mixed precision.
        ``manual``: the experiment's step updates it itself (``average_gradients``)."""
        return model

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        grad_accum: int = 1,
        manual: bool = False,
    ) -> Any:
        return optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Around the backward of a micro-batch that is not the last of an accumulation."""
        return contextlib.nullcontext()

    def sync_gradients(self, optimizer: Any) -> None:
        """Make gradients final (reduced) before they are unscaled, checked or clipped."""

    def average_gradients(self, params: list[Tensor]) -> None:
        """A manual step: these parameters' gradients averaged over the ranks (one
        collective), whichever modules the step ran them through."""

    def sync_wrapper(self, model: nn.Module) -> nn.Module | None:
        """The module whose forward must run for gradients to be averaged (DDP's), if any."""
        return None

    def optimizer_step(self, step: Callable[[Any], None], optimizer: Any) -> None:
        """``step(optimizer)``: the update, after ``sync_gradients``."""
        step(optimizer)

    def train_sampler(self, dataset: Dataset, seed: int, shuffle: bool = True) -> ResumableSampler:
        """The same global permutation (or order) for any world size; rank r takes every
        w-th sample."""
        return ResumableSampler(
            dataset,
            num_replicas=self.info.world_size,
            rank=self.info.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
        )

    def val_sampler(self, dataset: Dataset) -> Sampler[tuple[int, int] | int]:
        return ShardSampler(dataset, self.info.rank, self.info.world_size)

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The model to validate with: one that runs no collectives in forward."""
        return model

    # ----- checkpoints: the model's and optimizers' state as this strategy holds it -------
    shards_checkpoints = False  # --checkpoint-format auto writes each rank's shards

    def sharded_checkpoints_problem(self) -> str | None:
        """Why this strategy cannot write sharded checkpoints; None when it can."""
        return None

    def full_state(self, model: nn.Module, optimizers: tuple[Any, ...], main: bool) -> Any:
        """The whole model's and optimizers' state, keyed by parameter name
        (``model_state``): rank 0's (``main``), (None, None) elsewhere. Every rank calls it
        (a strategy that shards the model gathers it)."""
        if not main:
            return None, None
        inner = unwrap(model)
        return inner.state_dict(), optimizers_state_by_name(inner, optimizers)

    def load_full_state(
        self,
        model: nn.Module,
        optimizers: tuple[Any, ...],
        state: dict[str, Any],
        optimizer: bool,
        source: Path | str,
        base: frozenset[str] = frozenset(),
    ) -> None:
        """A full checkpoint's ``model`` (and ``optimizer`` when asked) into this run's,
        checked against the model first; the ``base`` weights are not in it (LoRA's)."""
        inner = unwrap(model)
        own = {k: v for k, v in shapes_of(inner.state_dict()).items() if k not in base}
        check_model_fits(own, shapes_of(state["model"]), source)
        inner.load_state_dict(state["model"], strict=not base)
        if optimizer:
            load_optimizers_state_by_name(inner, optimizers, state["optimizer"], source)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor

    def over_ranks(self, values: list[int], ops: Sequence[str]) -> list[int]:
        """``values`` combined element-wise over ranks, each by its op (``control.MAX``:
        of flags, any rank; ``control.SUM``): one small CPU collective, no GPU sync."""
        return list(values)

    def max_over_ranks(self, values: list[int]) -> list[int]:
        return self.over_ranks(values, [control.MAX] * len(values))

    def sum_over_ranks(self, values: list[int]) -> list[int]:
        return self.over_ranks(values, [control.SUM] * len(values))

    def metric_gather(self) -> Callable[..., list[Tensor]] | None:
        """How a torchmetrics state is gathered from every rank (``gather(tensor, group)``
        -> one tensor a rank); None: torchmetrics' own, over torch.distributed."""
        return None

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def broadcast_bytes(self, buffer: Tensor) -> Callable[[], None]:
        """Rank 0's ``buffer`` (a CPU uint8 tensor) into every rank's, in place, once the
        function returned is called (the broadcast may run meanwhile)."""
        return lambda: None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None on the others): what only rank 0 writes."""
        return [obj]

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def announce_failure(self, exc: BaseException) -> None:
        """This rank failed in its own code: say so to the others before it leaves, so that
        they stop naming it and its error rather than a lost peer (``peers``)."""
        if self.info.distributed and self.store is not None:
            line = f"rank {self.info.rank} on {hostname()} failed: {type(exc).__name__}: "
            peers.announce_failure(self.store, line + first_line(exc))

    def lost_peer(self, exc: BaseException) -> PeerLost | PeerFailed | None:
        """If ``exc`` means another rank went away: a PeerFailed when it failed in its own
        code (``announce_failure``), else a PeerLost naming the ranks and hosts that stopped
        answering (``dmltrain.runtime.peers``)."""
        if not (self.info.distributed and peers.means_lost(exc)):
            return None
        here, rank = hostname(), self.info.rank
        if self.store is not None:
            missing = peers.roll_call(self.store, rank, self.info.world_size, window=10.0)
            self.rank0_alive = missing is not None
            if isinstance(missing, str):  # a rank failed in its own code and said so
                return PeerFailed(
                    f"{missing}; not a lost node, so nothing is requeued: fix it, then run "
                    "the same command to resume from the newest checkpoint"
                )
        else:  # no store to call the roll through (Horovod): this host's ranks are looked up
            deadline = time.monotonic() + 3.0  # a killed process closes its sockets first
            while True:
                missing = [
                    r
                    for r, (host, pid) in enumerate(self.peers)
                    if host == here and peers.local_state(pid) != "running"
                ]
                if missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        return PeerLost(peers.describe(exc, missing, self.peers, rank, here))

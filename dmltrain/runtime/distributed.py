"""Distributed strategies: process-group setup, model wrapping, samplers and reductions.

``--strategy``: ``single`` (one process), ``ddp`` (DistributedDataParallel), ``fsdp``
(FSDP2 ``fully_shard``) or ``horovod``; ``auto`` picks horovod under ``horovodrun``, ddp
for more than one process and single otherwise. ``--backend auto`` is NCCL with CUDA and
Gloo on the CPU.

FSDP wrap policy: every direct child module that owns parameters becomes its own FSDP
unit, then the root; an experiment can name other units by overriding
``BaseTrainer.fsdp_units``.
"""

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from dmltrain import compat
from dmltrain.compat import nccl_flight_recorder, uncompiled
from dmltrain.config import DistConfig, MemoryConfig
from dmltrain.data.samples import ResumableSampler, ShardSampler
from dmltrain.errors import PeerFailed, PeerLost, UserError, first_line
from dmltrain.runtime import control, launch, peers, preflight, sharding
from dmltrain.runtime.launch import DistInfo, RunEnvironment, default_device, hostname
from dmltrain.runtime.model_state import (
    check_model_fits,
    dcp,
    dcp_optimizers,
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

    def train_sampler(self, dataset: Dataset, seed: int) -> ResumableSampler:
        """The same global permutation for any world size; rank r takes every w-th sample."""
        return ResumableSampler(
            dataset,
            num_replicas=self.info.world_size,
            rank=self.info.rank,
            shuffle=True,
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
        source: Path,
    ) -> None:
        """A full checkpoint's ``model`` (and ``optimizer`` when asked) into this run's,
        checked against the model first."""
        inner = unwrap(model)
        check_model_fits(shapes_of(inner.state_dict()), shapes_of(state["model"]), source)
        inner.load_state_dict(state["model"])
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


class DDPStrategy(Strategy):
    name = "ddp"
    control: Any = None  # NCCL runs: a Gloo group for the loop's small control collectives
    timeout = datetime.timedelta(0)  # the collectives' timeout now (setup, then started)
    background: Any = None  # background_group()

    def setup(self, environment: RunEnvironment | None = None) -> DistInfo:
        backend = resolve_backend(self.config.backend, self.info.device)
        if self.info.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.info.device))
        # Until started(): the job's start, when ranks arrive late, has its own timeout.
        self.timeout = timeout = datetime.timedelta(seconds=self.config.init_timeout)
        if backend == "nccl":  # its collectives recorded, for a hang's report (watchdog)
            launch.enable_flight_recorder()
        launch.lazy_gloo_connections()  # the training group on CPUs, the control group
        info = self.info
        interface = environment is not None and environment.socket_interface is not None
        # Kept, not made by init_method: the roll call after a failed collective uses it.
        self.store = preflight.rendezvous(
            info.rank,
            info.world_size,
            info.master_addr,
            info.master_port,
            self.config.init_timeout,
            interface,
            info.agent_store_attempt,
            info.device if backend == "nccl" else None,
        )
        dist.init_process_group(
            backend,
            store=self.store,
            rank=self.info.rank,
            world_size=self.info.world_size,
            timeout=timeout,
        )
        self.peers = self.all_gather_object((hostname(), os.getpid()))
        # Control messages (preemption agreement) go over Gloo on the CPU, so they never
        # wait for the GPU stream.
        self.control = (
            dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        )
        return self.info

    def started(self) -> None:
        self.timeout = timeout = datetime.timedelta(seconds=self.config.dist_timeout)
        for group in self._groups():
            compat.set_group_timeout(timeout, group)
        self.store.set_timeout(timeout)

    def _groups(self) -> list[Any]:
        """Every process group this strategy made (None: the default one)."""
        return [None, *(g for g in (self.control, self.background) if g is not None)]

    def background_group(self) -> Any:
        """Made at the first call, by every rank: a Gloo group on the CPU, apart from the
        loop's, whose collectives must not interleave with a background thread's."""
        if self.background is None:
            timeout = datetime.timedelta(seconds=self.config.dist_timeout)
            self.background = dist.new_group(backend="gloo", timeout=timeout)
        return self.background

    def wrap_model(
        self,
        model: nn.Module,
        units: list[nn.Module],
        param_dtype: torch.dtype | None = None,
        manual: bool = False,
    ) -> nn.Module:
        if manual:  # no DDP hooks: a submodule called on its own still has its gradients
            for tensor in [*model.parameters(), *model.buffers()]:  # averaged in the step
                dist.broadcast(tensor.data, src=0)
            return model
        device_ids = (
            [torch.device(self.info.device)] if self.info.device.startswith("cuda") else None
        )
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def sync_wrapper(self, model: nn.Module) -> nn.Module | None:
        inner = uncompiled(model)
        return inner if isinstance(inner, nn.parallel.DistributedDataParallel) else None

    def average_gradients(self, params: list[Tensor]) -> None:
        if not params:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.info.world_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def eval_model(self, model: nn.Module) -> nn.Module:
        return unwrap(model)  # DDP's forward would take part in collectives

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        inner = uncompiled(model)
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            return inner.no_sync()
        return contextlib.nullcontext()

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def over_ranks(self, values: list[int], ops: Sequence[str]) -> list[int]:
        info = self.info
        return control.over_ranks(
            values, ops, info.rank, info.world_size, self.timeout, self.control
        )

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_bytes(self, buffer: Tensor) -> Callable[[], None]:
        nccl = self.backend() == "nccl"  # NCCL sends from and to the GPU
        carrier = buffer.to(self.info.device) if nccl else buffer
        work = dist.broadcast(carrier, src=0, async_op=True)

        def wait() -> None:
            work.wait()
            if nccl:
                buffer.copy_(carrier)

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def gather_object(self, obj: Any) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.info.world_size if self.info.is_main else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    def backend(self) -> str:
        return str(dist.get_backend()) if dist.is_initialized() else "none"

    def flight_recorder(self) -> Callable[[], bytes] | None:
        dump = nccl_flight_recorder()
        return dump if self.backend() == "nccl" and dump is not None else None

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class FSDPStrategy(DDPStrategy):
    name = "fsdp"
    mesh: Any = None  # HSDP's 2D mesh, made in wrap_model

    def _groups(self) -> list[Any]:
        return super()._groups() + (self.mesh.get_all_groups() if self.mesh is not None else [])

    def wrap_model(
        self,
        model: nn.Module,
        units: list[nn.Module],
        param_dtype: torch.dtype | None = None,
        manual: bool = False,
    ) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # Mixed precision the FSDP way: parameters gathered in the compute dtype,
        # gradients reduced in fp32.
        self.mesh = sharding.fsdp_mesh(self.memory, self.info.world_size, self.info.device)
        settings: dict[str, Any] = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
            "mesh": self.mesh,
        }
        if self.memory.cpu_offload:
            settings["offload_policy"] = CPUOffloadPolicy()
        for unit in units:
            fully_shard(unit, **settings)
        if not manual or not units:
            fully_shard(model, **settings)
        # manual: each unit is a root of its own, so a step may call any of them alone;
        # parameters outside them stay whole on every rank (average_gradients)
        return model

    def eval_model(self, model: nn.Module) -> nn.Module:
        # FSDP's forward gathers parameters: every rank must run it
        return unwrap(model)

    shards_checkpoints = True

    def full_state(self, model: nn.Module, optimizers: tuple[Any, ...], main: bool) -> Any:
        # every rank takes part in gathering the shards; rank 0 keeps them, on the CPU
        options = dcp().StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dcp().get_state_dict(model, dcp_optimizers(optimizers), options=options)

    def load_full_state(
        self,
        model: nn.Module,
        optimizers: tuple[Any, ...],
        state: dict[str, Any],
        optimizer: bool,
        source: Path,
    ) -> None:
        check_model_fits(shapes_of(unwrap(model).state_dict()), shapes_of(state["model"]), source)
        options = dcp().StateDictOptions(full_state_dict=True, strict=True)
        dcp().set_model_state_dict(model, state["model"], options=options)
        if optimizer:
            dcp().set_optimizer_state_dict(
                model, dcp_optimizers(optimizers), state["optimizer"], options=options
            )

    def average_gradients(self, params: list[Tensor]) -> None:
        """The sharded ones are averaged already (each FSDP unit reduce-scatters its
        gradients in the backward); those of parameters outside the units, here."""
        whole = [p for p in params if not hasattr(p, "to_local")]
        super().average_gradients(whole)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        inner: Any = uncompiled(model)
        inner.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)

    def val_sampler(self, dataset: Dataset) -> Sampler[tuple[int, int] | int]:
        """Equal shard sizes (FSDP's forward is collective): pads with up to w-1 repeats."""
        return ShardSampler(dataset, self.info.rank, self.info.world_size, pad=True)


class HorovodStrategy(Strategy):
    name = "horovod"

    def sharded_checkpoints_problem(self) -> str | None:
        return (
            "--checkpoint-format sharded needs torch.distributed (ddp or fsdp); "
            "use --checkpoint-format full with horovod"
        )

    sent = 0  # broadcast_bytes's calls: their names

    def setup(self, environment: RunEnvironment | None = None) -> DistInfo:
        try:
            import horovod.torch as hvd
        except ImportError:
            raise UserError(
                "--strategy horovod needs Horovod: pip install 'dmltrain[horovod]' "
                "(see environment/ for the build flags)"
            ) from None
        hvd.init()
        self.hvd = hvd
        self.peers = list(
            hvd.allgather_object((hostname(), os.getpid()), name="dmltrain.runtime.peers")
        )
        local_rank = hvd.local_rank()
        self.info = replace(
            self.info,
            rank=hvd.rank(),
            world_size=hvd.size(),
            local_rank=local_rank,
            local_world_size=hvd.local_size(),
            node_rank=hvd.cross_rank(),
            launcher=self.info.launcher,
            device=default_device(local_rank),
        )
        if self.info.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.info.device))
        return self.info

    def wrap_model(
        self,
        model: nn.Module,
        units: list[nn.Module],
        param_dtype: torch.dtype | None = None,
        manual: bool = False,
    ) -> nn.Module:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model

    def average_gradients(self, params: list[Tensor]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            reduced = self.hvd.grouped_allreduce(grads, op=self.hvd.Average)
            for grad, mean in zip(grads, reduced, strict=True):
                grad.copy_(mean)

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        grad_accum: int = 1,
        manual: bool = False,
    ) -> Any:
        if manual:  # the step averages each optimizer's gradients (average_gradients)
            return optimizer
        # Horovod reduces in the backward hooks once every ``grad_accum`` backward passes;
        # ``synchronize`` also finishes a shorter last accumulation of an epoch.
        wrapped = self.hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            backward_passes_per_step=grad_accum,
        )
        # Horovod fills empty optimizer state by taking a zero-gradient step, which moves
        # Adam's step count; fresh optimizers are identical on all ranks, so only
        # broadcast state that exists (after a resume).
        if optimizer.state_dict()["state"]:
            self.hvd.broadcast_optimizer_state(wrapped, root_rank=0)
        return wrapped

    def backend(self) -> str:
        return "horovod/" + ("mpi" if self.hvd.mpi_enabled() else "gloo")

    def sync_gradients(self, optimizer: Any) -> None:
        optimizer.synchronize()

    def optimizer_step(self, step: Callable[[Any], None], optimizer: Any) -> None:
        with optimizer.skip_synchronize():  # synchronize() ran in sync_gradients
            step(optimizer)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def over_ranks(self, values: list[int], ops: Sequence[str]) -> list[int]:
        result = list(values)
        for op, reduce in ((control.MAX, self.hvd.Max), (control.SUM, self.hvd.Sum)):
            where = [i for i, o in enumerate(ops) if o == op]
            if where:
                tensor = torch.tensor([values[i] for i in where], dtype=torch.int64)
                for i, v in zip(where, self.hvd.allreduce(tensor, op=reduce).tolist(), strict=True):
                    result[i] = int(v)
        return result

    def metric_gather(self) -> Callable[..., list[Tensor]] | None:
        def gather(tensor: Tensor, group: Any = None) -> list[Tensor]:
            # allgather joins along dim 0, whose size may differ between ranks
            rows = tensor.contiguous() if tensor.dim() else tensor.reshape(1)
            sizes = self.hvd.allgather(torch.tensor([len(rows)])).tolist()
            parts = self.hvd.allgather(rows).split(sizes)
            return list(parts) if tensor.dim() else [part.reshape(()) for part in parts]

        return gather

    # Horovod matches collectives across ranks by name, and names an object collective
    # after the object's type by default: rank 0 broadcasting a float while the others pass
    # None would wait forever. Fixed names make them match.
    def broadcast_object(self, obj: Any) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=0, name="dmltrain.broadcast_object")

    def broadcast_bytes(self, buffer: Tensor) -> Callable[[], None]:
        self.sent += 1  # Horovod matches by name: unique among those in flight
        name = f"dmltrain.broadcast_bytes.{self.sent}"
        handle = self.hvd.broadcast_async_(buffer, root_rank=0, name=name)
        return lambda: self.hvd.synchronize(handle)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self.hvd.allgather_object(obj, name="dmltrain.all_gather_object"))

    def gather_object(self, obj: Any) -> list[Any] | None:
        gathered = self.all_gather_object(obj)  # Horovod has no gather to one rank
        return gathered if self.info.is_main else None

    def barrier(self) -> None:
        self.hvd.barrier()

    def teardown(self) -> None:
        if hasattr(self, "hvd"):
            self.hvd.shutdown()


STRATEGIES: dict[str, Callable[[DistInfo, DistConfig, MemoryConfig], Strategy]] = {
    "single": Strategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "horovod": HorovodStrategy,
}


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

"""``ddp``: DistributedDataParallel over torch.distributed (NCCL, Gloo, MPI)."""

import contextlib
import datetime
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmltrain import compat
from dmltrain.compat import nccl_flight_recorder, uncompiled
from dmltrain.runtime import control, launch, preflight
from dmltrain.runtime.launch import DistInfo, RunEnvironment, hostname
from dmltrain.runtime.strategies.base import Strategy, resolve_backend, unwrap


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

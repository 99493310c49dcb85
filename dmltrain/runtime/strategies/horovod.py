"""``horovod``: Horovod's DistributedOptimizer and collectives (under ``horovodrun``)."""

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain.errors import UserError
from dmltrain.runtime import control
from dmltrain.runtime.launch import DistInfo, RunEnvironment, default_device, hostname
from dmltrain.runtime.strategies.base import Strategy


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

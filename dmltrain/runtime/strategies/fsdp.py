"""``fsdp``: FSDP2 ``fully_shard`` of the units, then the root; HSDP on a 2D mesh."""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from dmltrain.compat import uncompiled
from dmltrain.data.samples import ShardSampler
from dmltrain.runtime import sharding
from dmltrain.runtime.model_state import (
    check_model_fits,
    dcp,
    dcp_optimizers,
    shapes_of,
)
from dmltrain.runtime.strategies.base import unwrap
from dmltrain.runtime.strategies.ddp import DDPStrategy


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
        if param_dtype is not None:
            sharding.power_iteration_in_its_dtype(model)
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
        source: Path | str,
        base: frozenset[str] = frozenset(),
    ) -> None:
        own = {k: v for k, v in shapes_of(unwrap(model).state_dict()).items() if k not in base}
        check_model_fits(own, shapes_of(state["model"]), source)
        options = dcp().StateDictOptions(full_state_dict=True, strict=not base)
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

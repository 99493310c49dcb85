"""An exponential moving average of the model's weights (``--ema-decay``).

The average of every floating-point parameter lives on the model's device next to it and
is updated after an optimizer step with one ``torch._foreach_lerp_`` (no Python loop over
parameters on the hot path): ``ema += (1 - decay) * (weight - ema)``. Until
``--ema-warmup-steps`` it copies the weights instead; it is updated every
``--ema-every-steps`` steps.

Buffers are copied, never averaged: the averaged model uses the live one's. A module that
updates a buffer in its forward keeps it consistent that way: spectral norm's
power-iteration vectors (``weight_u``/``weight_v``, ``parametrizations.*._u``/``_v``) must
stay unit vectors, which an average of them is not; batch norm's running statistics and
counters are the live model's too. The average is in every checkpoint under the model's
own parameter names, so a resumed run goes on with the same average, bit for bit.

Under FSDP each rank averages its own shard of each parameter (the local tensor of the
``DTensor``); a sharded checkpoint holds every rank's shards of it (``shards``), a full one
the whole average (``state_dict`` gathers it: every rank calls it), and loading one hands
each rank its shard again.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from dmltrain import compat


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup_steps: int, every_steps: int):
        self.decay, self.warmup_steps, self.every_steps = decay, warmup_steps, every_steps
        named = [(n, t) for n, t in model.named_parameters() if t.is_floating_point()]
        self.names = [name for name, _ in named]
        # FSDP's DTensor (None otherwise): its mesh and placements gather and shard the average
        self.sharded: list[Any] = [
            t if getattr(t, "device_mesh", None) is not None else None for _, t in named
        ]
        # views of the weights (of this rank's shard under FSDP)
        self.live: list[Tensor] = [
            d.detach().to_local() if d is not None else t.detach()
            for (_, t), d in zip(named, self.sharded, strict=True)
        ]
        self.average = [t.clone() for t in self.live]
        self.copied = list(model.named_buffers())

    def update(self, global_step: int) -> None:
        """After the optimizer step that made ``global_step``."""
        if global_step % self.every_steps:
            return
        if global_step <= self.warmup_steps:
            compat.foreach_copy_(self.average, self.live)
        else:
            compat.foreach_lerp_(self.average, self.live, 1.0 - self.decay)

    def state_dict(self, keep: bool = True) -> dict[str, Tensor]:
        """The averaged weights under the model's names (a model ``state_dict``), whole
        (under FSDP a collective: every rank calls it). ``keep=False``: a rank that only
        takes part in the gathering, and keeps no copy (an empty dict)."""
        state = {}
        for name, value in self.shards(counters=False).items():
            if hasattr(value, "full_tensor"):  # FSDP's shard: gathered whole
                whole = value.full_tensor()
                state[name] = whole.cpu() if keep else whole
            else:
                state[name] = value.detach().clone() if keep else value
        if not keep:
            return {}
        state.update({name: t.detach().clone() for name, t in self.copied})
        return state

    def shards(self, counters: bool = True) -> dict[str, Any]:
        """The average as it lives (views, no copy) under the model's names, FSDP's shards
        as ``DTensor``s: for torch.distributed.checkpoint to save every rank's own part,
        or to load into in place. ``counters``: with the copied buffers (a model's whole
        state dict, as saved)."""
        state: dict[str, Any] = {}
        for name, average, dtensor in zip(self.names, self.average, self.sharded, strict=True):
            if dtensor is None:
                state[name] = average
            else:
                from torch.distributed.tensor import DTensor

                state[name] = DTensor.from_local(
                    average, dtensor.device_mesh, dtensor.placements, run_check=False,
                    shape=dtensor.shape, stride=dtensor.stride(),
                )  # fmt: skip
        if counters:
            state.update(self.copied)
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """From ``state_dict``'s whole tensors (under FSDP each rank takes its shard)."""
        values = []
        for name, average, dtensor in zip(self.names, self.average, self.sharded, strict=True):
            value = state[name].to(average.device)
            if dtensor is not None:
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, dtensor.device_mesh, dtensor.placements)
                value = value.to_local()
            values.append(value)
        compat.foreach_copy_(self.average, values)

    def restart(self) -> None:
        """The average starts again from the weights as they are (loaded ones)."""
        compat.foreach_copy_(self.average, self.live)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside this block (for validation)."""
        kept = [t.clone() for t in self.live]
        compat.foreach_copy_(self.live, self.average)
        try:
            yield
        finally:
            compat.foreach_copy_(self.live, kept)

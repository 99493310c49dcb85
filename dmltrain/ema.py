"""An exponential moving average of the model's weights (``--ema-decay``).

The average of every floating-point parameter and buffer lives on the model's device
next to it and is updated after an optimizer step with one ``torch._foreach_lerp_``
(no Python loop over parameters on the hot path): ``ema += (1 - decay) * (weight -
ema)``. Until ``--ema-warmup-steps`` it copies the weights instead; it is updated every
``--ema-every-steps`` steps. Other buffers (counters such as BatchNorm's
``num_batches_tracked``) are copied. It is in every checkpoint under the model's own
parameter names, so a resumed run goes on with the same average, bit for bit.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup_steps: int, every_steps: int):
        self.decay, self.warmup_steps, self.every_steps = decay, warmup_steps, every_steps
        named = [*model.named_parameters(), *model.named_buffers()]
        self.names = [name for name, t in named if t.is_floating_point()]
        self.live = [t.detach() for _, t in named if t.is_floating_point()]  # views
        self.average = [t.clone() for t in self.live]
        self.copied = [(name, t) for name, t in model.named_buffers() if not t.is_floating_point()]

    def update(self, global_step: int) -> None:
        """After the optimizer step that made ``global_step``."""
        if global_step % self.every_steps:
            return
        if global_step <= self.warmup_steps:
            torch._foreach_copy_(self.average, self.live)
        else:
            torch._foreach_lerp_(self.average, self.live, 1.0 - self.decay)

    def state_dict(self) -> dict[str, Tensor]:
        """The averaged weights under the model's names (a model ``state_dict``)."""
        state = {name: t.detach().clone() for name, t in zip(self.names, self.average, strict=True)}
        state.update({name: t.detach().clone() for name, t in self.copied})
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        torch._foreach_copy_(self.average, [state[name] for name in self.names])

    def restart(self) -> None:
        """The average starts again from the weights as they are (loaded ones)."""
        torch._foreach_copy_(self.average, self.live)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside this block (for validation)."""
        kept = [t.clone() for t in self.live]
        torch._foreach_copy_(self.live, self.average)
        try:
            yield
        finally:
            torch._foreach_copy_(self.live, kept)

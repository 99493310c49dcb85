"""Several autoregressive forecast steps from one batch, in ``train_step``.

The model maps a state of ``window`` steps to the next step. A rollout of K steps feeds
each prediction back as the newest step of the state, and its loss is the mean of the K
steps' losses. Full backpropagation differentiates through every step. Truncated
backpropagation (as NCAR's CREDIT does) backpropagates each step's loss as soon as it is
made, with the state it came from detached: memory for one step at a time. Either way the
gradients are synchronised over the ranks once an optimizer step, not once a forecast
step: every forward but the last, and the early backward passes, run without a sync
(``BaseTrainer.no_sync``, ``BaseTrainer.backward_early``).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmltrain.errors import UserError


@dataclass(frozen=True)
class RolloutSchedule:
    """The rollout length at a global step: ``RolloutSchedule({0: 1, 20000: 2, 40000:
    4})`` rolls 1 step until step 20000, then 2, then 4. A function of the step alone: a
    resumed run rolls as the run never stopped would."""

    lengths: Mapping[int, int]

    def __post_init__(self) -> None:
        if 0 not in self.lengths:
            raise UserError(f"a rollout schedule starts at step 0: {dict(self.lengths)}")
        if any(step < 0 or length < 1 for step, length in self.lengths.items()):
            raise UserError(
                f"a rollout schedule maps steps >= 0 to lengths >= 1: {dict(self.lengths)}"
            )

    def __call__(self, step: int) -> int:
        return self.lengths[max(s for s in self.lengths if s <= step)]

    @property
    def longest(self) -> int:
        """The most steps it ever rolls: the leads a dataset must hold."""
        return max(self.lengths.values())


def rollout(
    trainer: Any,
    inputs: Tensor,
    targets: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor],
    steps: int | None = None,
    truncate: bool = False,
    model: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """The mean loss of ``steps`` forecast steps (all of ``targets``' by default).

    ``inputs``: ``(batch, window, channels + static, *grid)``, the static channels last
    (``ZarrWindows``' samples); ``targets``: ``(batch, leads, channels, *grid)``, lead k
    the step k + 1 after the window. ``model`` (``trainer.model`` by default) maps a state
    like ``inputs`` to the next step, ``(batch, channels, *grid)``. With ``truncate``,
    each step but the last is backpropagated here; the returned loss carries the last
    step's gradient and every step's value.
    """
    model = model or trainer.model
    leads, channels = targets.shape[1], targets.shape[2]
    steps = leads if steps is None else steps
    if not 1 <= steps <= leads:
        raise UserError(f"a rollout of {steps} steps needs 1 to {leads} targets ({leads} given)")
    if inputs.shape[2] < channels:
        raise UserError(
            f"the inputs have {inputs.shape[2]} channels, fewer than the targets' {channels}"
        )
    static = inputs[:, -1, channels:]
    state, early = inputs, torch.zeros((), device=inputs.device)
    for k in range(steps):
        if k == steps - 1:  # the forward whose backward syncs the gradients, once
            prediction = model(state)
        else:
            with trainer.no_sync():
                prediction = model(state)
        part = loss(prediction, targets[:, k]) / steps
        if k == steps - 1:
            return part + early.detach() if truncate else part + early
        if truncate:
            trainer.backward_early(part)
            prediction = prediction.detach()
        early = early + (part.detach() if truncate else part)
        state = _advance(state, prediction, static)
    raise AssertionError("unreachable")  # pragma: no cover


def forecast(
    model: Callable[[Tensor], Tensor], inputs: Tensor, steps: int, channels: int
) -> Tensor:
    """``(batch, steps, channels, *grid)``: ``model`` rolled out ``steps`` steps from
    ``inputs`` as ``rollout`` rolls it (for validation and scores; no gradient kept when
    called under ``torch.no_grad``). ``channels``: the channels the model predicts."""
    static, state, predictions = inputs[:, -1, channels:], inputs, []
    for _ in range(steps):
        predictions.append(model(state))
        state = _advance(state, predictions[-1], static)
    return torch.stack(predictions, dim=1)


def _advance(state: Tensor, prediction: Tensor, static: Tensor) -> Tensor:
    """The state one step on: the prediction (with the static channels) as its newest step,
    in the state's dtype (static fields are not rounded to a bf16 prediction's)."""
    newest = prediction.to(state.dtype)
    if static.shape[1]:
        newest = torch.cat([newest, static], dim=1)
    return torch.cat([state[:, 1:], newest[:, None]], dim=1)

"""``--gradient-noise-scale N``: the simple noise scale of McCandlish et al. (2018), the
batch size past which a larger batch gains little, in steps.csv at each log interval.

B_simple = tr(Σ) / |G|², with Σ the per-sample gradient covariance and G the true gradient.
Both come from two batch sizes (the paper's appendix A, as there for one device): each
step's gradient is a batch of B samples (every rank's, after the all-reduce), the mean of
N steps' gradients one of N·B. Unbiased estimates of |G|² and tr(Σ) from their squared
norms are averaged over windows (an exponential mean with bias correction), and their
ratio is logged.

Every step adds its gradients to a sum and its squared norm to a total, on the device (no
host read); the estimate is read at a log interval. Gradients sharded over the ranks
(FSDP's DTensors) are summed over the ranks there, once an interval.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dmltrain.callback import Callback, TrainerView

BETA = 0.9  # the exponential mean of the windows' estimates


class GradientNoiseScale(Callback):
    """The estimate, from the gradients every step leaves (``on_before_optimizer_step``:
    final, unscaled)."""

    def __init__(
        self,
        parameters: Sequence[Tensor],
        window: int,
        batch: int,
        all_reduce_sum: Callable[[Tensor], Tensor],
    ) -> None:
        self.parameters, self.window, self.batch = parameters, window, batch
        self.all_reduce_sum = all_reduce_sum
        self.summed: list[Tensor] = []  # the window's gradients, summed
        self.small: Tensor | None = None  # the window's squared norms of one step, summed
        self.steps = 0
        self.means: Tensor | None = None  # exponential means of (|G|², tr Σ)
        self.windows = 0
        self.sharded = False

    def on_before_optimizer_step(self, trainer: TrainerView) -> None:
        found = [p.grad for p in self.parameters if p.grad is not None]
        if not found:
            return
        local = [_local(g) for g in found]
        self.sharded = self.sharded or any(
            g is not whole for g, whole in zip(local, found, strict=True)
        )
        grads = [g.detach().float() for g in local]
        squared = torch.stack(torch._foreach_norm(grads)).square().sum()
        if self.steps == 0:
            self.summed = [g.clone() for g in grads]
            self.small = squared
        else:
            torch._foreach_add_(self.summed, grads)
            self.small = self.small + squared if self.small is not None else squared
        self.steps += 1
        if self.steps == self.window:
            self._close_window()

    def _close_window(self) -> None:
        """The window's |G|² and tr Σ, into their means (on the device)."""
        n, b_small = self.steps, float(self.batch)
        b_big = n * b_small
        big = torch.stack(torch._foreach_norm(self.summed)).square().sum() / (n * n)
        assert self.small is not None
        small = self.small / n
        g2 = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1 / b_small - 1 / b_big)
        estimate = torch.stack([g2, trace])
        if self.means is None:
            self.means = torch.zeros_like(estimate)
        mixed = BETA * self.means + (1 - BETA) * estimate
        # a window with a non-finite gradient (a step --check-nans skipped) is left out
        self.means = torch.where(torch.isfinite(estimate).all(), mixed, self.means)
        self.windows += 1
        self.summed, self.small, self.steps = [], None, 0

    def scalars(self, trainer: TrainerView) -> Mapping[str, Any]:
        if self.means is None:
            return {}
        means = self.means / (1 - BETA**self.windows)
        if self.sharded:  # each rank's shards' part of both sums (every rank is here)
            means = self.all_reduce_sum(means.clone())
        return {"gradient_noise_scale": means[1] / means[0]}


def _local(grad: Tensor | None) -> Any:
    """A DTensor's own shard; another tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return grad if to_local is None else to_local()

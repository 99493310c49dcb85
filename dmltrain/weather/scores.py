"""Weather scores: latitude-weighted losses; RMSE and anomaly correlation (ACC) for each
channel and lead time over a whole validation set; the fair CRPS of an ensemble, whose
members may be ranks (``ensemble_group``, ``gather_members``).

A grid cell's weight is the cosine of its latitude, normalised to a mean of 1: a cell
near a pole covers less of the sphere. ``RMSE`` and ``ACC`` are torchmetrics objects
(``dmltrain[metrics]``) whose states are sums, so the ranks' parts add up exactly and
every sample counts once (``create_metrics``); each computes a column for each channel
and lead, ``val_rmse_t_500_lead1``.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dmltrain.errors import UserError

try:
    from torchmetrics import Metric
except ImportError as exc:  # the module is the extra's
    raise ImportError(
        "dmltrain.weather.scores needs torchmetrics: pip install 'dmltrain[weather]'"
    ) from exc


def latitude_weights(
    latitudes: Tensor | Sequence[float], dtype: torch.dtype = torch.float32
) -> Tensor:
    """``(lat, 1)`` weights, cos(latitude in degrees), of mean 1: they broadcast over a
    ``(..., lat, lon)`` field."""
    weights = torch.cos(torch.deg2rad(torch.as_tensor(latitudes, dtype=torch.float64)))
    if weights.ndim != 1 or (weights < -1e-12).any():
        raise UserError("latitudes are a 1-D sequence of degrees between -90 and 90")
    weights = weights.clamp(min=0)
    return (weights / weights.mean()).to(dtype)[:, None]


def weighted_mse(prediction: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """The latitude-weighted mean squared error over every element."""
    return ((prediction - target) ** 2 * weights.to(prediction)).mean()


def weighted_mae(prediction: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """The latitude-weighted mean absolute error over every element."""
    return ((prediction - target).abs() * weights.to(prediction)).mean()


def fair_crps(ensemble: Tensor, target: Tensor, member_dim: int = 0) -> Tensor:
    """The fair (unbiased) CRPS of an ensemble of M >= 2 members, element by element:
    mean |x_i - y| - sum |x_i - x_j| / (2 M (M - 1)). Lower is better; 0 for a perfect
    ensemble. Average it (latitude-weighted) for a loss."""
    members = ensemble.movedim(member_dim, 0)
    m = members.shape[0]
    if m < 2:
        raise UserError(f"the fair CRPS needs 2 ensemble members at least ({m} given)")
    skill = (members - target.unsqueeze(0)).abs().mean(0)
    # sum over pairs of |x_i - x_j| from the sorted members: 2 sum_i (2i - m + 1) x_(i)
    ranked = members.sort(dim=0).values
    rank = torch.arange(m, device=members.device, dtype=members.dtype)
    rank = rank.reshape(-1, *([1] * (members.ndim - 1)))
    spread = 2 * ((2 * rank - m + 1) * ranked).sum(0)
    return skill - spread / (2 * m * (m - 1))


def ensemble_group(size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``size`` consecutive ranks, one ensemble member each: the
    ranks ``ZarrWindows(ensemble=size)`` gives the same samples. Every rank calls it, at
    the same point (in ``create_model``); None in one process or for ``size`` 1."""
    if size == 1 or not dist.is_initialized():
        return None
    if size < 1 or dist.get_world_size() % size:
        raise UserError(
            f"an ensemble of {size} ranks must divide the {dist.get_world_size()} processes"
        )
    group, _ = dist.new_subgroups(group_size=size)
    return group


def gather_members(prediction: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``(members, *prediction.shape)``: every rank's prediction in ``group``, in rank
    order. Gradients flow back to each member's rank; with DDP averaging over all ranks,
    a step follows the mean over groups of each group's loss, as one process would."""
    if group is None:
        return prediction[None]
    return _Gather.apply(prediction.contiguous(), group)


class _Gather(torch.autograd.Function):
    """All-gather with a backward that sums each member's gradient over the group (an
    all-reduce, which every backend has; torch's own differentiable gather needs an
    all-to-all or a reduce-scatter, which Gloo lacks)."""

    @staticmethod
    def forward(ctx: Any, prediction: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        members = [torch.empty_like(prediction) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, prediction, group=group)
        return torch.stack(members)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _Scores(Metric):
    """What RMSE and ACC share: latitude weights, the columns' names, and predictions
    as (batch, leads, channels, lat, lon)."""

    full_state_update = False
    weights: Tensor

    def __init__(self, latitudes: Any, channels: Sequence[str], leads: Sequence[int]) -> None:
        super().__init__()
        self.channels, self.leads = list(channels), list(leads)
        # constants, not states: buffers go to the device with the metric, unreduced
        self.register_buffer(
            "weights", latitude_weights(latitudes, torch.float64), persistent=False
        )

    def _sums(self, *names: str) -> None:
        shape = (len(self.leads), len(self.channels))
        for name in names:
            self.add_state(name, torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")

    def _fields(self, prediction: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if prediction.shape != target.shape:
            raise UserError(
                f"the prediction's shape {tuple(prediction.shape)} differs from the target's "
                f"{tuple(target.shape)}"
            )
        if prediction.ndim == 4:  # one lead
            prediction, target = prediction[:, None], target[:, None]
        expected = (len(self.leads), len(self.channels))
        if prediction.ndim != 5 or tuple(prediction.shape[1:3]) != expected:
            raise UserError(
                f"scores take (batch, [leads,] channels, lat, lon) with {expected[0]} lead(s) "
                f"and {expected[1]} channel(s); got {tuple(prediction.shape)}"
            )
        return prediction.double(), target.double()

    def _named(self, values: Tensor) -> dict[str, Tensor]:
        return {f"{c}_lead{lead}": values[i, j] for i, lead in enumerate(self.leads)
                for j, c in enumerate(self.channels)}  # fmt: skip


class RMSE(_Scores):
    """The latitude-weighted RMSE of each channel and lead over every sample of every rank:
    the square root of the mean over samples of each one's weighted mean squared error."""

    squared: Tensor
    samples: Tensor

    def __init__(
        self, latitudes: Any, channels: Sequence[str], leads: Sequence[int] = (1,)
    ) -> None:
        super().__init__(latitudes, channels, leads)
        self._sums("squared")
        self.add_state("samples", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, prediction: Tensor, target: Tensor) -> None:
        p, t = self._fields(prediction, target)
        self.squared += ((p - t) ** 2 * self.weights).mean(dim=(-2, -1)).sum(0)
        self.samples += p.shape[0]

    def compute(self) -> dict[str, Tensor]:
        return self._named((self.squared / self.samples).sqrt())


class ACC(_Scores):
    """The latitude-weighted anomaly correlation of each channel and lead, the anomalies
    from ``climatology`` (``(channels, lat, lon)``, in the predictions' units), pooled over
    every sample of every rank: sum(w a b) / sqrt(sum(w a^2) sum(w b^2))."""

    climatology: Tensor
    ab: Tensor
    aa: Tensor
    bb: Tensor

    def __init__(self, latitudes: Any, climatology: Tensor, channels: Sequence[str],
                 leads: Sequence[int] = (1,)) -> None:  # fmt: skip
        super().__init__(latitudes, channels, leads)
        self.register_buffer("climatology", torch.as_tensor(climatology).double(), persistent=False)
        self._sums("ab", "aa", "bb")

    def update(self, prediction: Tensor, target: Tensor) -> None:
        p, t = self._fields(prediction, target)
        a, b = (
            (p - self.climatology) * self.weights.sqrt(),
            (t - self.climatology) * self.weights.sqrt(),
        )
        self.ab += (a * b).sum(dim=(0, -2, -1))
        self.aa += (a * a).sum(dim=(0, -2, -1))
        self.bb += (b * b).sum(dim=(0, -2, -1))

    def compute(self) -> dict[str, Tensor]:
        return self._named(self.ab / (self.aa * self.bb).sqrt())

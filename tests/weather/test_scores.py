"""dmltrain.weather.scores: latitude weights, weighted losses, fair CRPS, and RMSE and ACC
per channel and lead over a whole set, exact over batches and over 2 real processes."""

import itertools
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmltrain.errors import UserError
from dmltrain.runtime.launch import free_port

pytest.importorskip("torchmetrics")
from dmltrain.weather.scores import (
    ACC,
    RMSE,
    ensemble_group,
    fair_crps,
    gather_members,
    latitude_weights,
    weighted_mae,
    weighted_mse,
)

LATITUDES = [-60.0, -20.0, 20.0, 60.0]
CHANNELS = ["t_500", "t2m"]


def fields(seed: int, batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and targets (batch, 2 leads, 2 channels, 4 lat, 5 lon)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, 2, 2, 4, 5, generator=g)
    return target + 0.3 * torch.randn(batch, 2, 2, 4, 5, generator=g), target


def by_numpy(prediction: torch.Tensor, target: torch.Tensor, climatology: np.ndarray):
    w = np.cos(np.radians(LATITUDES))
    w = (w / w.mean())[:, None]
    p, t = prediction.double().numpy(), target.double().numpy()
    rmse = np.sqrt(((p - t) ** 2 * w).mean(axis=(-2, -1)).mean(axis=0))
    a, b = p - climatology, t - climatology
    acc = (w * a * b).sum(axis=(0, -2, -1)) / np.sqrt(
        (w * a * a).sum(axis=(0, -2, -1)) * (w * b * b).sum(axis=(0, -2, -1))
    )
    return rmse, acc


def test_latitude_weights_and_weighted_losses():
    weights = latitude_weights(LATITUDES)
    assert weights.shape == (4, 1) and float(weights.mean()) == pytest.approx(1.0)
    assert float(weights[1, 0] / weights[0, 0]) == pytest.approx(
        math.cos(math.radians(20)) / math.cos(math.radians(60)), rel=1e-6
    )
    prediction, target = fields(0)
    assert float(weighted_mse(prediction, target, weights)) == pytest.approx(
        float(((prediction - target) ** 2 * weights).mean())
    )
    assert float(weighted_mae(target, target, weights)) == 0


def test_the_fair_crps_is_the_pairwise_formula():
    g = torch.Generator().manual_seed(3)
    ensemble, target = torch.randn(5, 3, 4, generator=g), torch.randn(3, 4, generator=g)
    m = 5
    pairs = sum((ensemble[i] - ensemble[j]).abs() for i, j in itertools.product(range(m), repeat=2))
    expected = (ensemble - target).abs().mean(0) - pairs / (2 * m * (m - 1))
    torch.testing.assert_close(fair_crps(ensemble, target), expected)
    torch.testing.assert_close(fair_crps(ensemble.movedim(0, 2), target, member_dim=2), expected)
    same = target.expand(4, 3, 4)
    assert torch.equal(fair_crps(same, target), torch.zeros(3, 4))
    with pytest.raises(UserError, match="2 ensemble members at least"):
        fair_crps(ensemble[:1], target)


def test_rmse_and_acc_over_a_set_are_its_own_not_a_mean_of_batches():
    prediction, target = fields(1, batch=9)
    climatology = torch.full((2, 4, 5), 0.1)
    rmse, acc = (
        RMSE(LATITUDES, CHANNELS, leads=[1, 2]),
        ACC(LATITUDES, climatology, CHANNELS, [1, 2]),
    )
    for lo, hi in ((0, 2), (2, 7), (7, 9)):  # batches of unequal sizes
        rmse.update(prediction[lo:hi], target[lo:hi])
        acc.update(prediction[lo:hi], target[lo:hi])
    want_rmse, want_acc = by_numpy(prediction, target, climatology.double().numpy())
    got_rmse, got_acc = rmse.compute(), acc.compute()
    assert list(got_rmse) == ["t_500_lead1", "t2m_lead1", "t_500_lead2", "t2m_lead2"]
    for i, lead in enumerate((1, 2)):
        for j, channel in enumerate(CHANNELS):
            key = f"{channel}_lead{lead}"
            assert float(got_rmse[key]) == pytest.approx(want_rmse[i, j], rel=1e-12)
            assert float(got_acc[key]) == pytest.approx(want_acc[i, j], rel=1e-12)
    one = RMSE(LATITUDES, CHANNELS)
    one.update(prediction[:, 0], target[:, 0])  # a single lead: (batch, channels, lat, lon)
    assert float(one.compute()["t2m_lead1"]) == pytest.approx(want_rmse[0, 1], rel=1e-12)
    with pytest.raises(UserError, match=r"with 1 lead\(s\) and 2 channel\(s\); got"):
        one.update(prediction, target)


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    prediction, target = fields(2, batch=7)
    rmse = RMSE(LATITUDES, CHANNELS, leads=[1, 2])
    mine = slice(0, 3) if rank == 0 else slice(3, 7)  # shares of unequal sizes
    rmse.update(prediction[mine], target[mine])
    out[rank] = {k: float(v) for k, v in rmse.compute().items()}
    dist.destroy_process_group()


def test_rmse_over_two_real_processes_is_the_whole_sets():
    port = free_port()
    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(port, out), nprocs=2, start_method="spawn")
    prediction, target = fields(2, batch=7)
    want, _ = by_numpy(prediction, target, np.zeros((2, 4, 5)))
    for rank in (0, 1):
        assert out[rank]["t2m_lead2"] == pytest.approx(want[1, 1], rel=1e-12)
        assert out[rank]["t_500_lead1"] == pytest.approx(want[0, 0], rel=1e-12)


def _members(model: torch.nn.Module, x: torch.Tensor, rank: int) -> torch.Tensor:
    """Member ``rank``'s forecast: the model on the batch, plus its own noise."""
    noise = torch.randn(x.shape[0], 3, generator=torch.Generator().manual_seed(100 + rank))
    return model(x) + noise


def _ensemble_rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    group = ensemble_group(2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    x, y = torch.randn(2, 6, 4), torch.randn(2, 6, 3)  # a batch for each group of 2
    members = gather_members(_members(model, x[rank // 2], rank), group)
    loss = fair_crps(members, y[rank // 2]).mean()
    loss.backward()
    out[rank] = [p.grad.clone() for p in model.parameters()], members.detach()
    dist.destroy_process_group()


def test_an_ensemble_of_ranks_trains_as_one_process_would():
    """4 gloo processes under DDP in 2 ensemble groups of 2: each rank's member is
    gathered in its group, the fair CRPS of the group's ensemble is its loss. The
    gradients equal one process's over the mean of the two groups' losses."""
    port = free_port()
    out = mp.Manager().dict()
    mp.start_processes(_ensemble_rank, args=(port, out), nprocs=4, start_method="spawn")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(2, 6, 4), torch.randn(2, 6, 3)
    losses = []
    for g in (0, 1):
        members = torch.stack([_members(model, x[g], rank) for rank in (2 * g, 2 * g + 1)])
        torch.testing.assert_close(out[2 * g][1], members.detach())
        torch.testing.assert_close(out[2 * g + 1][1], members.detach())
        losses.append(fair_crps(members, y[g]).mean())
    (sum(losses) / 2).backward()
    for rank in range(4):
        for got, param in zip(out[rank][0], model.parameters(), strict=True):
            torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-6)
    assert gather_members(torch.ones(2), None).shape == (1, 2)  # one process: one member

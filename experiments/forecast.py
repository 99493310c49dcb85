"""A weather model trained as NCAR's CREDIT trains one, on a small ERA5-like archive.

``dmltrain forecast`` writes a synthetic archive on first use (``--archive``; by default
``<data-dir>/forecast-era.zarr``: 40 days, 6-hourly, t and u on 2 levels and t2m on a
16 x 32 grid, land-sea mask and orography). It trains a small transformer with spectral
norm in its MLPs: two steps of every channel in, the next step out. Rollouts lengthen by
a schedule (``--rollout``), the loss is latitude-weighted, and each validation scores
RMSE and ACC per channel and lead over the last ten days. Needs ``dmltrain[climate,weather]``.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, ConfigError, UserError, register_experiment

VARIABLES, LEVELS, STATIC = ["t", "u", "t2m"], [500, 850], ["lsm", "orography"]
TRAINING, VALIDATION = (None, "2000-01-30"), ("2000-01-31", None)
GRID, DAYS, CHUNK = (16, 32), 40, 8
LATITUDES = [-78.75 + 10.5 * i for i in range(GRID[0])]
WINDOW = 2
EXTRA = "dmltrain forecast needs two extras: pip install 'dmltrain[climate,weather]'"


@dataclass(frozen=True)
class ForecastOptions:
    archive: str = field(
        default="",
        metadata={
            "help": "the archive to train on (zarr store, netCDF file or glob); by default "
            "<data-dir>/forecast-era.zarr, written when missing"
        },
    )
    rollout: str = field(
        default="0:1,24:2,48:3",
        metadata={"help": "forecast steps a batch by global step: STEP:STEPS,... from step 0"},
    )
    truncate: bool = field(
        default=False,
        metadata={
            "help": "backpropagate each forecast step's loss at once, its input detached "
            "(CREDIT's way: memory for one step)"
        },
    )
    width: int = field(default=64, metadata={"help": "the transformer's width"})
    depth: int = field(default=2, metadata={"help": "transformer blocks"})
    shuffle_buffer: int = field(default=4, metadata={"help": "archive blocks shuffled together"})

    def __post_init__(self) -> None:
        schedule(self.rollout)  # a bad schedule is one line now
        if self.width < 8 or self.width % 4 or self.depth < 1:
            raise ConfigError(
                f"--width must be a multiple of 4, at least 8, and --depth at least 1 "
                f"(got {self.width}, {self.depth})"
            )


def schedule(text: str) -> Any:
    """``RolloutSchedule`` of ``--rollout``'s ``STEP:STEPS,...``."""
    from dmltrain.weather.rollout import RolloutSchedule

    try:
        pairs = [part.split(":") for part in text.split(",")]
        lengths = {int(step): int(steps) for step, steps in pairs}
    except ValueError:
        raise ConfigError(
            f"--rollout {text!r}: write STEP:STEPS pairs, e.g. 0:1,1000:2,2000:3"
        ) from None
    try:
        return RolloutSchedule(lengths)
    except UserError as exc:
        raise ConfigError(f"--rollout {text!r}: {exc}") from None


def write_archive(path: Path) -> None:
    """The synthetic archive: waves travelling east over a latitude profile, a daily cycle
    over land, a little noise (seed 0); written beside ``path``, then moved there."""
    import numpy as np
    import pandas as pd
    import xarray as xr

    steps = 4 * DAYS
    n = np.arange(steps)[:, None, None]
    lat = np.radians(np.array(LATITUDES))[None, :, None]
    lon = np.radians(np.arange(GRID[1]) * 360 / GRID[1])[None, None, :]
    rng = np.random.default_rng(0)
    lsm = (np.cos(3 * lon[0]) * np.cos(2 * lat[0]) > 0.2).astype("f4") + 0 * lat[0]
    orography = 1500 * lsm * np.cos(lat[0]) ** 2
    t, u = [], []
    for k, level in enumerate(LEVELS):
        wave = np.cos(3 * lon - 0.4 * n * (1 + 0.3 * k) + k) * np.cos(lat)
        t.append(290 - 35 * np.sin(lat) ** 2 - (850 - level) / 10 + 6 * wave)
        u.append(12 * np.cos(lat) + 4 * np.sin(3 * lon - 0.4 * n + k) * np.cos(lat))
    t2m = t[1] + 6 + 3 * lsm * np.sin(2 * np.pi * n / 4)
    noise = 0.2 * rng.standard_normal((3, steps, *GRID))
    dims = ("time", "level", "lat", "lon")
    data = xr.Dataset(
        {
            "t": (dims, (np.stack(t, 1) + noise[0, :, None]).astype("f4")),
            "u": (dims, (np.stack(u, 1) + noise[1, :, None]).astype("f4")),
            "t2m": (("time", "lat", "lon"), (t2m + noise[2]).astype("f4")),
            "lsm": (("lat", "lon"), lsm.astype("f4")),
            "orography": (("lat", "lon"), orography.astype("f4")),
        },
        coords={
            "time": pd.date_range("2000-01-01", periods=steps, freq="6h"),
            "level": LEVELS,
            "lat": LATITUDES,
            "lon": np.arange(GRID[1]) * 360 / GRID[1],
        },
    )
    chunks = {"t": (CHUNK, 2, *GRID), "u": (CHUNK, 2, *GRID), "t2m": (CHUNK, *GRID)}
    part = path.with_name(f"{path.name}.part")
    encoding = {name: {"chunks": shape} for name, shape in chunks.items()}
    data.to_zarr(part, mode="w", encoding=encoding, consolidated=False)
    part.rename(path)


class Block(nn.Module):
    """A pre-norm transformer block; its MLP's weights spectrally normalised, as in CREDIT's
    WXFormer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(
            spectral_norm(nn.Linear(width, 2 * width)),
            nn.GELU(),
            spectral_norm(nn.Linear(2 * width, width)),
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class WeatherTransformer(nn.Module):
    """``(batch, window, inputs, lat, lon)`` in, the next step of the first ``outputs``
    channels out (their last step plus a change), in normalised units."""

    def __init__(self, inputs: int, outputs: int, width: int, depth: int, normaliser: nn.Module):
        super().__init__()
        self.outputs, self.patch = outputs, 4
        tokens = (GRID[0] // self.patch) * (GRID[1] // self.patch)
        self.embed = nn.Conv2d(WINDOW * inputs, width, self.patch, stride=self.patch)
        self.position = nn.Parameter(0.02 * torch.randn(1, tokens, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs * self.patch**2)
        self.normaliser = normaliser  # buffers: saved with the weights

    def forward(self, x: Tensor) -> Tensor:
        b, p = x.shape[0], self.patch
        h, w = x.shape[-2] // p, x.shape[-1] // p
        tokens = self.embed(x.flatten(1, 2)).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            tokens = block(tokens)
        change = self.head(tokens).reshape(b, h, w, self.outputs, p, p)
        change = change.permute(0, 3, 1, 4, 2, 5).reshape(b, self.outputs, h * p, w * p)
        return x[:, -1, : self.outputs] + change


class ForecastTrainer(BaseTrainer):
    name = "forecast"
    options: ForecastOptions

    @property
    def archive(self) -> Path:
        return Path(self.options.archive or Path(self.config.data_dir) / "forecast-era.zarr")

    def ensure_archive(self) -> None:
        """The synthetic archive, written by the first process that needs it while the
        others wait on a lock beside it (the model's size and statistics come from it)."""
        import fcntl

        try:
            import xarray  # noqa: F401
            import zarr  # noqa: F401

            import dmltrain.weather.scores  # noqa: F401
        except ImportError:
            raise UserError(EXTRA) from None
        if self.options.archive or self.archive.exists():
            return
        self.archive.parent.mkdir(parents=True, exist_ok=True)
        with open(self.archive.with_name(f"{self.archive.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.archive.exists():
                write_archive(self.archive)

    def windows(self, period: tuple[Any, Any], seed: int | None, leads: int) -> Any:
        from dmltrain.data.zarr_windows import ZarrWindows

        return ZarrWindows(
            str(self.archive),
            VARIABLES,
            window=WINDOW,
            lead=list(range(1, leads + 1)),
            levels=LEVELS,
            static=STATIC,
            period=period,
            stats=self.run_dir / "stats.json",  # from the training period, once
            seed=seed,
            shuffle_buffer=self.options.shuffle_buffer,
            drop_remainder=seed is not None,
            rank=self.dist.rank if seed is not None else 0,
            world_size=self.dist.world_size if seed is not None else 1,
        )

    def create_model(self) -> nn.Module:
        self.ensure_archive()  # and the extras, or one line
        self.schedule = schedule(self.options.rollout)
        self.weights: Tensor | None = None  # made where the loss is (not on the meta device)
        # the training windows: the model's channels and statistics, then its data
        self.training = training = self.windows(TRAINING, self.config.seed, self.schedule.longest)
        self.channels = training.target_channels
        normaliser = training.stats.module(self.channels)
        inputs, outputs = len(training.channels), len(self.channels)
        return WeatherTransformer(inputs, outputs, self.options.width, self.options.depth,
                                  normaliser)  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)  # also the blocks --activation-checkpointing recomputes

    def create_datasets(self) -> tuple[Any, Any]:
        longest, loop, training = self.schedule.longest, self.config.loop, self.training
        batches = math.ceil(len(training) / loop.batch_size)
        training.follow(self.schedule, loop.steps_per_epoch or math.ceil(batches / loop.grad_accum))
        # validation: every sample of the last ten days, all leads, on every rank (a map-style
        # set: FSDP's ranks then take equal shares, each sample scored once)
        samples = [(x.clone(), y.clone()) for x, y in self.windows(VALIDATION, None, longest)]
        inputs, targets = (torch.stack(parts) for parts in zip(*samples, strict=True))
        return training, TensorDataset(inputs, targets)

    def create_metrics(self) -> dict[str, Any]:
        from dmltrain.weather.scores import ACC, RMSE

        normaliser = self.unwrapped_model.normaliser
        leads = list(range(1, self.schedule.longest + 1))
        # ACC's climatology: each channel's mean over the training period (physical units)
        climatology = normaliser.mean.detach().cpu().double().reshape(-1, 1, 1).expand(-1, *GRID)
        return {"rmse": RMSE(LATITUDES, self.channels, leads),
                "acc": ACC(LATITUDES, climatology, self.channels, leads)}  # fmt: skip

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        from dmltrain.weather.scores import latitude_weights, weighted_mse

        if self.weights is None:
            self.weights = latitude_weights(LATITUDES).to(target.device)
        return weighted_mse(prediction.float(), target, self.weights)

    def train_step(self, batch: Any) -> Tensor:
        from dmltrain.weather.rollout import rollout

        inputs, targets = batch
        steps = self.schedule(self.global_step)
        return rollout(self, inputs, targets, self.loss, steps, self.options.truncate)

    def val_step(self, batch: Any) -> dict[str, Any]:
        from dmltrain.weather.rollout import forecast

        inputs, targets = batch
        prediction = forecast(self.model, inputs, targets.shape[1], targets.shape[2]).float()
        denormalise = self.unwrapped_model.normaliser.denormalise
        physical = (denormalise(prediction), denormalise(targets))
        return {"loss": self.loss(prediction, targets), "rmse": physical, "acc": physical}


EXPERIMENT = register_experiment(
    "forecast",
    ForecastTrainer,
    ForecastOptions,
    help="a weather transformer trained as CREDIT trains one (synthetic ERA5-like archive)",
)

"""ZarrWindows (dmltrain/data/zarr_windows.py) on real archives the tests write, in zarr
and in netCDF through xarray: windows of channels, periods, levels, static fields,
several leads, chunk-aware shuffling, shards by rank and by real loader workers, a
position a resume takes up, and normalisation.

The archives' values say where they are (``helpers.make_archive``: 1000 t + 10 level +
cell / 100), so a sample tells which time step it was cut from."""

import functools
import json
import pickle
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    AT_ONCE,
    assert_same_run,
    make_archive,
    make_store,
    run_cli,
)
from torch.utils.data import DataLoader

from dmltrain.data.normalise import Stats
from dmltrain.data.zarr_windows import ZarrWindows
from dmltrain.errors import UserError

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")


def step_of(inputs: torch.Tensor) -> int:
    """The time step of a window's first step (channel 0: t at its first level)."""
    return round(float(inputs[0, 0].flatten()[0]) / 1000)


def starts(samples) -> list[int]:
    return [step_of(x) for x, _ in samples]


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("archives")
    return {kind: make_archive(folder / f"era.{kind}") for kind in ("zarr", "nc")}


@pytest.mark.parametrize("kind", ["zarr", "nc"])
def test_a_window_is_every_channel_at_k_steps_with_static_fields_and_targets_leads_on(
    archives, kind
):
    windows = ZarrWindows(str(archives[kind]), ["t", "u", "t2m"], window=2, lead=[1, 3],
                          levels=[500, 1000], static=["lsm", "orography"])  # fmt: skip
    assert windows.channels == ["t_500", "t_1000", "u_500", "u_1000", "t2m", "lsm", "orography"]
    assert windows.target_channels == windows.channels[:5]
    assert len(windows) == 50 - 2 - 3 + 1
    inputs, target = next(iter(windows))
    assert inputs.shape == (2, 7, 3, 4) and target.shape == (2, 5, 3, 4)
    corner = inputs[:, :, 0, 0].tolist()
    assert corner[0] == [0, 20, 0.5, 20.5, 5, 0, 0] and corner[1][:5] == [1000, 1020, 1000.5,
                                                                          1020.5, 1005]  # fmt: skip
    assert float(inputs[1, 6, 2, 3]) == pytest.approx(110)  # orography, cell 11
    assert float(inputs[0, 5, 0, 1]) == 1  # lsm
    assert target[:, 0, 0, 0].tolist() == [2000, 4000]  # 1 and 3 steps after the window
    single = ZarrWindows(str(archives[kind]), "t2m", window=3, lead=2)
    x, y = next(iter(single))
    assert x.shape == (3, 1, 3, 4) and y.shape == (1, 3, 4) and float(y[0, 0, 0]) == 4005
    assert pickle.loads(pickle.dumps(windows)).archive._opened is None  # reopened there


def test_periods_by_date_or_index_hold_whole_samples(archives):
    store = str(archives["zarr"])
    by_date = ZarrWindows(store, "t", window=2, period=("2000-01-02", "2000-01-03"))
    assert by_date.archive.steps == 8  # both days, 4 steps each
    assert starts(by_date) == [4, 5, 6, 7, 8, 9]  # the target of the last inside
    by_index = ZarrWindows(store, "t", window=2, period=(4, 12))
    assert starts(by_index) == [4, 5, 6, 7, 8, 9]
    assert starts(ZarrWindows(store, "t", period=(45, None))) == [45, 46, 47, 48]


def test_each_pass_serves_every_sample_once_over_ranks_and_real_loader_workers(tmp_path):
    """Chunks of 7 steps, a period from step 3, windows of span 5: no block lines up with
    a window. 3 ranks x 2 workers, 2 shuffled passes: none twice; only the remainder
    (40 samples, 3 ranks: 1) is left out, another one each pass; without dropping, all."""
    store = str(make_archive(tmp_path / "era.zarr", steps=47, chunk=7))
    everything = set(range(3, 43))  # window starts with span 5 inside steps 3..46
    left_out = []
    for drop in (True, False):
        for epoch in (0, 1):
            seen: Counter[int] = Counter()
            for rank in range(3):
                windows = ZarrWindows(store, "t", window=2, lead=[1, 3], period=(3, None),
                                      rank=rank, world_size=3, seed=11, shuffle_buffer=2,
                                      chunks_per_read=1, drop_remainder=drop)  # fmt: skip
                windows.set_epoch(epoch)
                batches = DataLoader(windows, batch_size=4, num_workers=2)
                served = [step_of(x) for inputs, _ in batches for x in inputs]
                assert len(served) == len(windows)
                seen.update(served)
            assert max(seen.values()) == 1
            assert len(seen) == (39 if drop else 40) and set(seen) <= everything
            if drop:
                left_out.append(everything - set(seen))
    assert [len(x) for x in left_out] == [1, 1] and left_out[0] != left_out[1]


def test_the_ranks_of_an_ensemble_group_read_the_same_samples(archives):
    """4 ranks in ensemble groups of 2, each with 2 real loader workers: ranks 0 and 1
    serve the same samples in the same order, so do ranks 2 and 3; the two groups split
    the pass between them."""
    served = []
    for rank in range(4):
        windows = ZarrWindows(str(archives["zarr"]), "t", rank=rank, world_size=4, seed=5,
                              shuffle_buffer=2, chunks_per_read=1, ensemble=2)  # fmt: skip
        windows.set_epoch(1)
        served.append([step_of(x) for xs, _ in DataLoader(windows, 4, num_workers=2) for x in xs])
    assert served[0] == served[1] and served[2] == served[3]
    assert len(served[0]) == 24 and not set(served[0]) & set(served[2])
    both = served[0] + served[2]
    assert len(set(both)) == 48 and set(both) < set(range(49))  # one left over, 2 groups
    with pytest.raises(UserError, match="ensemble=3 must divide the 4 processes"):
        ZarrWindows(str(archives["zarr"]), "t", rank=0, world_size=4, ensemble=3)


def test_the_shuffle_mixes_blocks_of_a_buffer_and_differs_each_pass(tmp_path):
    store = str(make_archive(tmp_path / "era.zarr", steps=90, chunk=5))
    windows = ZarrWindows(store, "t", seed=3, shuffle_buffer=2, chunks_per_read=1)
    first = starts(windows)
    assert sorted(first) == list(range(89)) and first != sorted(first)
    pieces, at = windows.pieces(0, 1), 0
    assert all(stop - first <= 5 and first % 5 == 0 for first, stop in pieces)
    for number in range(0, len(pieces), 2):  # a buffer: 2 blocks, mixed
        buffer = pieces[number : number + 2]
        size = sum(stop - first for first, stop in buffer)
        served = first[at : at + size]
        assert sorted(served) == sorted(t for a, b in buffer for t in range(a, b))
        assert served != sorted(served)
        at += size
    windows.set_epoch(1)
    second = starts(windows)
    assert second != first and sorted(second) == sorted(first)
    windows.set_epoch(0)
    assert starts(windows) == first
    in_order = ZarrWindows(store, "t", rank=1, world_size=2)
    assert starts(in_order) == list(range(44, 88))  # rank 1's half of the period


def test_a_worker_resumes_at_the_same_sample_mid_buffer_bitwise(archives):
    store = str(archives["zarr"])
    options = dict(window=2, seed=5, shuffle_buffer=2, chunks_per_read=1, rank=1,
                   world_size=2, stats=None, static=["lsm"])  # fmt: skip
    whole = list(ZarrWindows(store, ["t", "u"], **options))
    stopped = ZarrWindows(store, ["t", "u"], **options)
    stream = iter(stopped)
    head = [next(stream) for _ in range(9)]  # past the first buffer of 2 blocks of 7
    moved = ZarrWindows(store, ["t", "u"], **options)
    moved.load_state_dict(stopped.state_dict())
    again = head + list(moved)
    assert len(again) == len(whole)
    for (x, y), (a, b) in zip(whole, again, strict=True):
        assert torch.equal(x, a) and torch.equal(y, b)
    assert list(moved) == []  # read to its end: it stays there until the next pass


def test_a_stateful_loader_with_two_workers_resumes_where_each_was(archives):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        windows = ZarrWindows(functools.partial(xr.open_dataset, archives["nc"]), ["t", "t2m"],
                              window=2, seed=1, shuffle_buffer=1)  # fmt: skip
        windows.set_epoch(2)
        return StatefulDataLoader(windows, batch_size=3, num_workers=2)

    whole = [x for x, _ in loader()]
    first = loader()
    batches = iter(first)
    head = [next(batches)[0] for _ in range(5)]
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    rest = [x for x, _ in second]
    assert len(head) + len(rest) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(whole, head + rest, strict=True))


def test_the_same_samples_from_zarr_netcdf_and_an_xarray_opener(archives):
    kinds = [str(archives["zarr"]), str(archives["nc"]),
             functools.partial(xr.open_dataset, archives["nc"], engine="h5netcdf")]  # fmt: skip
    read = [list(ZarrWindows(k, ["u", "t2m"], levels=[850], period=("2000-01-05", None),
                             static=["lsm"], seed=2)) for k in kinds]  # fmt: skip
    for other in read[1:]:
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(read[0], other, strict=True))  # fmt: skip


def test_statistics_over_the_training_period_are_computed_once_kept_and_applied(archives, tmp_path):
    store, path = str(archives["zarr"]), tmp_path / "stats.json"
    options = dict(levels=[500, 850], static=["lsm", "orography"], stats=path)
    train = ZarrWindows(store, ["t", "t2m"], period=(0, 30), **options)
    data = xr.open_zarr(store, consolidated=False).isel(time=slice(0, 30))
    expected = [data.t.sel(level=500), data.t.sel(level=850), data.t2m, data.lsm, data.orography]
    stats = json.loads(path.read_text())
    assert stats["channels"] == ["t_500", "t_850", "t2m", "lsm", "orography"]
    assert stats["period"] == [0, 30]
    for name, array, mean, std in zip(stats["channels"], expected, stats["mean"], stats["std"],
                                      strict=True):  # fmt: skip
        values = np.asarray(array, np.float64)
        assert mean == pytest.approx(values.mean(), rel=1e-12), name
        assert std == pytest.approx(values.std(), rel=1e-9), name
    # the validation period reads the training period's, never its own
    validation = ZarrWindows(store, ["t", "t2m"], period=(30, None), **options)
    assert validation.stats == train.stats
    x, y = next(iter(validation))
    raw = ZarrWindows(store, ["t", "t2m"], period=(30, None), **{**options, "stats": None})
    raw_x, raw_y = next(iter(raw))
    mean, std = (torch.tensor(v)[:, None, None] for v in (stats["mean"], stats["std"]))
    torch.testing.assert_close(x, (raw_x - mean) / std, rtol=1e-6, atol=1e-6)
    normaliser = train.stats.module(train.target_channels)
    torch.testing.assert_close(normaliser.denormalise(y), raw_y, rtol=1e-6, atol=1e-3)
    assert set(dict(normaliser.named_buffers())) == {"mean", "std"}
    constant = Stats(("c",), (3.0,), (0.0,))
    assert constant.of(["c"])[1].tolist() == [1.0]  # a constant channel divided by 1
    with pytest.raises(UserError, match="have no channel u_500"):
        ZarrWindows(store, ["u"], levels=[500], stats=path)


def test_what_it_cannot_read_is_one_line(archives, tmp_path):
    store = str(archives["zarr"])
    (tmp_path / "bad.json").write_text("{")
    strings = {"channels": ["t500", "t850", "t1000"], "mean": ["a", "b", "c"], "std": [1, 1, 1]}
    (tmp_path / "strings.json").write_text(json.dumps(strings))
    (tmp_path / "short.json").write_text(json.dumps({**strings, "mean": [0.0]}))
    (tmp_path / "a-file").write_text("")
    for args, options, message in (
        ((str(tmp_path / "nothing.nc"), "t"), {}, "cannot be opened as an archive"),
        ((str(tmp_path / "none*.nc"), "t"), {}, "no file matches"),
        ((store, ["t", "sst"]), {}, "has no variable sst"),
        ((store, "lsm"), {}, "lsm has no time axis"),
        ((store, "t"), {"levels": [300]}, "has no level 300 .it has 500, 850, 1000"),
        ((store, "t"), {"static": ["t2m"]}, "the static field t2m has shape"),
        ((store, "t"), {"period": ("2001", "2002")}, "holds no time step"),
        ((store, "t", 60), {}, "fewer than the 1 processes"),
        ((store, "t"), {"stats": tmp_path / "bad.json"}, "not a statistics file"),
        ((store, "t"), {"stats": tmp_path / "strings.json"}, "a mean value is not a number"),
        ((store, "t"), {"stats": tmp_path / "short.json"}, "1 mean values for 3 channels"),
        # a folder that cannot be made (root writes in a read-only folder: a file stands in)
        ((store, "t"), {"stats": tmp_path / "a-file" / "s.json"}, "cannot keep the statistics"),
        ((xr.open_zarr, "t"), {}, "cannot be opened as an archive: TypeError"),
        ((dict, "t"), {}, "returned a dict, not an xarray.Dataset"),
        ((42, "t"), {}, "a path or a function"),
    ):
        with pytest.raises(UserError, match=message):
            ZarrWindows(*args, **options)


FORECAST = Path(__file__).resolve().parents[2] / "docs" / "climate-data.md"


def docs_blocks() -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", FORECAST.read_text(), re.S)


STOPPING = textwrap.dedent("""
    import json
    import os
    import signal
    from dataclasses import dataclass, field

    from dmltrain import register_experiment
    from forecast import Forecast, ForecastOptions


    @dataclass(frozen=True)
    class Options(ForecastOptions):
        stop_at_step: int = field(default=-1, metadata={"help": "rank 0 sends itself SIGUSR1"})


    class Stopping(Forecast):
        def train_step(self, batch):
            if self.dist.rank == 0 and self.global_step == self.options.stop_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            keys = [" ".join(f"{v:.5f}" for v in x.flatten()[:6].tolist()) for x in batch[0]]
            with open(self.run_dir / f"samples.{self.dist.rank}.txt", "a") as record:
                record.write(f"{self.global_step + 1} {json.dumps(keys)}\\n")
            return super().train_step(batch)


    EXPERIMENT = register_experiment("forecast-stopping", Stopping, Options)
""")


@pytest.mark.parametrize("kind", ["zarr", "nc"])
def test_the_forecast_example_preempted_on_2_ranks_x_2_workers_resumes_bitwise(tmp_path, kind):
    """docs/climate-data.md's archive and experiment, from zarr and from netCDF: training
    and validation periods, normalised, 2 processes x 2 loader workers; SIGUSR1 mid
    epoch 2, started again, it trains the same samples at the same steps as a run never
    stopped and ends with the same weights, bitwise."""
    writer, forecast = docs_blocks()[:2]
    subprocess.run([sys.executable, "-c", writer], cwd=tmp_path, check=True, timeout=120)
    (tmp_path / "forecast.py").write_text(forecast)
    (tmp_path / "stopping.py").write_text(STOPPING)
    args = [
        "stopping.py",
        "--archive",
        f"era.{kind}",
        "--nprocs",
        "2",
        "--num-workers",
        "2",
        "--batch-size",
        "4",
        "--epochs",
        "3",
        "--shuffle-buffer",
        "2",
        "--progress",
        "off",
    ]
    runs = {name: tmp_path / name for name in ("full", "split")}
    for run, extra, code in (
        (runs["full"], [], 0),
        (runs["split"], ["--stop-at-step", "8", *AT_ONCE], 3),
        (runs["split"], [], 0),
    ):
        done = run_cli(*args, *extra, "--run-dir", str(run), cwd=tmp_path)
        assert done.returncode == code, done.stderr[-3000:]

    def samples(run: Path) -> dict[str, list[str]]:
        return {p.name: list(dict.fromkeys(p.read_text().splitlines()))
                for p in sorted(run.glob("samples.*.txt"))}  # fmt: skip

    assert samples(runs["split"]) == samples(runs["full"])
    steps_per_epoch = 6  # 46 training windows, 23 a rank, 2 workers' batches of 4: 3 each
    first_pass = Counter(key for lines in samples(runs["full"]).values()
                         for line in lines if int(line.split()[0]) <= steps_per_epoch
                         for key in json.loads(line.split(" ", 1)[1]))  # fmt: skip
    assert len(first_pass) == 46 and set(first_pass.values()) == {1}
    assert_same_run(runs["full"], runs["split"])
    assert json.loads((runs["full"] / "stats.json").read_text())["period"] == [0, 48]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_store_whose_chunks_vanish_mid_run_stops_with_one_line(tmp_path, workers):
    """t2m's chunks deleted at step 4 (a scratch purge): the run stops with one line
    (exit 2) instead of training on zeros to 'done' and rotating away every checkpoint
    from before; those checkpoints are all there."""
    store = make_store(tmp_path / "era.zarr")
    experiment = tmp_path / "forecast.py"
    experiment.write_text(VANISHING)
    run = tmp_path / "run"
    done = run_cli(str(experiment), "--store", str(store), "--num-workers", workers,
                   "--batch-size", "4", "--steps-per-epoch", "3", "--epochs", "4",
                   "--checkpoint-every-steps", "1", "--keep-last", "2", "--purge-at-step", "4",
                   "--progress", "off", "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("dmltrain: error:")]
    assert f"{store}: its chunk t2m/c/" in line and "is gone since the run opened" in line, line
    kept = sorted(p.name for p in (run / "checkpoints").glob("ckpt-*"))
    steps = [int(name.split("-")[2].split(".")[0]) for name in kept]
    assert steps and 4 <= max(steps) < 12, kept  # the steps of batches read before it
    assert "done" not in (run / "outcome.json").read_text()


VANISHING = textwrap.dedent("""
    import shutil
    from dataclasses import dataclass, field
    from pathlib import Path

    import torch.nn.functional as F
    from torch import nn

    from dmltrain import BaseTrainer, register_experiment
    from dmltrain.data.zarr_windows import ZarrWindows


    @dataclass(frozen=True)
    class Options:
        store: str = field(default="", metadata={"help": "the zarr store"})
        purge_at_step: int = field(default=-1, metadata={"help": "rank 0 deletes t2m's chunks"})


    class Forecast(BaseTrainer):
        def create_model(self):
            return nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 12, 4 * 12))

        def create_datasets(self):
            return ZarrWindows(self.options.store, ["t2m", "u10"], window=2, seed=3,
                               shuffle_buffer=1, chunks_per_read=1), None

        def train_step(self, batch):
            x, y = batch
            if self.global_step == self.options.purge_at_step:
                shutil.rmtree(Path(self.options.store) / "t2m" / "c")  # as a scratch purge
            return F.mse_loss(self.model(x), y.flatten(1))


    EXPERIMENT = register_experiment("forecast", Forecast, Options)
""")

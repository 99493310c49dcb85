"""ZarrWindows (dmltrain/data/zarr_windows.py) on a real zarr store the test writes:
windows along time, shards by rank and worker, a position a resume takes up.

The store's values say their time step (value = 1000 t + position), so a sample tells
which windows it was cut from."""

import pickle
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import AT_ONCE, ZARR_SHAPE, ZARR_STEPS, assert_same_run, make_store, run_cli

from dmltrain.data.zarr_windows import ZarrWindows
from dmltrain.errors import UserError

zarr = pytest.importorskip("zarr")


def step_of(inputs: torch.Tensor) -> int:
    return int(inputs[0, 0].flatten()[0] // 1000)


def test_a_window_is_k_steps_of_every_variable_and_the_target_lead_steps_on(tmp_path):
    store = make_store(tmp_path / "era.zarr")
    windows = ZarrWindows(str(store), ["t2m", "u10"], window=3, lead=2)
    assert len(windows) == ZARR_STEPS - 3 - 2 + 1
    inputs, target = next(iter(windows))
    assert inputs.shape == (3, 2, *ZARR_SHAPE) and target.shape == (2, *ZARR_SHAPE)
    assert [int(inputs[k, 0, 0, 0, 0]) for k in range(3)] == [0, 1000, 2000]
    assert float(inputs[0, 1, 0, 0, 0]) == 0.5  # u10 stacked after t2m
    assert int(target[0, 0, 0, 0]) == 4000  # 2 steps after the window's last
    assert windows._arrays is not None and pickle.loads(pickle.dumps(windows))._arrays is None


def test_ranks_share_a_pass_in_turns_each_window_once_and_resume_in_place(tmp_path):
    store = str(make_store(tmp_path / "era.zarr"))
    ranks = [ZarrWindows(store, "t2m", window=2, rank=r, world_size=3, seed=5) for r in range(3)]
    seen = [step_of(x) for r in ranks for x, _ in r]
    assert len(seen) == 3 * len(ranks[0]) == 39 and len(set(seen)) == 39  # 42 - remainder
    assert list(ranks[0]) == []  # read to its end: it stays there until the next pass
    ranks[0].set_epoch(0)
    first = [step_of(x) for x, _ in ranks[0]]
    ranks[0].set_epoch(1)
    assert [step_of(x) for x, _ in ranks[0]] != first  # a pass of its own shuffle
    again = ZarrWindows(store, "t2m", window=2, rank=0, world_size=3, seed=5)
    stream = iter(again)
    head = [step_of(next(stream)[0]) for _ in range(4)]
    moved = ZarrWindows(store, "t2m", window=2, rank=0, world_size=3, seed=5)
    moved.load_state_dict(again.state_dict())
    assert head + [step_of(x) for x, _ in moved] == first


def test_what_it_cannot_read_is_one_line(tmp_path):
    store = str(make_store(tmp_path / "era.zarr"))
    for args, message in (
        ((str(tmp_path / "nothing.zarr"), "t2m"), "is not a zarr group"),
        ((store, ["t2m", "sst"]), "has no array sst"),
        ((store, "t2m", 50), "fewer than the 1 processes"),
    ):
        with pytest.raises(UserError, match=message):
            ZarrWindows(*args)


EXPERIMENT = textwrap.dedent("""
    import os
    import shutil
    import signal
    from dataclasses import dataclass, field
    from pathlib import Path

    import torch.nn.functional as F
    from torch import nn

    from dmltrain import BaseTrainer, register_experiment
    from dmltrain.data.zarr_windows import ZarrWindows


    @dataclass(frozen=True)
    class Options:
        store: str = field(default="", metadata={"help": "the zarr store"})
        stop_at_step: int = field(default=-1, metadata={"help": "rank 0 sends itself SIGUSR1"})
        purge_at_step: int = field(default=-1, metadata={"help": "rank 0 deletes t2m's chunks"})


    class Forecast(BaseTrainer):
        def create_model(self):
            return nn.Sequential(nn.Flatten(), nn.Linear(2 * 2 * 24, 2 * 24))

        def create_datasets(self):
            windows = ZarrWindows(self.options.store, ["t2m", "u10"], window=2, seed=3,
                                  rank=self.dist.rank, world_size=self.dist.world_size)
            return windows, None

        def train_step(self, batch):
            x, y = batch
            if self.dist.rank == 0 and self.global_step == self.options.stop_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            if self.dist.rank == 0 and self.global_step == self.options.purge_at_step:
                shutil.rmtree(Path(self.options.store) / "t2m" / "c")  # as a scratch purge
            with open(self.run_dir / f"steps.{self.dist.rank}.txt", "a") as record:
                steps = " ".join(str(int(v // 1000)) for v in x[:, 0, 0, 0, 0, 0])
                record.write(f"{self.global_step + 1} {steps}\\n")
            return F.mse_loss(self.model(x / 1000), y.flatten(1) / 1000)


    EXPERIMENT = register_experiment("forecast", Forecast, Options)
""")


def test_a_climate_model_on_zarr_windows_preempted_on_2_ranks_resumes_exactly(tmp_path):
    """dmltrain FILE.py --nprocs 2 --num-workers 2 on a store written here: preempted in
    epoch 2 (SIGUSR1), started again, it trains the same windows at the same steps as a
    run never stopped, and ends with the same weights, bitwise."""
    store = make_store(tmp_path / "era.zarr")
    experiment = tmp_path / "forecast.py"
    experiment.write_text(EXPERIMENT)
    args = [str(experiment), "--store", str(store), "--nprocs", "2", "--num-workers", "2",
            "--batch-size", "4", "--steps-per-epoch", "3", "--epochs", "3", "--lr", "0.01",
            "--progress", "off"]  # fmt: skip
    runs = {name: tmp_path / name for name in ("full", "split")}
    for run, extra, code in (
        (runs["full"], [], 0),
        (runs["split"], ["--stop-at-step", "4", *AT_ONCE], 3),
        (runs["split"], [], 0),
    ):
        done = run_cli(*args, *extra, "--run-dir", str(run), cwd=tmp_path)
        assert done.returncode == code, done.stderr[-3000:]

    def steps(run: Path) -> dict[str, list[str]]:
        return {p.name: list(dict.fromkeys(p.read_text().splitlines())) for p in
                sorted(run.glob("steps.*.txt"))}  # fmt: skip

    assert steps(runs["split"]) == steps(runs["full"])
    # a pass: 20 windows a rank, 6 steps of a rank's 2 workers' batches (4, 4, 2 each)
    first_pass = Counter(t for lines in steps(runs["full"]).values() for line in lines
                         if int(line.split()[0]) <= 6 for t in line.split()[1:])  # fmt: skip
    assert len(first_pass) == 40 and set(first_pass.values()) == {1}
    assert_same_run(runs["full"], runs["split"])


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_store_whose_chunks_vanish_mid_run_stops_with_one_line(tmp_path, workers):
    """t2m's chunks deleted at step 4 (a scratch purge): the run stops with one line
    (exit 2) instead of training on zeros to 'done' and rotating away every checkpoint
    from before; those checkpoints are all there."""
    store = make_store(tmp_path / "era.zarr")
    experiment = tmp_path / "forecast.py"
    experiment.write_text(EXPERIMENT)
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

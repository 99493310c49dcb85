"""dmltrain.weather.rollout: a forecast model rolled out several steps in train_step.

A linear "advection" model on 8 x 16 fields: the gradient of a full rollout is autograd's
of the loop written out, a truncated one's the sum of each step's with its input
detached; under DDP and FSDP on 2 processes, gradients are synchronised once an
optimizer step (counted in the processes) and the weights equal one process's at the
same global batch."""

import contextlib
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli
from torch import nn

from dmltrain.errors import UserError
from dmltrain.weather.rollout import RolloutSchedule, rollout


class Eager:
    """A trainer's part rollout uses: its model and an early backward (no ranks here)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def backward_early(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def advection(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(1, 2), nn.Conv2d(2 * 3, 2, 3, padding=1))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (4, window 2, 2 channels + 1 static, 8, 16); targets (4, 3 leads, 2, 8, 16)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 2, 3, 8, 16, generator=generator), torch.randn(
        4, 3, 2, 8, 16, generator=generator
    )


def by_hand(model: nn.Module, inputs, targets, detach: bool) -> list[torch.Tensor]:
    """The rollout written out; each step's gradient, or autograd's of the mean loss."""
    static, state, total = inputs[:, -1, 2:], inputs, 0
    for k in range(3):
        prediction = model(state)
        part = F.mse_loss(prediction, targets[:, k]) / 3
        if detach:
            part.backward()
            prediction = prediction.detach()
        else:
            total = total + part
        newest = torch.cat([prediction, static], dim=1)[:, None]
        state = torch.cat([state[:, 1:], newest], dim=1)
    if not detach:
        total.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("truncate", [False, True])
def test_a_rollout_gives_the_gradients_of_the_loop_written_out(truncate):
    inputs, targets = batch()
    model = advection()
    expected = by_hand(model, inputs, targets, detach=truncate)
    model.zero_grad()
    loss = rollout(Eager(model), inputs, targets, F.mse_loss, truncate=truncate)
    loss.backward()
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        again = rollout(Eager(advection()), inputs, targets, F.mse_loss)
    assert float(loss.detach()) == pytest.approx(float(again), rel=1e-6)  # the mean of all 3
    with pytest.raises(UserError, match="a rollout of 4 steps needs 1 to 3 targets"):
        rollout(Eager(model), inputs, targets, F.mse_loss, steps=4)


def test_the_loader_workers_send_each_pass_the_leads_its_rollouts_use(tmp_path):
    """ZarrWindows.follow(schedule, steps a pass): pass e sends the leads of the longest
    rollout of its global steps, through 2 real loader workers; a schedule that outruns
    the dataset's leads is one line."""
    from helpers import make_archive
    from torch.utils.data import DataLoader

    from dmltrain.data.zarr_windows import ZarrWindows

    store = str(make_archive(tmp_path / "era.zarr"))
    windows = ZarrWindows(store, "t2m", window=2, lead=[1, 2, 3])
    windows.follow(RolloutSchedule({0: 1, 5: 2, 9: 3}), steps_per_pass=4)
    sent = []
    for epoch in range(4):  # steps 0-3, 4-7 (5: 2 steps), 8-11 (9: 3), 12-15
        windows.set_epoch(epoch)
        shapes = {tuple(y.shape[1:]) for _, y in DataLoader(windows, 8, num_workers=2)}
        assert len(shapes) == 1
        sent.append(shapes.pop()[0])
    assert sent == [1, 2, 3, 3]
    _, target = next(iter(windows))
    assert target[:, 0, 0, 0].tolist() == [2005, 3005, 4005]  # leads 1-3 after step 1
    windows.follow(RolloutSchedule({0: 1, 8: 4}), steps_per_pass=4)
    windows.set_epoch(1)
    with pytest.raises(UserError, match="rolls 4 steps in pass 1; ZarrWindows holds 3 leads"):
        next(iter(windows))


def test_a_schedule_is_a_function_of_the_step():
    schedule = RolloutSchedule({0: 1, 10: 2, 25: 4})
    assert [schedule(s) for s in (0, 9, 10, 24, 25, 10**6)] == [1, 1, 2, 2, 4, 4]
    assert schedule.longest == 4
    for bad in ({5: 1}, {0: 0}):
        with pytest.raises(UserError, match="rollout schedule"):
            RolloutSchedule(bad)


EXPERIMENT = textwrap.dedent("""
    import json
    from dataclasses import dataclass, field

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import Dataset

    from dmltrain import BaseTrainer, register_experiment
    from dmltrain.weather.rollout import RolloutSchedule, rollout

    SYNCS = [0]  # gradient reductions of this process


    def counted(collective):
        def count(*args, **kwargs):
            SYNCS[0] += 1
            return collective(*args, **kwargs)
        return count


    dist.reduce_scatter_single = counted(dist.reduce_scatter_single)  # FSDP2's


    def ddp_hook(state, bucket):  # DDP's all-reduce of a bucket
        SYNCS[0] += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


    class Fields(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, key):
            g = torch.Generator().manual_seed(key[1] if isinstance(key, tuple) else key)
            return torch.randn(2, 3, 8, 16, generator=g), torch.randn(3, 2, 8, 16, generator=g)


    @dataclass(frozen=True)
    class Options:
        truncate: bool = field(default=False, metadata={"help": "truncated backpropagation"})


    class Advection(BaseTrainer):
        schedule = RolloutSchedule({0: 2, 4: 3})

        def create_model(self):
            torch.manual_seed(0)
            return nn.Sequential(nn.Flatten(1, 2), nn.Conv2d(6, 2, 3, padding=1))

        def create_datasets(self):
            return Fields(), None

        def on_train_start(self):
            if isinstance(self.model, nn.parallel.DistributedDataParallel):
                self.model.register_comm_hook(None, ddp_hook)

        def train_step(self, batch):
            before = SYNCS[0]
            inputs, targets = batch
            loss = rollout(self, inputs, targets, F.mse_loss, truncate=self.options.truncate,
                           steps=self.schedule(self.global_step))
            self._before = before
            return loss

        def on_after_backward(self):  # the step's reductions are done
            with open(self.run_dir / f"syncs.{self.dist.rank}.txt", "a") as out:
                out.write(f"{SYNCS[0] - self._before}\\n")

        def on_train_end(self):
            weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                       for k, v in self.unwrapped_model.state_dict().items()}
            if self.dist.rank == 0:
                torch.save(weights, self.run_dir / "final_weights.pt")


    EXPERIMENT = register_experiment("advection", Advection, Options)
""")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rollout_on_2_processes_syncs_once_a_step_and_equals_one_process(tmp_path, strategy):
    """3 epochs of 4 steps, the rollout 2 steps long, then 3 from step 4: full and
    truncated backpropagation, on 2 processes (batch 4 each) and on 1 (batch 8)."""
    (tmp_path / "advection.py").write_text(EXPERIMENT)
    common = ["advection.py", "--epochs", "3", "--lr", "0.01", "--progress", "off"]
    for mode in ([], ["--truncate"]):
        runs = {n: tmp_path / f"{n}{'-t' if mode else ''}" for n in ("one", "two")}
        for run, extra in ((runs["one"], ["--batch-size", "8"]),
                           (runs["two"], ["--batch-size", "4", "--nprocs", "2", "--strategy",
                                          strategy])):  # fmt: skip
            done = run_cli(*common, *mode, *extra, "--run-dir", str(run), cwd=tmp_path)
            assert done.returncode == 0, done.stderr[-3000:]
        for rank in (0, 1):
            syncs = (runs["two"] / f"syncs.{rank}.txt").read_text().split()
            assert syncs == ["1"] * 12, syncs  # one reduction a step, rolled 2 or 3 steps
        one, two = (torch.load(r / "final_weights.pt", weights_only=True) for r in runs.values())
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)
            assert not torch.equal(one[key], advection_start()[key])


def advection_start() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(1, 2), nn.Conv2d(6, 2, 3, padding=1)).state_dict()

"""LR schedules on resume (dmltrain/checkpoint/schedules.py): a run extended with --epochs
goes on with the schedule its experiment builds for the new length, from the saved step,
and says so; the same schedule is restored as saved."""

import re
from pathlib import Path

import pytest
import torch
from helpers import TINY, run_cli
from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR, StepLR

from dmltrain.checkpoint import schedules
from dmltrain.checkpoint.storage import list_checkpoints, load_file
from dmltrain.errors import UserError

BUILT = {  # tiny's schedules, sized by total_steps (6 steps an epoch here)
    "cosine": lambda optimizer, total: CosineAnnealingLR(optimizer, T_max=total),
    "step": lambda optimizer, total: StepLR(optimizer, step_size=max(1, total // 3), gamma=0.1),
}


def lr_at(schedule: str, base: float, total: int, steps: int) -> float:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    scheduler = BUILT[schedule](optimizer, total)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_a_run_extended_with_epochs_goes_on_with_the_new_schedule(tmp_path, schedule):
    args = [*TINY, "--schedule", schedule, "--run-dir", str(tmp_path / "run")]
    first = run_cli(*args, "--epochs", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    per_epoch = load_file(list_checkpoints(tmp_path / "run" / "checkpoints")[0])["global_step"] // 2
    done, total = 2 * per_epoch, 3 * per_epoch
    longer = run_cli(*args, "--epochs", "3", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    said = re.search(r"the LR schedule is not the one in \S+ \((.*)\): this run goes on with the "
                     r"schedule create_scheduler built now, from its step (\d+) \(lr (\S+)\)",
                     longer.stdout)  # fmt: skip
    assert said is not None, longer.stdout
    field = {"cosine": "T_max", "step": "step_size"}[schedule]
    assert said.group(1).startswith(f"{field}: ") and int(said.group(2)) == done
    final = load_file(list_checkpoints(tmp_path / "run" / "checkpoints")[0])["scheduler"]
    base = final["base_lrs"][0]
    assert float(said.group(3)) == pytest.approx(lr_at(schedule, base, total, done), rel=1e-3)
    # the old schedule kept would have ended at its last value, or (a cosine) climbed again
    assert final["last_epoch"] == total
    assert final["_last_lr"][0] == pytest.approx(lr_at(schedule, base, total, total), abs=1e-12)
    again = run_cli(*args, "--epochs", "3", cwd=tmp_path)  # the same schedule: restored
    assert again.returncode == 0 and "LR schedule" not in again.stdout, again.stdout


def test_the_same_schedule_is_restored_as_saved():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    before = CosineAnnealingLR(optimizer, T_max=10)
    for _ in range(4):
        optimizer.step()
        before.step()
    saved = before.state_dict()
    said: list[str] = []
    after = CosineAnnealingLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), T_max=10)
    schedules.load(after, saved, Path("ckpt.pt"), said.append)
    assert after.state_dict() == saved and said == []


def test_a_schedule_too_short_for_the_saved_step_is_one_line():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    long = OneCycleLR(optimizer, 0.1, total_steps=10)
    for _ in range(8):
        optimizer.step()
        long.step()
    short = OneCycleLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), 0.1, total_steps=5)
    with pytest.raises(UserError, match=r"cannot reach step 8, where ckpt\.pt is"):
        schedules.load(short, long.state_dict(), Path("ckpt.pt"), print)


def test_reduce_lr_on_plateau_steps_on_each_validation_and_resumes_bitwise(tmp_path):
    """ReduceLROnPlateau (mode max on val_loss, which falls: no validation after the first
    improves; patience 0, factor 0.5) halves the rate after each validation from the
    second; a run stopped mid-epoch 2 (SIGUSR1) and resumed ends bitwise equal."""
    from helpers import AT_ONCE, assert_same_run, log_numbers

    args = [*TINY, "--schedule", "plateau", "--epochs", "3"]
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    rates = [row["lr"] for row in log_numbers(tmp_path / "whole")]
    assert rates == [0.001, 0.001, 0.0005], rates  # each row's rate before its validation
    stop = ["--signal-rank", "0", "--signal-at-step", "17", *AT_ONCE]  # 5 steps into epoch 2
    cut = run_cli(*args, "--run-dir", "cut", *stop, cwd=tmp_path)
    assert cut.returncode == 3, cut.stderr[-3000:]
    again = run_cli(*args, "--run-dir", "cut", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.parametrize(
    "schedule", ["one-cycle", "sequential", "chained", "lambda", "warm-restarts"]
)
def test_each_scheduler_of_the_table_resumes_mid_epoch_bitwise(tmp_path, schedule):
    """docs/long-runs.md's table of schedulers: each stepped every step, stopped in the
    middle of epoch 2 (SIGUSR1) and resumed, ends bitwise equal to the run never stopped,
    its rate changing along the way, and with no line about a changed schedule (the
    restored one is the one built)."""
    from helpers import AT_ONCE, assert_same_run, log_numbers

    args = [*TINY, "--schedule", schedule, "--epochs", "2"]
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert len({row["lr"] for row in log_numbers(tmp_path / "whole")}) == 2
    stop = ["--signal-rank", "0", "--signal-at-step", "17", *AT_ONCE]  # 5 steps into epoch 2
    cut = run_cli(*args, "--run-dir", "cut", *stop, cwd=tmp_path)
    assert cut.returncode == 3, cut.stderr[-3000:]
    again = run_cli(*args, "--run-dir", "cut", "--progress", "log", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "LR schedule is not the one" not in again.stdout + again.stderr
    assert_same_run(tmp_path / "whole", tmp_path / "cut")

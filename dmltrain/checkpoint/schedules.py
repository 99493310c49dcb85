"""LR schedulers from a checkpoint: restored as saved, or, when the experiment now builds a
different schedule (a run extended with ``--epochs``, whose ``create_scheduler`` sizes it by
``self.total_steps``), the new schedule taken from the saved position.

Restoring the saved state of a schedule sized for the old length would go on with the old
one: a cosine built for 150 steps and trained past them climbs back up, a OneCycleLR
stops the run once stepped past its total. The schedule the experiment built for this run
is kept instead, and stepped as many times as the saved one was (a replay: exact for every
scheduler whose learning rate follows from its step count, whatever its formula); one line
says what changed. ``ReduceLROnPlateau``, whose learning rate follows the validation
metric, is always restored as saved.
"""

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from dmltrain.errors import UserError

# a scheduler's state that says where it is, not what the schedule is (T_cur and T_i:
# CosineAnnealingWarmRestarts' place in its cycle and the cycle's length)
POSITION = frozenset(
    {
        "last_epoch",
        "_step_count",
        "_last_lr",
        "_get_lr_called_within_step",
        "_is_initial",
        "T_cur",
        "T_i",
    }
)


def shape(state: Any) -> Any:
    """A scheduler's state without its position (nested schedulers' too)."""
    if isinstance(state, dict):
        return {k: shape(v) for k, v in state.items() if k not in POSITION and k != "verbose"}
    if isinstance(state, (list, tuple)):
        return [shape(v) for v in state]
    return state


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """``name: old -> new`` for each value that differs between two shapes."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{where}.{key}" if where else str(key)
            found += differences(old.get(key), new.get(key), name)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        found = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            found += differences(a, b, f"{where}[{i}]")
        return found
    return [] if old == new else [f"{where or 'state'}: {old} -> {new}"]


def load(
    scheduler: Any, saved: dict[str, Any], path: Path | str, say: Callable[[str], None]
) -> None:
    """``saved`` into ``scheduler``, or the scheduler replayed to the saved position when the
    experiment built a different schedule (see the module's docstring)."""
    fresh = scheduler.state_dict()
    follows_steps = isinstance(scheduler, LRScheduler) and not isinstance(
        scheduler, ReduceLROnPlateau
    )  # a subclass since torch 2.2: its rate follows the metric, its state is its position
    if not follows_steps or shape(fresh) == shape(saved):
        scheduler.load_state_dict(saved)
        return
    steps = int(saved["last_epoch"])
    found = differences(shape(saved), shape(fresh))
    public = [d for d in found if not d.rpartition(".")[2].startswith("_")]  # T_max, not _phases
    changed = "; ".join((public or found)[:3])
    replay(scheduler, fresh, steps, path)
    lrs = ", ".join(f"{lr:.4g}" for lr in scheduler.get_last_lr())
    say(
        f"dmltrain: the LR schedule is not the one in {_name(path)} ({changed}): this run goes "
        f"on with the schedule create_scheduler built now, from its step {steps} (lr {lrs})"
    )


def replay(scheduler: LRScheduler, fresh: dict[str, Any], steps: int, path: Path | str) -> None:
    """``scheduler`` from its start (``fresh``: its state as built) stepped ``steps`` times."""
    scheduler.load_state_dict(fresh)
    for group, lr in zip(scheduler.optimizer.param_groups, fresh["_last_lr"], strict=True):
        group["lr"] = lr  # the optimizer's state, loaded before, holds the old schedule's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "step() before optimizer.step()": no update here
        try:
            for _ in range(steps):
                scheduler.step()
        except (ValueError, ZeroDivisionError) as exc:
            raise UserError(
                f"the LR schedule create_scheduler built cannot reach step {steps}, where "
                f"{_name(path)} is ({exc}); build it for at least as many steps, or start anew "
                "with --load-weights"
            ) from None


def _name(location: Path | str) -> str:
    """A checkpoint's file name, of a path or a URI."""
    return str(location).rsplit("/", 1)[-1]

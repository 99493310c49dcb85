"""``Checkpointer``: when a run saves, what a checkpoint holds, and how a run comes back.

It saves at a step boundary when one is due (every N steps or M minutes, on preemption),
at the end of every epoch, and restores (``--resume``, ``--load-weights``, a rollback
after a NaN). The files themselves are ``dmltrain.checkpoint``'s business.

A checkpoint holds: model and optimizer (keyed by parameter name, ``model_state``), LR
scheduler, precision (grad scaler), the ``TrainState`` (epoch, steps, best value, tracking
run id, training log), and per rank the RNG states and the partial epoch's metric sums;
also the resolved config, the world size and a format version. The data order needs
nothing more: it is a function of seed, epoch and the steps already done.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmltrain.checkpoint import (
    CheckpointDir,
    WriteFailed,
    list_checkpoints,
    load_file,
    load_latest_valid,
    load_sharded,
    sharded_shapes,
)
from dmltrain.config import CheckpointConfig
from dmltrain.distributed import Strategy, unwrap
from dmltrain.errors import UserError
from dmltrain.model_state import (
    check_model_fits,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    shapes_of,
)
from dmltrain.precision import Precision
from dmltrain.rng import rng_state, set_rng_state
from dmltrain.state import TrainState


def _dcp() -> Any:
    """torch.distributed.checkpoint.state_dict, imported when first needed (FSDP, sharded
    checkpoints): importing it takes 0.8 s and some 45 MiB."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


@dataclass(frozen=True)
class Saved:
    """The stateful objects a checkpoint holds (besides every rank's RNG states)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler or None
    precision: Precision
    state: TrainState


class Checkpointer:
    """Saves ``saved`` into ``directory`` and restores it; ``run_config`` (the resolved
    config as plain values) goes into every checkpoint and is checked on resume."""

    def __init__(
        self,
        config: CheckpointConfig,
        directory: Path,
        saved: Saved,
        strategy: Strategy,
        run_config: dict[str, Any],
        say: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.config, self.saved, self.strategy = config, saved, strategy
        self.dist = strategy.info
        self.run_config, self.say, self.warn = run_config, say, warn
        self.files = CheckpointDir(directory, config.keep_last, config.async_checkpoint)
        fmt = config.checkpoint_format
        self.sharded = fmt == "sharded" or (fmt == "auto" and strategy.name == "fsdp")
        if self.sharded and strategy.name == "horovod":
            raise UserError(
                "--checkpoint-format sharded needs torch.distributed (ddp or fsdp); "
                "use --checkpoint-format full with horovod"
            )
        self.last_save = time.monotonic()

    # ----- when -------------------------------------------------------------------------
    def minutes_due(self) -> bool:
        """Whether --checkpoint-every-minutes has passed on this rank since the last save
        (the ranks agree on it before ``maybe_save``)."""
        minutes = self.config.checkpoint_every_minutes
        return bool(minutes) and time.monotonic() - self.last_save >= 60 * minutes

    def maybe_save(
        self,
        *,
        epoch_end: bool = False,
        best: bool = False,
        minutes: bool = False,
        stopping: bool = False,
        last: bool = False,
    ) -> None:
        """At a step boundary or an epoch's end (every rank, the same arguments): save
        when due. ``minutes``: the ranks agreed a timed save is due; ``stopping``: the
        run stops after this (preemption, the job's epochs done) and ``last``: the run is
        done; both mean the checkpoint must be written."""
        every = self.config.checkpoint_every_steps
        steps = bool(every) and self.saved.state.global_step % every == 0
        if epoch_end or steps or minutes or stopping:
            self.save(best=best, must=stopping or last)

    # ----- saving -------------------------------------------------------------------------
    def save(self, best: bool, must: bool = False) -> None:
        """Collective: every rank contributes; rank 0 writes (every rank, when sharded).

        A checkpoint that cannot be written (a full disk) is one warning line, and the
        next one is tried as usual; unless it ``must`` be written: then every rank stops
        with that line."""
        saved, strategy, main = self.saved, self.strategy, self.dist.is_main
        state = saved.state
        if main:
            try:
                self.files.wait()  # an earlier background write's failure, reported here
            except WriteFailed as exc:
                self.warn(f"{exc}; training goes on")
        # An optimizer that has not stepped yet has no state; get_state_dict creates it with
        # a zero step (Adam's step count moves), which is undone after the save.
        fresh = not saved.optimizer.state
        partial = state.metrics.state_dict() if state.step_in_epoch else None
        ranks = strategy.all_gather_object({"rng": rng_state(), "metrics": partial})
        meta = None
        if main:
            meta = {
                "scheduler": None if saved.scheduler is None else saved.scheduler.state_dict(),
                "scaler": saved.precision.state_dict(),
                **state.state_dict(),
                "epoch_metrics": [r["metrics"] for r in ranks],
                "rng": [r["rng"] for r in ranks],
                "world_size": self.dist.world_size,
                "config": self.run_config,
                "optimizer_fresh": fresh,
            }
        epoch = state.epoch + (state.step_in_epoch > 0)
        failed = None
        if self.sharded:
            model_state, optim_state = _dcp().get_state_dict(saved.model, saved.optimizer)
            shards = {"model": model_state, "optimizer": optim_state}
            self.files.save_sharded(shards, meta, epoch, state.global_step, best, strategy.barrier)
        else:
            if strategy.name == "fsdp":
                options = _dcp().StateDictOptions(full_state_dict=True, cpu_offload=True)
                model_state, optim_state = _dcp().get_state_dict(
                    saved.model, saved.optimizer, options=options
                )
            elif main:  # the same format, without torch.distributed.checkpoint
                model = unwrap(saved.model)
                model_state = model.state_dict()
                optim_state = optimizer_state_by_name(model, saved.optimizer)
            if meta is not None:
                full = {"model": model_state, "optimizer": optim_state, **meta}
                try:
                    self.files.save(full, epoch, state.global_step, best, wait=must)
                except WriteFailed as exc:
                    failed = str(exc)
            failed = strategy.broadcast_object(failed)  # also: every rank waits for rank 0
        if fresh:
            saved.optimizer.state.clear()
        self.last_save = time.monotonic()
        if failed is not None:
            if must:
                raise WriteFailed(failed)
            if main:
                self.warn(f"{failed}; training goes on and tries again at the next checkpoint")

    def wait(self) -> None:
        """Block until a background write is on disk (rank 0)."""
        if self.dist.is_main:
            self.files.wait()

    def close(self) -> None:
        """``wait``, as the run ends whichever way: a failed write is a warning."""
        try:
            self.wait()
        except WriteFailed as exc:
            self.warn(str(exc))

    def newest(self) -> Path | None:
        """The newest checkpoint file of this run, if any."""
        found = list_checkpoints(self.files.directory)
        return found[0] if found else None

    # ----- restoring ----------------------------------------------------------------------
    def restore(self) -> None:
        """Resume (``--resume``: auto, never or a path) or start from other weights
        (``--load-weights``, with what the --load-* flags ask for)."""
        cfg = self.config
        resume, load_weights = cfg.resume, cfg.load_weights
        choice: str | None = None
        if self.dist.is_main:
            if resume == "auto":
                choice = self._latest()
            elif resume != "never":
                choice = resume
        choice = self.strategy.broadcast_object(choice)
        if choice is not None:
            path = Path(choice)
            state = load_file(path)
            self._check_resumable(state, path)
            self._load(state, path, optimizer=True, scheduler=True, scaler=True, counters=True)
            s = self.saved.state
            self.say(
                f"dmltrain: resuming from {choice} (epoch {s.epoch + 1}, "
                f"{s.step_in_epoch} steps into it, global step {s.global_step})"
            )
        elif load_weights:
            path = Path(load_weights)
            self._load(
                load_file(path),
                path,
                cfg.load_optimizer,
                cfg.load_scheduler,
                cfg.load_scaler,
                cfg.load_epoch,
            )
            self.say(f"dmltrain: weights loaded from {load_weights}")

    def rollback(self, epoch: int, step: int) -> None:
        """Every rank reloads the newest valid checkpoint of this run and will skip the
        (1-based) ``epoch``'s ``step``, the one that was not finite (``--on-nan rollback``)."""
        self.wait()
        choice = self.strategy.broadcast_object(self._latest() if self.dist.is_main else None)
        if choice is None:
            raise UserError(
                f"--on-nan rollback: no checkpoint in {self.files.directory} to roll back to"
            )
        path = Path(choice)
        self._load(load_file(path), path, True, True, True, True)
        self.saved.state.skip_steps.add((epoch, step))
        self.say(f"dmltrain: rolled back to {path}; epoch {epoch} step {step} will be skipped")

    def _latest(self) -> str | None:
        """The newest checkpoint of this run that loads (rank 0 looks; corrupt ones are
        reported and skipped)."""
        found = load_latest_valid(self.files.directory, self.warn)
        return None if found is None else str(found[0])

    def _check_resumable(self, state: dict[str, Any], path: Path) -> None:
        """Batch size, seed and world size fix the data order: they must match. Other
        changed settings are listed in a warning."""
        saved, now = state["config"], self.run_config
        before = {**saved["train"], "world size": state["world_size"]}
        current = {**now["train"], "world size": self.dist.world_size}
        for key in ("batch_size", "seed", "world size", "grad_accum"):
            if key in before and before.get(key) != current.get(key):
                raise UserError(
                    f"cannot resume from {path}: {key} is {current.get(key)!r} now but was "
                    f"{before.get(key)!r}; use the same value, or start a new run "
                    "(--resume never with a new --run-dir)"
                )
        changed = [
            f"{k}: {saved['options'].get(k)!r} -> {v!r}"
            for k, v in now["options"].items()
            if saved["options"].get(k) != v
        ]
        if changed and self.dist.is_main:
            self.warn(f"resuming {path} with changed options: {', '.join(changed)}")

    def _load(
        self,
        state: dict[str, Any],
        path: Path,
        optimizer: bool,
        scheduler: bool,
        scaler: bool,
        counters: bool,
    ) -> None:
        saved, dcp = self.saved, _dcp
        # loading may take a zero step (see save); set_to_none is the default, and Horovod's
        # optimizer takes no arguments
        saved.optimizer.zero_grad()
        model = unwrap(saved.model)
        own = shapes_of(model.state_dict())
        if state.get("sharded"):
            check_model_fits(own, sharded_shapes(path), path)
            model_state, optim_state = dcp().get_state_dict(saved.model, saved.optimizer)
            shards: dict[str, Any] = {"model": model_state}
            if optimizer:
                shards["optimizer"] = optim_state
            load_sharded(path, shards)
            if optimizer:
                dcp().set_state_dict(
                    saved.model,
                    saved.optimizer,
                    model_state_dict=shards["model"],
                    optim_state_dict=shards["optimizer"],
                )
            else:
                dcp().set_model_state_dict(saved.model, shards["model"])
        elif self.strategy.name != "fsdp":
            check_model_fits(own, shapes_of(state["model"]), path)
            model.load_state_dict(state["model"])
            if optimizer:
                load_optimizer_state_by_name(model, saved.optimizer, state["optimizer"], path)
        else:
            check_model_fits(own, shapes_of(state["model"]), path)
            options = dcp().StateDictOptions(full_state_dict=True, strict=True)
            dcp().set_model_state_dict(saved.model, state["model"], options=options)
            if optimizer:
                dcp().set_optimizer_state_dict(
                    saved.model, saved.optimizer, state["optimizer"], options=options
                )
        if optimizer and state.get("optimizer_fresh"):
            saved.optimizer.state.clear()  # saved before its first step: keep it fresh
        if scheduler and saved.scheduler is not None and state["scheduler"] is not None:
            saved.scheduler.load_state_dict(state["scheduler"])
        if scaler:
            saved.precision.load_state_dict(state.get("scaler"))
        if counters:
            rank = self.dist.rank
            saved.state.load_state_dict(state, state["epoch_metrics"][rank])
            if "rng" in state and len(state["rng"]) == self.dist.world_size:
                set_rng_state(state["rng"][rank])

"""What a checkpoint of a run holds, and how a run comes back from one.

``Checkpointer`` is the trainer's part that saves (every epoch, every N steps or minutes,
on preemption, at the end) and restores (``--resume``, ``--load-weights``). The files
themselves are ``dmltrain.checkpoint``'s business.

A checkpoint holds: model (no wrapper prefixes), optimizer, LR scheduler, grad scaler,
epoch, global step, steps done in the epoch in progress and its partial metric sums
(per rank), RNG states of every rank, the resolved config, the training log so far, the
best metric value, the tracking run id, the world size and a format version. The data
order needs nothing more: it is a function of seed, epoch and the steps already done.
"""

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dmltrain.checkpoint import (
    CheckpointDir,
    WriteFailed,
    check_model_fits,
    load_file,
    load_latest_valid,
    load_optimizer_state_by_name,
    load_sharded,
    optimizer_state_by_name,
    rng_state,
    set_rng_state,
    shapes_of,
    sharded_shapes,
    strip_prefixes,
)
from dmltrain.errors import UserError


def _dcp() -> Any:
    """torch.distributed.checkpoint.state_dict, imported when first needed (FSDP, sharded
    checkpoints): importing it takes 0.8 s and some 45 MiB."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


if TYPE_CHECKING:
    from dmltrain.trainer import BaseTrainer


class Checkpointer:
    """Saves and restores the state of ``trainer`` (model, optimizer, counters, ...)."""

    def __init__(self, trainer: "BaseTrainer", directory: Path) -> None:
        self.trainer = trainer
        config = trainer.config
        self.files = CheckpointDir(directory, config.keep_last, config.async_checkpoint)
        fmt = config.checkpoint_format
        self.sharded = fmt == "sharded" or (fmt == "auto" and trainer.strategy.name == "fsdp")
        if self.sharded and trainer.strategy.name == "horovod":
            raise UserError(
                "--checkpoint-format sharded needs torch.distributed (ddp or fsdp); "
                "use --checkpoint-format full with horovod"
            )
        self.last_save = time.monotonic()

    # ----- saving -------------------------------------------------------------------------
    def save(self, best: bool, wait: bool = False, must: bool = False) -> None:
        """Collective: every rank contributes; rank 0 writes (every rank, when sharded).

        A checkpoint that cannot be written (a full disk) is one warning line, and the
        next one is tried as usual; unless it ``must`` be written (preemption, the end of
        the run or job): then every rank stops with that line."""
        t = self.trainer
        failed = None
        if t.dist.is_main:
            try:
                self.files.wait()  # an earlier background write's failure, reported here
            except WriteFailed as exc:
                t.warn(f"{exc}; training goes on")
        # Per rank: RNG streams and the partial epoch's metric sums.
        # An optimizer that has not stepped yet has no state; get_state_dict creates it with
        # a zero step (Adam's step count moves), which is undone after the save.
        fresh = not t.optimizer.state
        rng = t.strategy.all_gather_object(rng_state())
        epoch_metrics = t.strategy.all_gather_object(t.epoch_metrics)
        meta = None
        if t.dist.is_main:
            meta = {
                "scheduler": None if t.scheduler is None else t.scheduler.state_dict(),
                "scaler": t.precision.state_dict(),
                "epoch": t.epoch,
                "step_in_epoch": t.step_in_epoch,
                "global_step": t.global_step,
                "epoch_metrics": epoch_metrics,
                "rng": rng,
                "world_size": t.dist.world_size,
                "config": config_dict(t),
                "training_log": t.training_log.rows,
                "best_value": t.best_value,
                "tracking_run_id": t.tracking_run_id,
                "skip_steps": sorted(t.skip_steps),
                "optimizer_fresh": fresh,
            }
        epoch = t.epoch + (t.step_in_epoch > 0)
        if self.sharded:
            model_state, optim_state = _dcp().get_state_dict(t.model, t.optimizer)
            shards = {"model": model_state, "optimizer": optim_state}
            self.files.save_sharded(shards, meta, epoch, t.global_step, best, t.strategy.barrier)
        else:
            if t.strategy.name == "fsdp":
                options = _dcp().StateDictOptions(full_state_dict=True, cpu_offload=True)
                model_state, optim_state = _dcp().get_state_dict(
                    t.model, t.optimizer, options=options
                )
                model_state = strip_prefixes(model_state)
            elif meta is not None:  # the same format, without torch.distributed.checkpoint
                model = t.strategy.eval_model(t.model)
                model_state = strip_prefixes(model.state_dict())
                optim_state = optimizer_state_by_name(model, t.optimizer)
            if meta is not None:
                state = {"model": model_state, "optimizer": optim_state, **meta}
                try:
                    self.files.save(state, epoch, t.global_step, best, wait=wait or must)
                except WriteFailed as exc:
                    failed = str(exc)
            failed = t.strategy.broadcast_object(failed)  # also: every rank waits for rank 0
        if fresh:
            t.optimizer.state.clear()
        self.last_save = time.monotonic()
        if failed is not None:
            if must:
                raise WriteFailed(failed)
            if t.dist.is_main:
                t.warn(f"{failed}; training goes on and tries again at the next checkpoint")

    def wait(self) -> None:
        """Block until a background write is on disk (rank 0)."""
        self.files.wait()

    # ----- restoring ----------------------------------------------------------------------
    def restore(self) -> None:
        """Resume (``--resume``) or start from other weights (``--load-weights``)."""
        t, cfg = self.trainer, self.trainer.config
        choice: str | None = None
        if t.dist.is_main:
            if cfg.resume == "auto":
                choice = self._latest()
            elif cfg.resume != "never":
                choice = cfg.resume
        choice = t.strategy.broadcast_object(choice)
        if choice is not None:
            path = Path(choice)
            state = load_file(path)
            self._check_resumable(state, path)
            self._load(state, path, optimizer=True, scheduler=True, scaler=True, counters=True)
            t.progress.info(
                f"dmltrain: resuming from {choice} (epoch {t.epoch + 1}, "
                f"{t.step_in_epoch} steps into it, global step {t.global_step})"
            )
        elif cfg.load_weights:
            path = Path(cfg.load_weights)
            self._load(
                load_file(path),
                path,
                cfg.load_optimizer,
                cfg.load_scheduler,
                cfg.load_scaler,
                cfg.load_epoch,
            )
            t.progress.info(f"dmltrain: weights loaded from {cfg.load_weights}")

    def rollback(self) -> Path:
        """Every rank reloads the newest valid checkpoint of this run (after a NaN)."""
        t = self.trainer
        choice = t.strategy.broadcast_object(self._latest() if t.dist.is_main else None)
        if choice is None:
            raise UserError(
                f"--on-nan rollback: no checkpoint in {self.files.directory} to roll back to"
            )
        path = Path(choice)
        self._load(load_file(path), path, True, True, True, True)
        return path

    def _latest(self) -> str | None:
        """The newest checkpoint of this run that loads (rank 0 looks; corrupt ones are
        reported and skipped)."""
        found = load_latest_valid(self.files.directory, self.trainer.warn)
        return None if found is None else str(found[0])

    def _check_resumable(self, state: dict[str, Any], path: Path) -> None:
        """Batch size, seed and world size fix the data order: they must match. Other
        changed settings are listed in a warning."""
        t = self.trainer
        saved, now = state["config"], config_dict(t)
        before = {**saved["train"], "world size": state["world_size"]}
        current = {**now["train"], "world size": t.dist.world_size}
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
        if changed and t.dist.is_main:
            t.warn(f"resuming {path} with changed options: {', '.join(changed)}")

    def _load(
        self,
        state: dict[str, Any],
        path: Path,
        optimizer: bool,
        scheduler: bool,
        scaler: bool,
        counters: bool,
    ) -> None:
        t = self.trainer
        # loading may take a zero step (see save); set_to_none is the default, and Horovod's
        # optimizer takes no arguments
        t.optimizer.zero_grad()
        own = shapes_of(strip_prefixes(t.strategy.eval_model(t.model).state_dict()))
        if state.get("sharded"):
            check_model_fits(own, sharded_shapes(path), path)
            model_state, optim_state = _dcp().get_state_dict(t.model, t.optimizer)
            shards: dict[str, Any] = {"model": model_state}
            if optimizer:
                shards["optimizer"] = optim_state
            load_sharded(path, shards)
            if optimizer:
                _dcp().set_state_dict(
                    t.model,
                    t.optimizer,
                    model_state_dict=shards["model"],
                    optim_state_dict=shards["optimizer"],
                )
            else:
                _dcp().set_model_state_dict(t.model, shards["model"])
        elif t.strategy.name != "fsdp":
            check_model_fits(own, shapes_of(state["model"]), path)
            model = t.strategy.eval_model(t.model)
            getattr(model, "_orig_mod", model).load_state_dict(state["model"])
            if optimizer:
                load_optimizer_state_by_name(model, t.optimizer, state["optimizer"], path)
        else:
            check_model_fits(own, shapes_of(state["model"]), path)
            options = _dcp().StateDictOptions(full_state_dict=True, strict=True)
            _dcp().set_model_state_dict(t.model, state["model"], options=options)
            if optimizer:
                _dcp().set_optimizer_state_dict(
                    t.model, t.optimizer, state["optimizer"], options=options
                )
        if optimizer and state.get("optimizer_fresh"):
            t.optimizer.state.clear()  # saved before its first step: keep it fresh
        if scheduler and t.scheduler is not None and state["scheduler"] is not None:
            t.scheduler.load_state_dict(state["scheduler"])
        if scaler:
            t.precision.load_state_dict(state.get("scaler"))
        if counters:
            t.skip_steps = {tuple(s) for s in state.get("skip_steps", [])}
            t.epoch, t.step_in_epoch = state["epoch"], state["step_in_epoch"]
            t.global_step = state["global_step"]
            t.epoch_metrics = state["epoch_metrics"][t.dist.rank]
            t.best_value = state.get("best_value")
            t.tracking_run_id = state.get("tracking_run_id")
            t.training_log.rows = list(state["training_log"])
            if "rng" in state and len(state["rng"]) == t.dist.world_size:
                set_rng_state(state["rng"][t.dist.rank])


def config_dict(trainer: "BaseTrainer") -> dict[str, Any]:
    """The resolved config as plain values: training settings and experiment options."""
    options = {}
    if dataclasses.is_dataclass(trainer.options) and not isinstance(trainer.options, type):
        options = dataclasses.asdict(trainer.options)
    return {"train": dataclasses.asdict(trainer.config), "options": options}

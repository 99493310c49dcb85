"""``Checkpointer``: when a run saves, what a checkpoint holds, and how a run comes back.

It saves at a step boundary when one is due (every N steps or M minutes, on preemption),
at the end of every epoch, and restores (``--resume``, ``--load-weights``, a rollback
after a NaN). The files themselves are ``dmltrain.checkpoint.storage``'s business.

A checkpoint holds: model and optimizer (keyed by parameter name, ``model_state``), LR
scheduler, precision (grad scaler), the ``TrainState`` (epoch, steps, best value, tracking
run id, training log), and per rank the RNG states and the partial epoch's metric sums;
the callbacks' and the experiment's states (``dmltrain.callback``); also the resolved
config, the world size and a format version. The data order needs nothing more: it is a
function of seed, epoch and the steps already done.
"""

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dmltrain.checkpoint import pretrained, schedules
from dmltrain.checkpoint.handout import hand_out
from dmltrain.checkpoint.objects import is_uri
from dmltrain.checkpoint.stateful import ModelShaped, Positioned, Stateful
from dmltrain.checkpoint.storage import CheckpointStore, WriteFailed
from dmltrain.config import CheckpointConfig
from dmltrain.data.rng import rng_state, seed_everything, set_rng_state
from dmltrain.data.samples import sample_seed
from dmltrain.errors import SharedError, UserError
from dmltrain.runtime.model_state import check_model_fits, dcp, dcp_optimizers, shapes_of
from dmltrain.runtime.strategies import Strategy, unwrap

# an optimizer's settings of how its update runs, not of what it computes
_EXECUTION = frozenset({"foreach", "fused", "capturable", "differentiable"})
# Settings whose change a resume handles itself (the global batch, _resized) or that
# name where the run is, not how it trains.
_RESUME_OWN = frozenset(
    {"resume", "run_dir", "nprocs", "batch_size", "global_batch_size", "grad_accum",
     "num_workers", "launcher", "status_file", "allow_global_batch_change"}
)  # fmt: skip


def _global_batch(train: dict[str, Any], world_size: int) -> int:
    """Samples per optimizer step over all processes, from a config's "train" dict."""
    return int(train["batch_size"]) * int(train.get("grad_accum", 1)) * world_size


_LOADABLE = (torch.Tensor, int, float, str, bytes, bool, type(None), torch.Size)


def _execution(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings of how its update runs (``_EXECUTION``)."""
    return {key: group[key] for key in _EXECUTION if key in group}


def _check_loadable(value: Any, where: str) -> None:
    """A state that ``torch.load(weights_only=True)`` reads back: tensors, numbers,
    strings and containers of them; anything else would make the checkpoint unloadable."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_loadable(key, where)
            _check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set)):
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]")
    elif not isinstance(value, _LOADABLE):
        raise UserError(
            f"the state {where} is a {_type_name(value)}, which a checkpoint cannot hold "
            f"(it would not load): {_instead(value)}from state_dict() return tensors, "
            "numbers, strings, and lists, tuples or dicts of those"
        )


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _instead(value: Any) -> str:
    """What to store instead of a numpy value, the usual culprit."""
    if type(value).__module__ == "numpy":
        return "convert numpy values (int(x), float(x), torch.from_numpy(a)); "
    return ""


def _schedulers_state(schedulers: tuple[Any, ...]) -> Any:
    """A checkpoint's "scheduler": None, one scheduler's state, or a list of them."""
    if not schedulers:
        return None
    if len(schedulers) == 1:
        return schedulers[0].state_dict()
    return [scheduler.state_dict() for scheduler in schedulers]


def _load_schedulers(
    schedulers: tuple[Any, ...], saved: Any, path: str, say: Callable[[str], None]
) -> None:
    """The inverse of ``_schedulers_state`` (a checkpoint's schedulers into these, or
    these replayed to the saved position: ``schedules``)."""
    states = saved if isinstance(saved, list) else [saved]
    if len(states) != len(schedulers):
        if not schedulers:
            return  # as before: a run without a scheduler ignores a saved one
        raise UserError(
            f"{path} holds {len(states)} LR scheduler state(s) but this run has "
            f"{len(schedulers)}; use --load-weights without --load-scheduler"
        )
    for scheduler, state in zip(schedulers, states, strict=True):
        schedules.load(scheduler, state, path, say)


class RunState(Protocol):
    """Where the run is (``engine.state.TrainState``), as a checkpoint saves and loads it."""

    epoch: int
    step_in_epoch: int
    global_step: int
    skip_steps: set[tuple[int, int]]
    world_size_changes: list[dict[str, Any]]

    @property
    def metrics(self) -> Stateful: ...  # this rank's sums of the epoch so far

    def state_dict(self) -> dict[str, Any]: ...

    def load_ranks(
        self, state: dict[str, Any], per_rank: list[dict[str, Any] | None], rank: int, same: bool
    ) -> None: ...


@dataclass(frozen=True)
class Saved:
    """The stateful objects a checkpoint holds (besides every rank's RNG states)."""

    model: nn.Module
    optimizers: tuple[Any, ...]  # create_optimizer's, wrapped by the strategy
    schedulers: tuple[Any, ...]  # create_scheduler's, none or one for each optimizer
    precision: Stateful  # the grad scaler's
    state: RunState
    # callbacks' and the experiment's (dmltrain.callback.states), by key
    states: Mapping[str, Stateful] = field(default_factory=dict)
    feed: Positioned | None = None  # a training stream's place on each rank
    # model-shaped states by key ("ema": the averaged weights of --ema-decay)
    shaped: Mapping[str, ModelShaped] = field(default_factory=dict)
    # the model's weights checkpoints leave out: LoRA's frozen base, saved once at the start
    # (dmltrain.engine.finetuning)
    base: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Parts:
    """What a load takes from a checkpoint besides the model's weights."""

    optimizer: bool = True
    scheduler: bool = True
    scaler: bool = True
    run: bool = True  # where the run is: counters, metrics, shaped and callbacks' states, RNG


EVERYTHING = Parts()  # a resume, a rollback


class Checkpointer:
    """Saves ``saved`` into ``store`` and restores it; ``run_config`` (the resolved config
    as plain values) goes into every checkpoint and is checked on resume."""

    def __init__(
        self,
        config: CheckpointConfig,
        store: CheckpointStore,
        saved: Saved,
        strategy: Strategy,
        run_config: dict[str, Any],
        say: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.config, self.saved, self.strategy = config, saved, strategy
        self.dist = strategy.info
        self.run_config, self.say, self.warn = run_config, say, warn
        self.store = store
        fmt = config.checkpoint_format
        self.sharded = fmt == "sharded" or (fmt == "auto" and strategy.shards_checkpoints)
        problem = strategy.sharded_checkpoints_problem() if self.sharded else None
        if problem is None and self.sharded:
            problem = store.shards_problem()
        if problem is not None:
            raise UserError(problem)
        self.last_save = time.monotonic()
        self.written = 0  # checkpoints this job saved (the batch scripts' --status-file)
        # the callbacks' on_save_checkpoint and on_load_checkpoint (the trainer sets them)
        self.before_save: Callable[[], None] = lambda: None
        self.loaded: Callable[[Path | str], None] = lambda path: None

    # ----- when -------------------------------------------------------------------------
    def minutes_due(self) -> bool:
        """Whether --checkpoint-every-minutes has passed on this rank since the last save
        (the ranks agree on it before ``save_when_due``)."""
        minutes = self.config.checkpoint_every_minutes
        return bool(minutes) and time.monotonic() - self.last_save >= 60 * minutes

    def save_when_due(self, timed: bool, stopping: bool) -> None:
        """At a step boundary (every rank, the same arguments): save when
        --checkpoint-every-steps says so, when the ranks agreed a timed save is due
        (``timed``), or when the run stops after this step (``stopping``: then the
        checkpoint must be written)."""
        every = self.config.checkpoint_every_steps
        if (every and self.saved.state.global_step % every == 0) or timed or stopping:
            self.save(best=False, must=stopping)

    # ----- saving -------------------------------------------------------------------------
    # around each save: the hang watchdog's pause (a save may take minutes)
    quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def save(self, best: bool, must: bool = False) -> None:
        """Collective: every rank contributes; rank 0 writes (every rank, when sharded).

        A checkpoint that cannot be written (a full disk) is one warning line, and the
        next one is tried as usual; unless it ``must`` be written: then every rank stops
        with that line."""
        with self.quiet():
            self.before_save()
            self._save(best, must)

    def _save(self, best: bool, must: bool) -> None:
        saved, strategy, main = self.saved, self.strategy, self.dist.is_main
        state = saved.state
        if main or self.sharded:  # every rank writes its shards
            try:
                self.store.wait()  # an earlier background write's failure, reported here
            except WriteFailed as exc:
                if main:
                    self.warn(f"{exc}; training goes on")
        # An optimizer that has not stepped yet has no state; get_state_dict creates it with
        # a zero step (Adam's step count moves), which is undone after the save.
        fresh = not any(optimizer.state for optimizer in saved.optimizers)
        partial = state.metrics.state_dict() if state.step_in_epoch else None
        position = None if saved.feed is None else saved.feed.position()
        if position is not None and "loader" in position:  # a stream loader's state_dict
            _check_loadable(position["loader"], "of the training stream's loader")
        kept = {key: item.state_dict() for key, item in saved.states.items()}  # every rank
        ranks = strategy.gather_object(
            {"rng": rng_state(), "metrics": partial, "data": position, "states": kept}
        )
        # Whole in a full checkpoint (under FSDP every rank takes part in gathering it, rank
        # 0 keeps it); every rank's own shards in a sharded one, with the model's.
        whole = {}  # model-shaped states; in a sharded checkpoint they go with the shards
        if not self.sharded:
            whole = {key: item.state_dict(keep=main) for key, item in saved.shaped.items()}
        if main:
            for key, value in kept.items():
                _check_loadable(value, key)
        meta = None
        if ranks is not None:  # rank 0
            kept, own = split_states([r["states"] for r in ranks])
            positions = [r["data"] for r in ranks]
            meta = {
                "scheduler": _schedulers_state(saved.schedulers),
                "scaler": saved.precision.state_dict(),
                **state.state_dict(),
                "epoch_metrics": [r["metrics"] for r in ranks],
                "rng": [r["rng"] for r in ranks],
                **({"data": positions} if any(p is not None for p in positions) else {}),
                "world_size": self.dist.world_size,
                **whole,
                **{f"{key}_sharded": True for key in saved.shaped if self.sharded},
                **({"states": kept} if kept else {}),
                **({"rank_states": own} if own else {}),
                "config": self.run_config,
                "optimizer_fresh": fresh,
            }
        epoch = state.epoch + (state.step_in_epoch > 0)
        failed = None
        if self.sharded:
            model_state, optim_state = dcp().get_state_dict(
                saved.model, dcp_optimizers(saved.optimizers)
            )
            shards = {"model": _without(model_state, saved.base), "optimizer": optim_state}
            for key, item in saved.shaped.items():
                shards[key] = item.shards()
            background = self.store.asynchronous and not must  # the last one is waited for
            group = strategy.background_group() if background else None
            try:  # a failure is every rank's alike (torch.distributed.checkpoint gathers it)
                self.store.save_sharded(
                    shards, meta, epoch, state.global_step, best, strategy.barrier, background,
                    group,
                )  # fmt: skip
            except WriteFailed as exc:
                same = self.store.holds(epoch, state.global_step, sharded=True)
                failed, must = str(exc), must and not same
        else:
            model_state, optim_state = strategy.full_state(saved.model, saved.optimizers, main)
            if meta is not None:
                model_state = _without(model_state, saved.base)
                full = {"model": model_state, "optimizer": optim_state, **meta}
                try:
                    self.store.save(full, epoch, state.global_step, best, wait=must)
                except WriteFailed as exc:
                    # the step's own checkpoint, written before its epoch's end, stands: a
                    # resume from it does that end again (the rewrite added only that)
                    same = self.store.holds(epoch, state.global_step, sharded=False)
                    failed, must = str(exc), must and not same
            failed, must = strategy.broadcast_object((failed, must))  # every rank waits too
        if fresh:
            for optimizer in saved.optimizers:
                optimizer.state.clear()
        self.last_save = time.monotonic()
        if failed is not None:
            if must:  # every rank stops, with rank 0's line
                raise SharedError(failed)
            if main:
                self.warn(f"{failed}; training goes on and tries again at the next checkpoint")
        else:
            self.written += 1

    def wait(self) -> None:
        """Block until a background write is on disk (rank 0; every rank when sharded)."""
        if self.dist.is_main or self.sharded:
            self.store.wait()

    def close(self, failed: bool = False) -> None:
        """``wait``, as the run ends whichever way: a failed write is a warning. After a
        failure (a lost peer) a sharded save in flight is left as it is: its collectives
        may wait for a rank that is gone, and an unpublished save is cleared at the next;
        the previous checkpoint stands."""
        if failed and self.sharded:
            return
        try:
            self.wait()
        except WriteFailed as exc:
            self.warn(str(exc))

    def newest(self) -> str | None:
        """The newest checkpoint of this run, if any."""
        return self.store.newest()

    # ----- restoring ----------------------------------------------------------------------
    def restore(self) -> None:
        """Resume (``--resume``: auto, never or a path) or start from other weights
        (``--load-weights``, with what the --load-* flags ask for)."""
        cfg = self.config
        resume, load_weights = cfg.resume, cfg.load_weights
        if resume == "never":
            found = None
        elif resume == "auto":
            found = self._read(lambda: self.store.latest_valid(self.warn))
        else:
            found = self._read(lambda: (resume, self.store.read(resume)))
        if found is not None:
            path, state = found
            self._check_resumable(state, path)
            self._load(state, path, EVERYTHING)
            s = self.saved.state
            self.say(
                f"dmltrain: resuming from {path} (epoch {s.epoch + 1}, "
                f"{s.step_in_epoch} steps into it, global step {s.global_step})"
            )
            self._resized(state)
            self.loaded(_shown(path))
        elif load_weights:
            path = load_weights
            state = self._weights(path)
            if cfg.ema:  # the averaged weights, as the model's
                state = {**state, "model": pretrained.averaged(state, path)}
            parts = Parts(cfg.load_optimizer, cfg.load_scheduler, cfg.load_scaler, cfg.load_epoch)
            self._load(state, path, parts)
            self.say(f"dmltrain: weights loaded from {load_weights}")
            self.loaded(_shown(path))

    def rollback(self, epoch: int, step: int) -> None:
        """Every rank reloads the newest valid checkpoint of this run and will skip the
        (1-based) ``epoch``'s ``step``, the one that was not finite (``--on-nan rollback``)."""
        self.wait()
        found = self._read(lambda: self.store.latest_valid(self.warn))
        if found is None:
            raise UserError(
                f"--on-nan rollback: no checkpoint in {self.store.where()} to roll back to"
            )
        path, state = found
        self._load(state, path, EVERYTHING)
        self.saved.state.skip_steps.add((epoch, step))
        self.say(f"dmltrain: rolled back to {path}; epoch {epoch} step {step} will be skipped")
        self.loaded(_shown(path))

    def _weights(self, path: str) -> dict[str, Any]:
        found = self._read(lambda: (path, self.store.read(path)))
        assert found is not None
        return found[1]

    def _read(
        self, read: Callable[[], tuple[str, dict[str, Any]] | None]
    ) -> tuple[str, dict[str, Any]] | None:
        """What rank 0's ``read`` found (a checkpoint's path and its state, or None), on
        every rank: the file is read and checked once in all, not once a rank, and a
        UserError there is every rank's."""
        found, failed = None, None
        if self.dist.is_main:
            try:
                found = read()
            except UserError as exc:
                failed = str(exc)
        choice, failed = self.strategy.broadcast_object(
            (None if found is None else str(found[0]), failed)
        )
        if failed is not None:
            raise SharedError(failed)
        if choice is None:
            return None
        return choice, hand_out(self.strategy, None if found is None else found[1])

    def _check_resumable(self, state: dict[str, Any], path: str) -> None:
        """The seed fixes the data order, and the global batch (processes x batch size x
        accumulation) the optimisation: a resume keeps both, at any number of processes.
        Other changed settings are listed in a warning."""
        saved, now = state["config"], self.run_config
        if saved["train"].get("seed") != now["train"].get("seed"):
            raise UserError(
                f"cannot resume from {path}: seed is {now['train'].get('seed')!r} now but was "
                f"{saved['train'].get('seed')!r}; use the same value, or start a new run "
                "(--resume never with a new --run-dir)"
            )
        old, new = _global_batch(saved["train"], state["world_size"]), self._global_batch()
        if old != new and not self.config.allow_global_batch_change:
            w, a = self.dist.world_size, now["train"].get("grad_accum", 1)
            keep = f"--global-batch-size {old}"
            if old % (w * a) == 0:
                keep += f" (or --batch-size {old // (w * a)})"
            raise UserError(
                f"cannot resume from {path}: the global batch would be {new} ({w} process(es) "
                f"x --batch-size {now['train']['batch_size']} x --grad-accum {a}) but was "
                f"{old} ({state['world_size']} x {saved['train']['batch_size']} x "
                f"{saved['train'].get('grad_accum', 1)}); keep it with {keep}, or change it "
                "with --allow-global-batch-change"
            )
        was, kind = saved["train"].get("optimizer"), now["train"].get("optimizer")
        if was is not None and was != kind:
            raise UserError(
                f"cannot resume from {path} with --optimizer {kind}: its optimizer state is "
                f"{was}'s; resume with --optimizer {was}, or start a new run from its weights "
                f"(--load-weights {path} --no-load-optimizer, and a new --run-dir)"
            )
        changed = [
            f"{k}: {saved['train'].get(k)!r} -> {v!r}"
            for k, v in now["train"].items()
            if k not in _RESUME_OWN and k in saved["train"] and saved["train"][k] != v
        ] + [
            f"{k}: {saved['options'].get(k)!r} -> {v!r}"
            for k, v in now["options"].items()
            if saved["options"].get(k) != v
        ]
        if changed and self.dist.is_main:
            self.warn(
                f"resuming {path} with changed settings, which apply from here on: "
                f"{', '.join(changed)}"
            )

    def _global_batch(self) -> int:
        return _global_batch(self.run_config["train"], self.dist.world_size)

    def _resized(self, state: dict[str, Any]) -> None:
        """After a resume at another number of processes or global batch: the position in
        the epoch, kept in samples (rounded down to a whole new batch when the global batch
        changed), and the change recorded in the run's state."""
        s, world = self.saved.state, self.dist.world_size
        old, new = (
            _global_batch(state["config"]["train"], state["world_size"]),
            self._global_batch(),
        )
        if (state["world_size"], old) == (world, new):
            return
        samples = s.step_in_epoch * old
        s.step_in_epoch = samples // new
        s.world_size_changes.append(
            {
                "epoch": s.epoch + 1,
                "step": s.step_in_epoch,
                "global_step": s.global_step,
                "world_size": [state["world_size"], world],
                "global_batch": [old, new],
            }
        )
        said = (
            f"dmltrain: resuming on {world} process(es) instead of {state['world_size']}, "
            f"global batch {new}"
        )
        if old != new:
            self.warn(
                f"the global batch changes from {old} to {new} (--allow-global-batch-change): "
                f"{samples} samples into epoch {s.epoch + 1}, the run goes on from sample "
                f"{s.step_in_epoch * new}, a whole batch of {new}"
            )
        self.say(said + (" (kept)" if old == new else ""))

    def _load(self, state: dict[str, Any], path: str, parts: Parts) -> None:
        saved = self.saved
        optimizer, counters = parts.optimizer, parts.run
        # loading may take a zero step (see save); set_to_none is the default, and Horovod's
        # optimizer takes no arguments
        for each in saved.optimizers:
            each.zero_grad()
        # how each group's update runs (fused, foreach...) is this run's, not the file's
        running = [[_execution(g) for g in each.param_groups] for each in saved.optimizers]
        if state.get("sharded"):
            own = _without(shapes_of(unwrap(saved.model).state_dict()), saved.base)
            check_model_fits(own, state["shapes"], path)  # read by load_file
            optimizers = dcp_optimizers(saved.optimizers)
            model_state, optim_state = dcp().get_state_dict(saved.model, optimizers)
            shards: dict[str, Any] = {"model": _without(model_state, saved.base)}
            options = dcp().StateDictOptions(strict=not saved.base)
            if optimizer:
                shards["optimizer"] = optim_state
            for key, item in saved.shaped.items():
                if counters and state.get(f"{key}_sharded"):
                    shards[key] = item.shards(counters=False)  # loaded into in place
            self.store.read_shards(path, shards, state["index"])
            if optimizer:
                dcp().set_state_dict(
                    saved.model,
                    optimizers,
                    model_state_dict=shards["model"],
                    optim_state_dict=shards["optimizer"],
                    options=options,
                )
            else:
                dcp().set_model_state_dict(saved.model, shards["model"], options=options)
        else:
            self.strategy.load_full_state(
                saved.model, saved.optimizers, state, optimizer, path, saved.base
            )
        if optimizer:
            self._optimizer_settings(state.get("config", {}).get("train", {}), path)
            for each, groups in zip(saved.optimizers, running, strict=True):
                for group, settings in zip(each.param_groups, groups, strict=False):
                    group.update(settings)  # a CPU run resumed on a GPU runs fused there
        if optimizer and state.get("optimizer_fresh"):
            for each in saved.optimizers:  # saved before its first step: keep it fresh
                each.state.clear()
        if parts.scheduler and state["scheduler"] is not None:
            _load_schedulers(saved.schedulers, state["scheduler"], path, self.say)
        if parts.scaler:
            saved.precision.load_state_dict(state.get("scaler"))
        for key, item in saved.shaped.items():  # the checkpoint's, or these weights anew
            if counters and key in state:
                item.load_state_dict(state[key])
            elif not (counters and state.get(f"{key}_sharded")):  # else loaded with the shards
                item.restart()
        if counters:
            own = ranks_own(state.get("rank_states", {}), saved.states, self.dist, path)
            self._load_states({**state.get("states", {}), **own}, path)
            rank, world = self.dist.rank, self.dist.world_size
            self._restore_position(state, path)
            same = state["world_size"] == world
            # on another number of processes the partial epoch's sums go to rank 0
            saved.state.load_ranks(state, state["epoch_metrics"], rank, same)
            if same:
                if "rng" in state:
                    set_rng_state(state["rng"][rank])
            else:  # every rank's generators anew
                seed = state["config"]["train"]["seed"]
                seed_everything(sample_seed(seed, state["global_step"], rank) >> 1)

    def _optimizer_settings(self, saved: dict[str, Any], path: str) -> None:
        """The loaded param groups with this run's --lr and --weight-decay where they
        changed (the groups' own learning rates scaled alike; a scheduler built now takes
        over from its saved position: ``schedules``). A group that lacks a setting of its
        optimizer came from another kind of optimizer."""
        now = self.run_config["train"]
        lr_was, lr = saved.get("lr"), now.get("lr")
        decay_was, decay = saved.get("weight_decay"), now.get("weight_decay")
        for optimizer in self.saved.optimizers:
            defaults = getattr(optimizer, "defaults", {})
            for group in optimizer.param_groups:
                # a switch a newer torch added (foreach, fused, ...) takes its default; a
                # missing setting (momentum, betas) is another optimizer's state
                for key in set(defaults) - set(group):
                    if isinstance(defaults[key], bool) or defaults[key] is None:
                        group[key] = defaults[key]
                missing = sorted(set(defaults) - set(group))
                if missing:
                    raise UserError(
                        f"the optimizer state in {path} is another optimizer's (its param "
                        f"groups lack {', '.join(missing)}); resume with the optimizer it was "
                        "saved with, or start anew with --load-weights and --no-load-optimizer"
                    )
                if lr_was and lr and lr != lr_was:
                    for key in ("lr", "initial_lr"):
                        if key in group:
                            group[key] = group[key] * (lr / lr_was)
                if decay != decay_was and group.get("weight_decay") == decay_was:
                    group["weight_decay"] = decay

    def _restore_position(self, state: dict[str, Any], path: str) -> None:
        """Each rank's place in its training stream, taken up when the loop goes on."""
        feed, world = self.saved.feed, self.dist.world_size
        if feed is None or not feed.takes_position(state["step_in_epoch"] > 0):
            return
        positions = state.get("data")
        if positions is not None and len(positions) != world:
            where = (
                f"{path} holds where the training data was on each of its "
                f"{len(positions)} processes, and this run has {world}"
            )
            if not self.config.restart_streams:
                raise UserError(
                    f"{where}: a stream (or create_dataloader's own loader) cannot be split "
                    f"anew; resume on {len(positions)} processes, or pass --restart-streams "
                    "to begin each rank's afresh"
                )
            if self.dist.is_main:
                self.warn(f"{where}: each rank's stream begins afresh (--restart-streams)")
            return
        mine = None if positions is None else positions[self.dist.rank]
        feed.restore(mine, self.warn if self.dist.is_main else lambda line: None)

    def _load_states(self, kept: dict[str, Any], path: str) -> None:
        """The callbacks' and the experiment's states; one that the checkpoint lacks starts
        afresh, and one that this run no longer has is dropped, each said in a line."""
        for key, item in self.saved.states.items():
            if key in kept:
                item.load_state_dict(kept[key])
            elif self.dist.is_main:
                self.say(f"dmltrain: {path} holds no state for {key!r}; it starts afresh")
        dropped = sorted(set(kept) - set(self.saved.states))
        if dropped and self.dist.is_main:
            self.warn(
                f"{path} holds state for {', '.join(dropped)}, which this run does not have "
                "(create_callbacks, create_states): it is dropped"
            )


def _without(tensors: Any, base: frozenset[str]) -> Any:
    """A model's state less the ``base`` a checkpoint leaves out (None stays None)."""
    if not base or tensors is None:
        return tensors
    return {key: value for key, value in tensors.items() if key not in base}


def _shown(location: str) -> Path | str:
    """A checkpoint's location as ``on_load_checkpoint`` gets it: a Path, or a URI."""
    return location if is_uri(location) else Path(location)


def split_states(ranks: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The states (``create_states``, the callbacks') every rank holds alike, kept once,
    and those that differ between ranks (a carried hidden state, a rank's own position),
    kept as the list of every rank's."""
    alike: dict[str, Any] = {}
    own: dict[str, list[Any]] = {}
    for key, first in ranks[0].items():
        values = [r.get(key) for r in ranks]
        if all(_same(first, value) for value in values[1:]):
            alike[key] = first
        else:
            own[key] = values
    return alike, own


def ranks_own(
    own: dict[str, list[Any]], states: Mapping[str, Any], dist: Any, path: str
) -> dict[str, Any]:
    """This rank's part of each per-rank state; at another number of processes, what the
    state's ``resplit_state(states, world_size)`` makes of the saved ranks' (one a rank),
    or a UserError where it has none."""
    mine: dict[str, Any] = {}
    for key, values in own.items():
        if len(values) != dist.world_size:
            resplit = getattr(states.get(key), "resplit_state", None)
            if not callable(resplit):
                raise UserError(
                    f"{path} holds {key!r} for each of its {len(values)} processes, and this "
                    f"run has {dist.world_size}: resume on {len(values)}, or give the state a "
                    "method resplit_state(states, world_size) returning one state a rank"
                )
            values = list(resplit(values, dist.world_size))
        mine[key] = values[dist.rank]
    return mine


def _same(a: Any, b: Any) -> bool:
    """Whether two states are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a truth value: different, kept per rank
        return False

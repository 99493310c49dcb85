"""How a trainer's parts are made and wired before the loop runs (``TrainerSetup.setup``):
processes, run directory, model, data, optimizers, state, checkpoints, the step, the
built-in features and the callbacks, records.

The order of every random draw and collective here is part of the bitwise promise:
seed, ``create_model``, per-rank seed, wrap, EMA copy, compile, loaders, optimizers.
"""

import contextlib
import dataclasses
import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dmltrain import callback
from dmltrain.callback import Events
from dmltrain.checkpoint.checkpointer import Checkpointer, Saved
from dmltrain.config import as_plain, to_yaml
from dmltrain.data import rng, samples, streams
from dmltrain.data.streams import TrainFeed
from dmltrain.engine import contract, evaluation, metric_objects
from dmltrain.engine.budget import Budget, epochs_to_run, total_steps
from dmltrain.engine.compiling import CompileCache, compile_model
from dmltrain.engine.loop import TrainingLoop
from dmltrain.engine.nan import NanChecker
from dmltrain.engine.precision import Precision, set_matmul_precision
from dmltrain.engine.progress import Progress
from dmltrain.engine.state import TrainState
from dmltrain.engine.step import ManualStep, OptimizerStep, check_first_forward
from dmltrain.errors import UserError
from dmltrain.features import monitor, profiling
from dmltrain.features.builtin import (
    EmaFeature,
    Features,
    ProfilerFeature,
    StepsLogFeature,
    WatchdogFeature,
)
from dmltrain.features.ema import EMA
from dmltrain.features.monitor import Monitor, StepClock, peak_flops
from dmltrain.features.tracking import create_trackers
from dmltrain.features.watchdog import Watchdog
from dmltrain.hooks import TrainerHooks
from dmltrain.records import rundir
from dmltrain.records.files import write_status
from dmltrain.records.training_log import StepsLog
from dmltrain.runtime import diagnostics, launch, preemption, processes, sharding, threads
from dmltrain.runtime.distributed import unwrap


def print_none(line: str) -> None:
    """What ranks other than 0 say of what every rank finds alike."""


class TrainerSetup(TrainingLoop):
    """``setup``: everything ``fit`` needs, made in the order the bitwise promise fixes."""

    _ranks: list[dict[str, Any]]  # what each rank reported at start (diagnostics.this_rank)
    _nan_checker: NanChecker | None
    _run_dir_held: rundir.Held
    environment: launch.RunEnvironment
    options: Any
    name: str

    def setup(self) -> None:
        """Processes, run directory, model, data, optimizer, state: everything ``fit`` needs."""
        processes.raise_open_files_limit()  # before any peer's socket is opened
        self.dist = self.strategy.setup(self.environment)
        self.device = torch.device(self.dist.device)
        cfg, loop, dist = self.config, self.config.loop, self.dist
        self._progress = Progress(
            loop.progress, dist.is_main, loop.log_every, world_size=dist.world_size
        )
        evaluating = cfg.checkpoint.evaluating  # --evaluate/--predict: no training
        name = self.name + ("-eval" if evaluating else "")
        # a requeued job may start while the job before it is still ending
        self.run_dir, self._run_dir_held = rundir.choose(
            loop.run_dir,
            lambda: rundir.default_path(name, dist.job_id),
            cfg.checkpoint.resume,
            dist.is_main,
            self.strategy.broadcast_object,
            evaluating=bool(evaluating),
            wait=60.0 if dist.job_id else 0.0,
        )
        self.config = cfg = cfg.replace(run_dir=str(self.run_dir))
        # Every rank's host and CPUs: each takes its share of its cores (dmltrain.runtime.threads).
        self._ranks = self.strategy.all_gather_object(diagnostics.this_rank(dist, self.environment))
        cuda = self.device.type == "cuda"
        threads.assign(cfg.distributed.threads, cfg.data.num_workers, self._ranks, cuda)
        torch.set_num_threads(self._ranks[dist.rank]["threads"])
        self.config = cfg = cfg.replace(num_workers=self._ranks[dist.rank]["workers"])  # no "auto"
        self._precision = Precision(cfg.numerics.precision, self.device)
        set_matmul_precision(cfg.numerics.matmul_precision, self.device)
        profiler = self._profiler_feature()  # before the model: its memory is recorded
        self._features = Features([profiler] if profiler is not None else [])
        torch.manual_seed(loop.seed)  # the same initial weights on every rank
        self.model = sharding.place(
            self.create_model,
            contract.model,
            self.checkpointed_modules,
            lambda model: self.strategy.wrap_model(
                model, self.fsdp_units(model), self._precision.dtype, self.manual_optimization
            ),
            cfg.memory,
            self.strategy.name,
            dist.rank,
            dist.world_size,
            self.device,
        )
        rng.seed_everything(loop.seed + dist.rank)  # per-rank dropout, augmentation
        ema, avg = None, cfg.averaging
        if avg.ema_decay and not evaluating:
            ema = EMA(unwrap(self.model), avg.ema_decay, avg.ema_warmup_steps, avg.ema_every_steps)
        # best.pt and early stopping follow the average's metric when it is validated
        self._best_metric = cfg.checkpoint.best_metric
        if ema is not None and avg.ema_eval and self._best_metric.startswith("val_"):
            self._best_metric = "val_ema_" + self._best_metric[4:]
        if loop.compile:
            say = self._progress.info if dist.is_main else print_none
            self.model = compile_model(self.model, unwrap(self.model), self.run_dir, say)
        self._setup_data()
        metrics = self.create_metrics()  # torchmetrics objects (metric_objects)
        self._evaluator = evaluation.Evaluator(
            self.strategy,
            self._precision,
            self.device,
            objects=metric_objects.prepare(metrics, self.device, self.strategy.metric_gather()),
        )
        epochs = epochs_to_run(loop, self._feed.steps, self.warn if dist.is_main else print_none)
        if epochs != loop.epochs:  # resolved once, as recorded in config.yaml
            self.config = cfg = cfg.replace(epochs=epochs)
            loop = cfg.loop
        self._total_steps = total_steps(loop, self._feed.steps)
        made = contract.several(self.create_optimizer(self.model), "create_optimizer")
        self.optimizers = tuple(
            self.strategy.wrap_optimizer(o, self.model, loop.grad_accum, self.manual_optimization)
            for o in made
        )
        self.optimizer = self.optimizers[0]
        single = len(self.optimizers) == 1
        self.scheduler = self.create_scheduler(self.optimizer if single else self.optimizers)
        self._schedulers = (
            () if self.scheduler is None else contract.several(self.scheduler, "create_scheduler")
        )
        self._state = TrainState(self.device)  # on the device chosen by the strategy
        checks = cfg.numerics
        self._nan_checker = None
        if checks.check_nans:
            self._nan_checker = NanChecker(
                unwrap(self.model),
                dist.rank,
                dist.world_size,
                self.device,
                self.strategy.all_reduce_sum,
                self.strategy.all_gather_object,
                self.run_dir / "nan_report.txt",
            )
        callbacks = (
            [] if evaluating else callback.create(self.create_callbacks(), loop.callback_names())
        )
        self._events = Events(callbacks)
        self._fire(self._events.on_setup)
        states = {} if evaluating else callback.states(callbacks, self.create_states())
        saved = Saved(
            self.model,
            self.optimizers,
            self._schedulers,
            self._precision,
            self._state,
            ema,
            states,
            self._feed,
        )
        plain = as_plain(cfg, self.options)  # what checkpoints and records hold of the config
        restoring = cfg.checkpoint
        if evaluating:  # the named checkpoint's weights alone; this run saves nothing
            restoring = dataclasses.replace(
                restoring,
                resume="never",
                load_weights=evaluating,
                evaluate=None,
                predict=None,
                load_optimizer=False,
                load_scheduler=False,
                load_scaler=False,
                load_epoch=False,
            )
        self._checkpointer = Checkpointer(
            restoring,
            self.run_dir / "checkpoints",
            saved,
            self.strategy,
            plain,
            self._progress.info,
            self.warn,
        )
        # the listeners as they are when a checkpoint is taken or loaded
        self._checkpointer.before_save = self._before_save
        self._checkpointer.loaded = lambda path: self._fire(self._events.on_load_checkpoint, path)
        self._checkpointer.restore()
        self.strategy.started()
        if evaluating:
            return
        self._budget = Budget(
            loop,
            self._state,
            self._best_metric,
            cfg.checkpoint.best_mode,
            cfg.preemption.epochs_per_job,
            self.warn,
        )
        if checks.check_nans and checks.on_nan == "rollback" and self._state.global_step == 0:
            self._checkpointer.save(best=False)  # something to roll back to from step 1
        self._step_clock = StepClock(self.device, timing=cfg.monitoring.monitor)
        self._start_monitor()
        self._make_step()
        watchdog = self._watchdog_feature()
        steps_log = self._start_records(plain)
        # Run order, part of the bitwise promise: the EMA update first at a step's end.
        ema_feature = None if ema is None else EmaFeature(ema, avg.ema_eval)
        cache = CompileCache(self.run_dir, self.warn) if loop.compile and dist.is_main else None
        built_in = [f for f in (ema_feature, profiler, watchdog, steps_log, cache) if f is not None]
        self._features = Features(built_in)
        self._checkpointer.quiet = self._features.quiet
        self._events = Events([*built_in, *callbacks])

    def _make_step(self) -> None:
        """One optimizer step's parts (``dmltrain.engine.step``): automatic, or ``train_step``'s own
        updates (``manual_optimization``)."""
        loop, checks = self.config.loop, self.config.numerics
        nan_checker = self._nan_checker
        if nan_checker is not None and self._precision.scaler is None:  # else the scaler's
            nan_checker.wait_for(self.optimizers, self._progress.info)
        parts: dict[str, Any] = dict(
            train_step=self._step_clock.timed(self.train_step),
            model=self.model,
            optimizers=self.optimizers,
            schedulers=self._schedulers if self.scheduler_interval == "step" else (),
            precision=self._precision,
            strategy=self.strategy,
            state=self._state,
            device=self.device,
            grad_clip=loop.grad_clip,
            detect_anomaly=checks.detect_anomaly,
            nan_checker=nan_checker,
            settle=self._settle,
            # the callbacks' on_before_optimizer_step, bound to the trainer
            before_update=tuple(
                partial(call, self) for call in self._events.on_before_optimizer_step
            ),
        )
        if self.manual_optimization:
            self._step = ManualStep(**parts)
        else:
            overridden = type(self).on_after_backward is not TrainerHooks.on_after_backward
            after_backward = self.on_after_backward if overridden else None
            self._step = OptimizerStep(on_after_backward=after_backward, **parts)
            check_first_forward(self._step, self.strategy.sync_wrapper(self.model))

    def _setup_data(self) -> None:
        """prepare_data on one process per node, then every rank's datasets and loaders."""
        if self.dist.is_local_main:
            self.prepare_data()
        self.strategy.barrier()
        train_set, val_set = contract.datasets(self.create_datasets())
        if not streams.is_stream(train_set) and len(train_set) == 0:
            raise UserError("the training dataset is empty: check --data-dir")
        seed, dist = self.config.loop.seed, self.dist
        self.train_loader = self.create_dataloader(samples.keyed(train_set, seed), train=True)
        self._feed = TrainFeed(self.train_loader, self.config.loop, dist.rank, dist.world_size)
        steps = self.strategy.all_gather_object(self._feed.steps) if self._feed.strict else []
        if len(set(steps)) > 1:
            raise UserError(
                f"the training stream gives the ranks different numbers of steps an epoch "
                f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(steps))}): make its "
                "len() the same on every rank, or give --steps-per-epoch"
            )
        self.val_loader = None
        if val_set is not None and not streams.is_stream(val_set) and len(val_set) == 0:
            raise UserError(
                "the validation dataset is empty: check --data-dir, or return None for it "
                "from create_datasets to train without validation"
            )
        if val_set is not None and streams.is_stream(val_set) and self.strategy.name == "fsdp":
            raise UserError(
                "validation over a stream under FSDP: the ranks' forward passes are collective "
                "and a stream cannot be padded to as many batches on each; return a map-style "
                "validation dataset from create_datasets"
            )
        if val_set is not None:
            self.val_loader = self.create_dataloader(samples.keyed(val_set, seed), train=False)
        # `is not None`: a loader over a stream has no len(), so it has no truth value
        if any(
            loader is not None and loader.num_workers > 0
            for loader in (self.train_loader, self.val_loader)
        ):
            problem = processes.loader_workers_problem(tempfile.gettempdir())
            if problem is not None:
                raise UserError(problem)

    def _profiler_feature(self) -> ProfilerFeature | None:
        """This rank's profiler when --profile-ranks names it (the lowest shows its table)."""
        cfg, dist = self.config, self.dist
        profiled = cfg.profiling.profiled(dist.world_size)
        if dist.rank not in profiled:
            return None
        show = None
        if dist.rank == profiled[0]:
            show = self._progress.info if dist.is_main else print
        profiler = profiling.Profiler(
            cfg.profiling, self.run_dir / "profile", dist.rank, self.device, show
        )
        return ProfilerFeature(profiler)

    def _start_monitor(self) -> None:
        """What is made of the step clocks at each log interval (``monitor``)."""
        cfg, dist, me = self.config, self.dist, self._ranks[self.dist.rank]
        hint = monitor.workers_hint(me["cpu_share"], me["workers"])  # the CPUs of its own
        self._monitor = Monitor(
            self._step_clock,
            self.strategy.over_ranks,
            dist.rank,
            [entry["host"] for entry in self._ranks],
            cfg.monitoring.straggler_factor,
            self.warn,
            self.run_dir / "ranks.csv" if dist.is_main and dist.world_size > 1 else None,
            self.flops_per_sample(),
            peak_flops(self.device, cfg.numerics.precision),
            hint,
            dist.world_size * cfg.loop.batch_size * cfg.loop.grad_accum,
            self._progress.info,
        )

    def _watchdog_feature(self) -> WatchdogFeature | None:
        """The hang watchdog (--hang-watchdog), reading the step clock from its thread."""
        cfg, dist = self.config, self.dist
        if not cfg.hang.hang_watchdog:
            return None
        watchdog = Watchdog.for_run(
            self._step_clock,
            self.run_dir,
            dist,
            self._ranks[dist.rank]["host"],
            cfg.hang,
            cfg.distributed.dist_timeout,
            self.strategy.flight_recorder(),
            self.strategy.peers,
            self._leave_for_a_hang,
        )
        return WatchdogFeature(watchdog)

    def _leave_for_a_hang(self, status: int) -> None:
        """The watchdog ends the process from its thread (the main one is stuck): the
        job's status goes to --status-file first, which the batch scripts end the step on."""
        path = self.config.distributed.status_file
        if path:
            with contextlib.suppress(Exception):  # leaving matters more than the record
                write_status(Path(path), status, self._checkpointer.written, self.dist.is_main)
        os._exit(status)

    def _start_records(self, plain: dict[str, Any]) -> StepsLogFeature | None:
        """config.yaml, diagnostics, steps.csv and the tracker (rank 0); the Slurm deadline
        (all ranks)."""
        deadline, steps_log = None, None
        if self.dist.is_main:
            own = type(self).create_optimizer is not TrainerHooks.create_optimizer
            made = rundir.built(self.optimizers, self._schedulers, own)
            text = to_yaml(self.config, self.options, f"{self.name} options") + "\n" + made
            self._progress.info(
                f"dmltrain: {self.name} -> {self.run_dir} (options: config.yaml there; "
                "--print-config prints them)"
            )
            strategy = self.strategy
            info = diagnostics.collect(
                self._ranks,
                self.dist,
                strategy.name,
                strategy.backend(),
                type(self),
                plain,
                self.environment,
            )
            info["world_size_changes"] = self._state.world_size_changes
            info["training"] = diagnostics.training(
                unwrap(self.model),
                self.train_loader,
                self.val_loader,
                self.config.loop,
                self.dist.world_size,
                self.config.numerics.precision,
                self._feed.steps,
            )
            self._progress.info(rundir.write_records(self.run_dir, text, info))
            self._steps_log = StepsLog(
                self.run_dir / "steps.csv", self._state.global_step, self.warn
            )
            steps_log = StepsLogFeature(self._steps_log)
            self._tracker = create_trackers(
                self.config.tracking,
                self.environment.wandb_mode,
                self.run_dir,
                self._state.tracker_run_ids,
                self._state.global_step,
                self.name,
                plain,
                self._progress.info,
                diagnostics.job_tags(info),
            )
            self._state.tracking_run_id = self._tracker.run_id
            self._state.tracker_run_ids = self._tracker.run_ids
            minutes = self.config.preemption.stop_before_end_minutes  # rank 0 asks Slurm, once
            deadline = preemption.stop_deadline(self.dist.job_id, minutes, self.warn)
        self._watcher.stop_at(self.strategy.broadcast_object(deadline), self._progress.info)
        return steps_log

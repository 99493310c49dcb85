"""How a run's parts are made and wired before the loop runs (``assemble``):
processes, run directory, model, data, optimizers, state, checkpoints, the step, the
built-in features and the callbacks, records.

The order of every random draw and collective here is part of the bitwise promise:
seed, ``create_model``, per-rank seed, wrap, EMA copy, compile, loaders, optimizers.
"""

import contextlib
import dataclasses
import os
import socket
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dmltrain import callback
from dmltrain.callback import Callback, Events
from dmltrain.checkpoint import objects, tiers
from dmltrain.checkpoint.checkpointer import Checkpointer, Saved
from dmltrain.checkpoint.storage import CheckpointDir, CheckpointStore
from dmltrain.config import CheckpointConfig, FinetuneConfig, LoopConfig, per_process_batch
from dmltrain.config.files import as_plain, to_yaml
from dmltrain.data import rng, samples, streams
from dmltrain.data.streams import TrainFeed
from dmltrain.engine import contract, evaluation, metric_objects
from dmltrain.engine.budget import Budget, epochs_to_run, total_steps
from dmltrain.engine.compiling import CompileCache, compile_model
from dmltrain.engine.finetuning import Adapt
from dmltrain.engine.loop import before_save, fire, settle
from dmltrain.engine.nan import NanChecker
from dmltrain.engine.precision import Precision, set_matmul_precision
from dmltrain.engine.progress import Progress
from dmltrain.engine.run import Run
from dmltrain.engine.state import TrainState
from dmltrain.engine.step import ManualStep, OptimizerStep, check_first_forward
from dmltrain.errors import UserError, first_line
from dmltrain.features import monitor, profiling
from dmltrain.features.builtin import (
    EmaFeature,
    ProfilerFeature,
    StepScalars,
    StepsLogFeature,
    TrackerFeature,
    WatchdogFeature,
)
from dmltrain.features.ema import EMA
from dmltrain.features.gradient_noise import GradientNoiseScale
from dmltrain.features.monitor import Monitor, StepClock, peak_flops
from dmltrain.features.search import SearchTrial
from dmltrain.features.tracking import create_trackers
from dmltrain.features.watchdog import Watchdog
from dmltrain.hooks import TrainerHooks
from dmltrain.records import rundir
from dmltrain.records.files import write_status
from dmltrain.records.training_log import StepsLog
from dmltrain.runtime import diagnostics, preemption, processes, sharding, threads
from dmltrain.runtime.strategies import unwrap


def print_none(line: str) -> None:
    """What ranks other than 0 say of what every rank finds alike."""


def assemble(run: Run) -> None:
    """Every part of ``run`` that training needs, made for its trainer (the experiment's
    hooks) in the order the bitwise promise fixes."""
    trainer = run.trainer
    profiler = _start(run, evaluating=False)
    cfg, loop, dist = trainer.config, trainer.config.loop, trainer.dist
    ema, avg = None, cfg.averaging
    _open_store(run)
    adapt = _model(run, _adapt(run))
    if avg.ema_decay:
        ema = EMA(unwrap(run.model), avg.ema_decay, avg.ema_warmup_steps, avg.ema_every_steps)
    # best.pt and early stopping follow the average's metric when it is validated
    run.best_metric = cfg.checkpoint.best_metric
    if ema is not None and avg.ema_eval and run.best_metric.startswith("val_"):
        run.best_metric = "val_ema_" + run.best_metric[4:]
    _compile_data_optimizers(run)
    cfg, loop = trainer.config, trainer.config.loop  # the epochs resolved
    checks = cfg.numerics
    run.nan_checker = None
    if checks.check_nans:
        run.nan_checker = NanChecker(
            unwrap(run.model),
            dist.rank,
            dist.world_size,
            trainer.device,
            trainer.strategy.all_reduce_sum,
            trainer.strategy.all_gather_object,
            run.run_dir / "nan_report.txt",
        )
    callbacks = callback.create(trainer.create_callbacks(), loop.callback_names())
    run.events = Events([*run.events.callbacks, *callbacks])  # the profiler's, then these
    fire(run, run.events.on_setup)
    states = callback.states(callbacks, trainer.create_states())
    saved = Saved(
        run.model,
        run.optimizers,
        run.schedulers,
        run.precision,
        run.state,
        states,
        run.feed,
        {} if ema is None else {"ema": ema},
        adapt.base,
    )
    plain = as_plain(cfg, trainer.options)  # what checkpoints and records hold of the config
    restoring = cfg.checkpoint
    if adapt.source is not None:  # loaded as the model was made
        restoring = dataclasses.replace(restoring, load_weights=None)
    _restore(run, restoring, saved, plain)
    run.budget = Budget(
        loop,
        run.state,
        run.best_metric,
        cfg.checkpoint.best_mode,
        cfg.preemption.epochs_per_job,
        trainer.warn,
    )
    if checks.check_nans and checks.on_nan == "rollback" and run.state.global_step == 0:
        run.checkpointer.save(best=False)  # something to roll back to from step 1
    run.step_clock = StepClock(trainer.device, timing=cfg.monitoring.monitor)
    _start_monitor(run)
    watchdog = _watchdog_feature(run)
    records = _start_records(run, plain)
    # Run order, part of the bitwise promise: the EMA update first at a step's end.
    built_in = [
        None if ema is None else EmaFeature(ema, avg.ema_eval, run.state),
        profiler,
        watchdog,
        StepScalars(run.precision, lambda: run.step.grad_norm),
        _gradient_noise(run),
        *records,
        CompileCache(run.run_dir, trainer.warn) if loop.compile and dist.is_main else None,
        _search_trial(run),
    ]
    run.events = Events([*(f for f in built_in if f is not None), *callbacks])
    run.checkpointer.quiet = run.events.around_long_work
    _make_step(run)  # with every listener of on_before_optimizer_step


def _search_trial(run: Run) -> SearchTrial | None:
    """``--search-trial``: the trial of a search this run reports to (every rank)."""
    trainer = run.trainer
    path = trainer.config.loop.search_trial
    if path is None:
        return None
    strategy = trainer.strategy
    return SearchTrial(
        Path(path),
        run.best_metric,
        run.total_steps,
        trainer.dist.is_main,
        strategy.max_over_ranks,
        strategy.broadcast_object,
    )


def assemble_evaluation(run: Run) -> None:
    """``--evaluate``/``--predict``: the parts that evaluate the named checkpoint's
    weights, made as training makes them (the same draws); nothing is trained or saved."""
    trainer = run.trainer
    _start(run, evaluating=True)
    _open_store(run)
    _model(run, None)
    run.best_metric = trainer.config.checkpoint.best_metric
    _compile_data_optimizers(run)
    cfg = trainer.config
    saved = Saved(
        run.model, run.optimizers, run.schedulers, run.precision, run.state, feed=run.feed
    )
    weights_only = dataclasses.replace(
        cfg.checkpoint,
        resume="never",
        load_weights=cfg.checkpoint.evaluating,
        evaluate=None,
        predict=None,
        load_optimizer=False,
        load_scheduler=False,
        load_scaler=False,
        load_epoch=False,
    )
    _restore(run, weights_only, saved, as_plain(cfg, trainer.options))


def _start(run: Run, evaluating: bool) -> ProfilerFeature | None:
    """The processes, the run directory (an evaluation's own), each rank's threads, the
    precision; the profiler (before the model: its memory is recorded)."""
    trainer = run.trainer
    processes.raise_open_files_limit()  # before any peer's socket is opened
    trainer.dist = trainer.strategy.setup(trainer.environment)
    trainer.device = torch.device(trainer.dist.device)
    cfg, loop, dist = trainer.config, trainer.config.loop, trainer.dist
    run.progress = Progress(loop.progress, dist.is_main, loop.log_every, world_size=dist.world_size)
    name = trainer.name + ("-eval" if evaluating else "")
    # a requeued job may start while the job before it is still ending
    run.run_dir, run.run_dir_held = rundir.choose(
        loop.run_dir,
        lambda: rundir.default_path(name, dist.job_id),
        cfg.checkpoint.resume,
        dist.is_main,
        trainer.strategy.broadcast_object,
        evaluating=evaluating,
        wait=60.0 if dist.job_id else 0.0,
        owner=dist.job_id or f"{socket.gethostname()}:{os.getpid()}",
    )
    # Every rank's host and CPUs: each takes its share of its cores (dmltrain.runtime.threads).
    run.ranks = trainer.strategy.all_gather_object(diagnostics.this_rank(dist, trainer.environment))
    cuda = trainer.device.type == "cuda"
    threads.assign(cfg.distributed.threads, cfg.data.num_workers, run.ranks, cuda)
    torch.set_num_threads(run.ranks[dist.rank]["threads"])
    # What the processes decide, resolved once as config.yaml records it: each process's
    # share of --global-batch-size, the run directory chosen, no "auto" workers.
    batch, given = per_process_batch(loop, dist.world_size), loop.batch_size
    if batch != given and given != LoopConfig().batch_size and dist.is_main:
        trainer.warn(
            f"--global-batch-size {loop.global_batch_size} on {dist.world_size} process(es) "
            f"sets --batch-size {batch}, not the {given} given"
        )
    workers = run.ranks[dist.rank]["workers"]
    remote = objects.is_uri(loop.run_dir)  # kept as the URI; run.run_dir: the records' folder
    trainer.config = cfg = cfg.replace(
        batch_size=batch, run_dir=loop.run_dir if remote else str(run.run_dir), num_workers=workers
    )
    run.precision = Precision(cfg.numerics.precision, trainer.device)
    set_matmul_precision(cfg.numerics.matmul_precision, trainer.device)
    profiler = _profiler_feature(run)
    # its listeners until the callbacks are made: the profiler is stopped however setup ends
    run.events = Events([profiler] if profiler is not None else [])
    return profiler


def _model(run: Run, adapt: Adapt | None) -> Adapt:
    """``create_model``'s model, adapted for a fine-tune, placed and wrapped: the same
    initial weights on every rank; then each rank's own generators (dropout,
    augmentation), unless ``--seed-once`` leaves them where the model's draws left them."""
    trainer = run.trainer
    cfg, dist = trainer.config, trainer.dist
    if adapt is None:  # --evaluate, --predict: the checkpoint's weights as they are
        adapt = _adapt(run, FinetuneConfig())
    if cfg.loop.seed_once:  # a script's one seeding: its later draws follow the model's
        rng.seed_everything(cfg.loop.seed)
    else:
        torch.manual_seed(cfg.loop.seed)
    run.model = sharding.place(
        trainer.create_model,
        adapt,
        contract.model,
        trainer.checkpointed_modules,
        lambda model: trainer.strategy.wrap_model(
            model, trainer.fsdp_units(model), run.precision.dtype, trainer.manual_optimization
        ),
        cfg.memory,
        trainer.strategy.name,
        dist.rank,
        dist.world_size,
        trainer.device,
    )
    if not cfg.loop.seed_once:
        rng.seed_everything(cfg.loop.seed + dist.rank)
    return adapt


def _adapt(run: Run, finetune: FinetuneConfig | None = None) -> Adapt:
    """What a fine-tune does to the new model: ``--load-weights`` (unless the run resumes,
    or goes on with the file's optimizer or counters, which load after the optimizer is
    made), ``--lora-targets`` and ``--freeze``."""
    trainer = run.trainer
    cfg = trainer.config
    ckpt, finetune = cfg.checkpoint, cfg.finetune if finetune is None else finetune
    resuming = ckpt.resume != "never" and (
        ckpt.resume != "auto" or trainer.strategy.broadcast_object(
            run.store.newest() is not None if trainer.dist.is_main else None
        )
    )  # fmt: skip
    parts = ckpt.load_optimizer or ckpt.load_scheduler or ckpt.load_scaler or ckpt.load_epoch
    fitted = finetune.load_map or finetune.load_skip or finetune.load_partial
    if parts and (fitted or finetune.lora_targets):
        raise UserError(
            "--load-optimizer, --load-scheduler, --load-scaler and --load-epoch go on with "
            "a checkpoint of this model as it was; drop them to fine-tune with --load-map, "
            "--load-skip, --load-partial or --lora-targets"
        )
    if finetune.lora_targets and (cfg.averaging.ema_decay or objects.is_uri(cfg.run_dir)):
        raise UserError(
            "--lora-targets does not work with --ema-decay or a --run-dir in object storage "
            "yet: drop one of them"
        )
    source = None if resuming or parts else ckpt.load_weights
    every_rank_reads = trainer.strategy.name == "fsdp" and not cfg.memory.sharded_init
    say = run.progress.info if trainer.dist.is_main else print_none
    return Adapt(
        finetune, source, ckpt.ema, resuming, run.run_dir, trainer.strategy, every_rank_reads, say
    )


def _compile_data_optimizers(run: Run) -> None:
    """``--compile``, the data and its evaluator, the epochs to run, the optimizers and
    schedulers, the run's state."""
    trainer = run.trainer
    cfg, loop, dist = trainer.config, trainer.config.loop, trainer.dist
    if loop.compile:
        say = run.progress.info if dist.is_main else print_none
        run.model = compile_model(run.model, unwrap(run.model), run.run_dir, say)
    _setup_data(run)
    metrics = trainer.create_metrics()  # torchmetrics objects (metric_objects)
    run.evaluator = evaluation.Evaluator(
        trainer.strategy,
        run.precision,
        trainer.device,
        objects=metric_objects.prepare(metrics, trainer.device, trainer.strategy.metric_gather()),
    )
    epochs = epochs_to_run(loop, run.feed.steps, trainer.warn if dist.is_main else print_none)
    if epochs != loop.epochs:  # resolved once, as recorded in config.yaml
        trainer.config = cfg = cfg.replace(epochs=epochs)
        loop = cfg.loop
    run.total_steps = total_steps(loop, run.feed.steps)
    made = contract.several(trainer.create_optimizer(run.model), "create_optimizer")
    if not trainer.manual_optimization:
        contract.steps_without_closure(made)
    run.optimizers = tuple(
        trainer.strategy.wrap_optimizer(o, run.model, loop.grad_accum, trainer.manual_optimization)
        for o in made
    )
    single = len(run.optimizers) == 1
    run.scheduler = trainer.create_scheduler(run.optimizers[0] if single else run.optimizers)
    run.schedulers = (
        () if run.scheduler is None else contract.several(run.scheduler, "create_scheduler")
    )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    run.plateaus = tuple(s for s in run.schedulers if isinstance(s, plateau))
    run.stepped = tuple(s for s in run.schedulers if not isinstance(s, plateau))
    if run.plateaus and run.val_loader is None:
        raise UserError(
            f"create_scheduler: ReduceLROnPlateau steps on a validation's {run.best_metric}, "
            "and create_datasets returns no validation set; give one, or another scheduler"
        )
    run.state = TrainState(trainer.device)  # on the device chosen by the strategy


def _restore(run: Run, restoring: CheckpointConfig, saved: Saved, plain: dict[str, Any]) -> None:
    """The checkpointer over the run directory's checkpoints; what ``restoring`` asks for
    loaded (a resume, other weights, or nothing)."""
    trainer = run.trainer
    run.checkpointer = Checkpointer(
        restoring, run.store, saved, trainer.strategy, plain, run.progress.info, trainer.warn
    )
    # the listeners as they are when a checkpoint is taken or loaded
    run.checkpointer.before_save = partial(before_save, run)
    run.checkpointer.loaded = partial(fire, run, run.events.on_load_checkpoint)
    run.checkpointer.restore()
    trainer.strategy.started()


def _open_store(run: Run) -> None:
    """Where this run's checkpoints are: the run directory, object storage, or a node-local
    tier drained to the run directory."""
    trainer, cfg = run.trainer, run.trainer.config
    store: CheckpointStore
    shared = run.run_dir / "checkpoints"
    if objects.is_uri(cfg.run_dir):  # object storage; the records copied beside it
        if cfg.local_checkpoint_dir:
            raise UserError(
                "--local-checkpoint-dir drains to a run directory on a file system; with "
                f"--run-dir {cfg.run_dir} each checkpoint is written locally and uploaded "
                "already: drop --local-checkpoint-dir"
            )
        store = objects.ObjectStore(cfg.run_dir, cfg.keep_last, run.run_dir, cfg.async_checkpoint)
    elif cfg.local_checkpoint_dir and _local_tier_usable(run):  # drained to the run dir
        dist = trainer.dist
        local = tiers.local_folder(Path(cfg.local_checkpoint_dir), run.run_dir, dist.rank)
        store = tiers.TieredDir(
            shared, local, cfg.keep_last, trainer.warn, cfg.async_checkpoint, dist.rank,
            dist.world_size,
        )  # fmt: skip
    else:
        store = CheckpointDir(shared, cfg.keep_last, cfg.async_checkpoint)
    run.store = store


def _local_tier_usable(run: Run) -> bool:
    """Whether every rank can make its folder in --local-checkpoint-dir (collective: the
    ranks save alike); else the run directory alone takes the checkpoints, said once."""
    trainer, given = run.trainer, Path(run.trainer.config.checkpoint.local_checkpoint_dir or "")
    folder = tiers.local_folder(given, run.run_dir, trainer.dist.rank)
    why = ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            why = "not writable"
    except OSError as exc:
        why = exc.strerror or first_line(exc)
    failed = trainer.strategy.max_over_ranks([1 if why else 0])[0]
    if failed and trainer.dist.is_main:
        trainer.warn(
            f"--local-checkpoint-dir {given}: a rank cannot use it"
            f"{f' ({why})' if why else ''}; checkpoints go straight to "
            f"{run.run_dir / 'checkpoints'}"
        )
    return not failed


def _make_step(run: Run) -> None:
    """One optimizer step's parts (``dmltrain.engine.step``): automatic, or ``train_step``'s own
    updates (``manual_optimization``)."""
    trainer = run.trainer
    loop, checks = trainer.config.loop, trainer.config.numerics
    nan_checker = run.nan_checker
    if nan_checker is not None and run.precision.scaler is None:  # else the scaler's
        nan_checker.wait_for(run.optimizers, run.progress.info)
    parts: dict[str, Any] = dict(
        train_step=run.step_clock.timed(trainer.train_step),
        model=run.model,
        optimizers=run.optimizers,
        schedulers=run.stepped if trainer.scheduler_interval == "step" else (),
        precision=run.precision,
        strategy=trainer.strategy,
        state=run.state,
        device=trainer.device,
        grad_clip=loop.grad_clip,
        detect_anomaly=checks.detect_anomaly,
        nan_checker=nan_checker,
        settle=partial(settle, run),
        # the callbacks' on_before_optimizer_step, bound to the trainer
        before_update=tuple(partial(call, trainer) for call in run.events.on_before_optimizer_step),
    )
    if trainer.manual_optimization:
        run.step = ManualStep(**parts)
    else:
        overridden = type(trainer).on_after_backward is not TrainerHooks.on_after_backward
        after_backward = trainer.on_after_backward if overridden else None
        run.step = OptimizerStep(on_after_backward=after_backward, **parts)
        check_first_forward(run.step, trainer.strategy.sync_wrapper(run.model))


def _setup_data(run: Run) -> None:
    """prepare_data on one process per node, then every rank's datasets and loaders."""
    trainer = run.trainer
    if trainer.dist.is_local_main:
        trainer.prepare_data()
    trainer.strategy.barrier()
    train_set, val_set = contract.datasets(trainer.create_datasets())
    if not streams.is_stream(train_set) and len(train_set) == 0:
        raise UserError("the training dataset is empty: check --data-dir")
    seed, dist = trainer.config.loop.seed, trainer.dist
    run.train_loader = trainer.create_dataloader(samples.keyed(train_set, seed), train=True)
    run.feed = TrainFeed(run.train_loader, trainer.config.loop, dist.rank, dist.world_size)
    steps = trainer.strategy.all_gather_object(run.feed.steps) if run.feed.strict else []
    if len(set(steps)) > 1:
        raise UserError(
            f"the training stream gives the ranks different numbers of steps an epoch "
            f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(steps))}): make its "
            "len() the same on every rank, or give --steps-per-epoch"
        )
    run.val_loader = None
    if val_set is not None and not streams.is_stream(val_set) and len(val_set) == 0:
        raise UserError(
            "the validation dataset is empty: check --data-dir, or return None for it "
            "from create_datasets to train without validation"
        )
    if val_set is not None and streams.is_stream(val_set) and trainer.strategy.name == "fsdp":
        raise UserError(
            "validation over a stream under FSDP: the ranks' forward passes are collective "
            "and a stream cannot be padded to as many batches on each; return a map-style "
            "validation dataset from create_datasets"
        )
    if val_set is not None:
        run.val_loader = trainer.create_dataloader(samples.keyed(val_set, seed), train=False)
    # `is not None`: a loader over a stream has no len(), so it has no truth value
    if any(
        loader is not None and loader.num_workers > 0
        for loader in (run.train_loader, run.val_loader)
    ):
        problem = processes.loader_workers_problem(tempfile.gettempdir())
        if problem is not None:
            raise UserError(problem)


def _profiler_feature(run: Run) -> ProfilerFeature | None:
    """This rank's profiler when --profile-ranks names it (the lowest shows its table)."""
    trainer = run.trainer
    cfg, dist = trainer.config, trainer.dist
    profiled = profiling.profiled(cfg.profiling, dist.world_size)
    if dist.rank not in profiled:
        return None
    show = None
    if dist.rank == profiled[0]:
        show = run.progress.info if dist.is_main else print
    profiler = profiling.Profiler(
        cfg.profiling, run.run_dir / "profile", dist.rank, trainer.device, show
    )
    return ProfilerFeature(profiler)


def _start_monitor(run: Run) -> None:
    """What is made of the step clocks at each log interval (``monitor``)."""
    trainer = run.trainer
    cfg, dist, me = trainer.config, trainer.dist, run.ranks[trainer.dist.rank]
    hint = monitor.workers_hint(me["cpu_share"], me["workers"])  # the CPUs of its own
    run.monitor = Monitor(
        run.step_clock,
        trainer.strategy.over_ranks,
        dist.rank,
        [entry["host"] for entry in run.ranks],
        cfg.monitoring.straggler_factor,
        trainer.warn,
        run.run_dir / "ranks.csv" if dist.is_main and dist.world_size > 1 else None,
        trainer.flops_per_sample(),
        peak_flops(trainer.device, cfg.numerics.precision),
        hint,
        dist.world_size * cfg.loop.batch_size * cfg.loop.grad_accum,
        run.progress.info,
    )


def _watchdog_feature(run: Run) -> WatchdogFeature | None:
    """The hang watchdog (--hang-watchdog), reading the step clock from its thread."""
    trainer = run.trainer
    cfg, dist = trainer.config, trainer.dist
    if not cfg.hang.hang_watchdog:
        return None
    watchdog = Watchdog.for_run(
        run.step_clock,
        run.run_dir,
        dist,
        run.ranks[dist.rank]["host"],
        cfg.hang,
        cfg.distributed.dist_timeout,
        trainer.strategy.flight_recorder(),
        trainer.strategy.peers,
        partial(_leave_for_a_hang, run),
    )
    return WatchdogFeature(watchdog)


def _leave_for_a_hang(run: Run, status: int) -> None:
    """The watchdog ends the process from its thread (the main one is stuck): the
    job's status goes to --status-file first, which the batch scripts end the step on."""
    trainer = run.trainer
    path = trainer.config.distributed.status_file
    if path:
        with contextlib.suppress(Exception):  # leaving matters more than the record
            write_status(Path(path), status, run.checkpointer.written, trainer.dist.is_main)
    os._exit(status)


def _gradient_noise(run: Run) -> GradientNoiseScale | None:
    """--gradient-noise-scale N: the estimate over every N steps' gradients."""
    trainer = run.trainer
    cfg, window = trainer.config, trainer.config.monitoring.gradient_noise_scale
    if not window:
        return None
    batch = trainer.dist.world_size * cfg.loop.batch_size * cfg.loop.grad_accum
    parameters = [p for p in run.model.parameters() if p.requires_grad]
    return GradientNoiseScale(parameters, window, batch, trainer.strategy.all_reduce_sum)


def _start_records(run: Run, plain: dict[str, Any]) -> list[Callback]:
    """config.yaml, diagnostics, steps.csv and the tracker (rank 0); the Slurm deadline
    (all ranks)."""
    trainer = run.trainer
    deadline, records = None, list[Callback]()
    if trainer.dist.is_main:
        own = type(trainer).create_optimizer is not TrainerHooks.create_optimizer
        made = rundir.built(run.optimizers, run.schedulers, own)
        text = to_yaml(trainer.config, trainer.options, f"{trainer.name} options") + "\n" + made
        run.progress.info(
            f"dmltrain: {trainer.name} -> {run.run_dir} (options: config.yaml there; "
            "--print-config prints them)"
        )
        if objects.is_uri(trainer.config.run_dir):
            run.progress.info(
                f"dmltrain: checkpoints in {trainer.config.run_dir}/checkpoints; the records "
                "are written here and copied there with each checkpoint and at the end"
            )
        strategy = trainer.strategy
        info = diagnostics.collect(
            run.ranks,
            trainer.dist,
            strategy.name,
            strategy.backend(),
            type(trainer),
            plain,
            trainer.environment,
        )
        info["world_size_changes"] = run.state.world_size_changes
        info["training"] = diagnostics.training(
            unwrap(run.model),
            run.train_loader,
            run.val_loader,
            trainer.config.loop,
            trainer.dist.world_size,
            trainer.config.numerics.precision,
            run.feed.steps,
        )
        run.progress.info(rundir.write_records(run.run_dir, text, info))
        steps_log = StepsLog(run.run_dir / "steps.csv", run.state.global_step, trainer.warn)
        records.append(StepsLogFeature(steps_log))
        run.tracker = create_trackers(
            trainer.config.tracking,
            trainer.environment.wandb_mode,
            run.run_dir,
            run.state.tracker_run_ids,
            run.state.global_step,
            trainer.name,
            plain,
            run.progress.info,
            diagnostics.job_tags(info),
        )
        if run.tracker.active:
            records.append(TrackerFeature(run.tracker))
        run.state.tracking_run_id = run.tracker.run_id
        run.state.tracker_run_ids = run.tracker.run_ids
        minutes = trainer.config.preemption.stop_before_end_minutes  # rank 0 asks Slurm, once
        deadline = preemption.stop_deadline(trainer.dist.job_id, minutes, trainer.warn)
    run.watcher.stop_at(trainer.strategy.broadcast_object(deadline), run.progress.info)
    return records

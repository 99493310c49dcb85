"""What ``BaseTrainer.fit`` does: start the workers (``--nprocs``), or assemble a run
(``assembly``) and train it (``loop``) or evaluate it, map a failure to what the job
should do (a lost peer, an out-of-memory), always close the callbacks and record the
outcome.
"""

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dmltrain import compat
from dmltrain.checkpoint import objects
from dmltrain.data import samples
from dmltrain.engine import contract, evaluation, progress
from dmltrain.engine.assembly import assemble, assemble_evaluation
from dmltrain.engine.loop import Loop, evaluating_model
from dmltrain.engine.run import Run
from dmltrain.errors import (
    NonFiniteError,
    PeerFailed,
    PeerLost,
    SharedError,
    StopForRequeue,
    UserError,
)
from dmltrain.features import profiling
from dmltrain.hooks import TrainerHooks
from dmltrain.records import rundir
from dmltrain.records.training_log import read_training_log
from dmltrain.runtime import preemption, processes

if TYPE_CHECKING:
    from dmltrain.trainer import BaseTrainer


def fit(run: Run) -> list[dict[str, Any]]:
    """Train (or evaluate) ``run`` in this process; returns the training log's rows.
    Raises ``StopForRequeue`` when the run stopped to go on in a later job."""
    try:
        rows = _fit(run)
    except BaseException as exc:
        _close(run, exc)
        _record_outcome(run, exc)
        _settle(run, failed=not isinstance(exc, StopForRequeue))
        raise
    _record_outcome(run, None)  # first: the training is done whatever on_close does
    _close(run, None)
    _settle(run, finished=True)
    return rows


def _settle(run: Run, failed: bool = False, finished: bool = False) -> None:
    """Last, every rank: what the store has in flight made durable (a drain from the
    node-local folder, the records copied to object storage). What cannot be is the job's
    error (exit status 2) when the run ``finished``; else a warning beside the run's own."""
    try:
        if run.made("checkpointer"):
            run.checkpointer.store.settle(run.trainer.dist.is_main, failed)
    except UserError as exc:
        if finished:
            raise
        run.trainer.warn(str(exc))
    finally:
        if run.made("run_dir_held"):
            run.run_dir_held.release_remote()


def _close(run: Run, error: BaseException | None) -> None:
    """The callbacks' ``on_close``; one that fails while the run fails already is a
    warning, so the run's own error is the one reported."""
    trainer = run.trainer
    for call in run.events.on_close:
        try:
            call(trainer, error)
        except Exception as exc:
            if error is None:
                raise
            trainer.warn(f"a callback's on_close failed too: {exc!r}")


def _record_outcome(run: Run, exc: BaseException | None) -> None:
    """Rank 0: how this job of the run ended, in RUN_DIR/outcome.json (read by
    ``dmltrain sweep status``). An evaluation leaves the run's record alone, and so does
    a job refused before it trained (a resume with other settings, checkpoints that do
    not load) in a directory that holds a run; a run's first job records its refusal."""
    trainer = run.trainer
    evaluating = trainer.config.checkpoint.evaluating
    if not trainer.dist.is_main or not run.made("run_dir") or evaluating:
        return
    refused = isinstance(exc, UserError) and not run.state.training
    if refused and rundir.holds_run(run.run_dir):
        return
    rundir.write_outcome(run.run_dir, exc, run.state.global_step, run.outcome)


def _fit(run: Run) -> list[dict[str, Any]]:
    """Assembly, then the loop or an evaluation; a failure said as what the job should do."""
    trainer = run.trainer
    # Signals are caught from here on (setup can take long); the loop acts on them.
    run.watcher = preemption.PreemptionWatcher(
        trainer.config.preemption.signal_names(), worker=trainer.dist.spawned
    )
    evaluating, results, failed = trainer.config.checkpoint.evaluating, None, True
    try:
        if evaluating:
            assemble_evaluation(run)
            stopped, results = None, [_evaluate(run)]
        else:
            assemble(run)
            stopped, results = Loop(run).train(), None
        run.tracker.finish(preempted=stopped is not None)
        failed = False
    except torch.OutOfMemoryError as exc:
        run.tracker.finish()
        raise profiling.out_of_memory(
            exc,
            run.run_dir / "profile",
            trainer.dist.rank,
            trainer.device,
            run.state.global_step,
            trainer.config,
            trainer.strategy.name,
            profiling.training_state_bytes(run.model, run.optimizers),
        ) from exc
    except Exception as exc:
        run.tracker.finish()
        lost = trainer.strategy.lost_peer(exc)
        if lost is None:  # this rank's own failure (or every rank's at once)
            if not isinstance(exc, (SharedError, NonFiniteError)):  # every rank's own
                trainer.strategy.announce_failure(exc)
            bad_data = contract.data(exc)
            if bad_data is not None:
                raise bad_data from None
            raise
        alone = isinstance(lost, PeerLost) and run.made("run_dir")
        event = rundir.alone(run.run_dir) if alone else None  # rank 0 stopped inside it
        if event is not None:
            raise PeerFailed(
                f"rank 0 stopped inside the callback event {event}, which only rank 0 "
                "runs: a collective called there (a barrier, an all_reduce, ...) waits for "
                "the other ranks, which never enter it, or meets their next one; call it "
                "in an event every rank runs (on_step_end), or none there. A bug, not a "
                "lost node: nothing is requeued"
            ) from exc
        if isinstance(lost, PeerLost):  # where a rank hangs, when the watchdog knows
            lost = run.events.explain(lost)
        raise lost from exc
    finally:
        run.events.on_stop()
        run.watcher.restore()
        for loader in (vars(run).get("train_loader"), vars(run).get("val_loader")):
            compat.stop_loader_workers(loader)
        if run.made("checkpointer"):
            run.checkpointer.close(failed)  # never exit with a write half done
        if run.made("run_dir_held"):
            run.run_dir_held.release()
        trainer.strategy.teardown()
    if stopped is not None:
        raise StopForRequeue(stopped)
    return results or run.state.log_rows


def _evaluate(run: Run) -> dict[str, Any]:
    """--evaluate / --predict: the loaded checkpoint's weights over the validation and
    test data, no training (``evaluation``). Rank 0 writes and shows the results."""
    trainer = run.trainer
    cfg, name = trainer.config.checkpoint, trainer.name
    test_set = trainer.create_test_dataset()
    test = None
    if test_set is not None:
        test = trainer.create_dataloader(samples.keyed(test_set, trainer.config.loop.seed), False)
    results: dict[str, Any] = {"checkpoint": cfg.evaluating, "ema": cfg.ema}
    signalled = run.watcher  # a preemption stops it, at the same batch on every rank
    run.evaluator = dataclasses.replace(
        run.evaluator,
        stop=lambda: bool(trainer.strategy.max_over_ranks([signalled.requested is not None])[0]),
    )
    with evaluating_model(run):
        if cfg.predict:
            if type(trainer).predict_step is TrainerHooks.predict_step:
                raise UserError(
                    f"--predict: {type(trainer).__name__} defines no predict_step(batch); "
                    "add one returning what to write for a batch"
                )
            loader = test or run.val_loader
            if loader is None:
                raise UserError(f"--predict: {name} has no test or validation dataset")
            path = run.evaluator.predict(loader, trainer.predict_step, run.run_dir, trainer.dist)
            run.progress.info(f"dmltrain: predicted with {cfg.evaluating} -> {path}")
            return {**results, "predictions": str(path)}
        if run.val_loader is None and test is None:
            raise UserError(f"--evaluate: {name} has no validation or test dataset")
        sets = {"val": (run.val_loader, trainer.val_step), "test": (test, trainer.test_step)}
        results.update(run.evaluator.evaluate(sets))
    path = run.run_dir / "eval_metrics.json"
    if trainer.dist.is_main:
        evaluation.write_metrics(path, results)
        shown = ", ".join(f"{k} {v:.6g}" for k, v in results.items() if "_" in k)
        run.progress.info(f"dmltrain: evaluated {cfg.evaluating}: {shown} -> {path}")
    return results


def spawn_workers(trainer: "BaseTrainer") -> list[dict[str, Any]]:
    """``--nprocs N``: start N workers here and wait (``processes.spawn_fits``)."""
    evaluating = trainer.config.checkpoint.evaluating
    name = trainer.name + ("-eval" if evaluating else "")
    given = trainer.config.run_dir
    if objects.is_uri(given):  # the workers' rank 0 checks the store
        run_dir = objects.mirror(given)
    else:
        run_dir = Path(objects.local(given or rundir.default_path(name, trainer.dist.job_id)))
        rundir.check(run_dir)
        given = str(run_dir)
    config = trainer.config.replace(
        run_dir=given, progress=progress.for_workers(trainer.config.loop.progress)
    )
    processes.spawn_fits(type(trainer), trainer.name, config, trainer.options, trainer.dist)
    if trainer.config.checkpoint.predict:
        return [{"predictions": str(run_dir / "predictions" / "predictions.pt")}]
    if evaluating:
        return [json.loads((run_dir / "eval_metrics.json").read_text())]
    return read_training_log(run_dir / "training_log.csv")

"""``dmltrain sweep --search``: the trials asked of an Optuna study, one at a time, each
an ordinary run that reports its validations to the study and may be pruned.

The study lives in the sweep's directory as Optuna's journal file (``study.journal``:
file locks on the shared file system, no server), or in ``--storage URL``. Its settings
(the sweep's experiment, flags, space, sampler, pruner) are a user attribute: a journal
of another sweep is refused. A sweep of ``--trials N`` has N slots, ``trial-<k>``; an
array task (or a process of ``--local``) readies its slot (``ready``) before it runs it:

- an empty slot asks the study for a trial and writes its ``args`` and ``trial.json``;
- a slot whose trial is running resumes its checkpoint (a requeued or resubmitted task),
  unless its run started and left none: that trial is failed in the study;
- a failed trial is run again (``--retry-failed K``) as a new trial of the same options,
  the old run kept beside as ``trial-<k>.failed-<attempt>``;
- a complete or pruned trial is done: the task ends at once.

Asking happens under one lock (``slots.lock``), so tasks that start together draw
distinct trials. Each slot's sampler is seeded by ``--space-seed`` and the slot.
"""

import csv
import dataclasses
import hashlib
import math
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError, first_line
from dmltrain.features.search import (
    SETTINGS,
    TRIAL_FILE,
    TrialFile,
    make_pruner,
    open_storage,
    optuna_module,
)
from dmltrain.records import rundir
from dmltrain.records.rundir import list_checkpoints
from dmltrain.tools.sweep import Sweep

SAMPLERS = ("tpe", "random", "grid", "cmaes")
JOURNAL = "study.journal"
FINISHED = ("complete", "pruned")  # a trial's states that no task runs again


@dataclasses.dataclass(frozen=True)
class Search:
    """What ``dmltrain sweep --search`` was asked (kept in sweep.json and the study)."""

    sampler: str
    pruner: str
    trials: int
    seed: int
    metric: str
    mode: str
    retry_failed: int = 0
    storage: str | None = None  # None: the journal in the sweep's directory


def check(search: Search, space: Mapping[str, Any]) -> None:
    """What Optuna could not take, said in one line before anything is submitted."""
    if search.sampler not in SAMPLERS:
        raise UserError(f"--search {search.sampler}: give one of {', '.join(SAMPLERS)}")
    make_pruner(search.pruner)
    distributions(space)
    if not search.metric.startswith(("val_", "train_")):
        raise UserError(
            f"--best-metric {search.metric}: a validation reports the training log's val_ and "
            "train_ columns only; give one of them (e.g. val_loss)"
        )
    if search.sampler == "grid":
        make_sampler(search, space, 0)  # lists only
        points = math.prod(len(v["values"] if isinstance(v, dict) else v) for v in space.values())
        if search.trials > points:
            raise UserError(
                f"--trials {search.trials}: the grid has {points} point(s); give at most that"
            )
    if search.retry_failed < 0:
        raise UserError("--retry-failed must be 0 or more")


def distributions(space: Mapping[str, Any]) -> dict[str, Any]:
    """The space (``dmltrain.tools.sweep.load_space``) as Optuna's distributions: a list
    or ``{values}`` is a choice, ``{low, high[, log]}`` a range (of integers when both
    ends are)."""
    optuna = optuna_module()
    made = {}
    for name, entry in space.items():
        if isinstance(entry, dict) and "low" in entry:
            low, high, log = entry["low"], entry["high"], bool(entry.get("log"))
            if isinstance(low, int) and isinstance(high, int):
                made[name] = optuna.distributions.IntDistribution(low, high, log=log)
            else:
                made[name] = optuna.distributions.FloatDistribution(low, high, log=log)
            continue
        values = entry["values"] if isinstance(entry, dict) else entry
        for value in values:
            if value is not None and not isinstance(value, bool | int | float | str):
                raise UserError(
                    f"--space: '{name}' holds {value!r}; a search chooses among numbers, "
                    "strings and booleans only"
                )
        made[name] = optuna.distributions.CategoricalDistribution(values)
    return made


def make_sampler(search: Search, space: Mapping[str, Any], slot: int) -> Any:
    """Slot ``slot``'s sampler: seeded apart from the other slots', so that tasks that
    start together do not draw the same options (a grid's points go by trial number)."""
    samplers = optuna_module().samplers
    # the seed and the slot, mixed: seeds 0 and 1 share no slot's draws
    seed = int.from_bytes(hashlib.sha256(f"{search.seed}:{slot}".encode()).digest()[:4], "big")
    if search.sampler == "grid":
        if any(isinstance(entry, dict) and "low" in entry for entry in space.values()):
            raise UserError(
                "--search grid takes lists and {values: [...]} only; give the ranges as lists"
            )
        grid = {k: v["values"] if isinstance(v, dict) else v for k, v in space.items()}
        # one seed for all: it orders the points, which the slots share out by number
        return samplers.GridSampler(grid, seed=search.seed)
    if search.sampler == "cmaes":
        return samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if search.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    return samplers.TPESampler(seed=seed)


def storage_of(sweep: Sweep, search: Search) -> str:
    return search.storage or str((sweep.directory / JOURNAL).resolve())


def create_study(sweep: Sweep, search: Search, asked: Mapping[str, Any]) -> None:
    """The sweep's study, made or found; one that another sweep made is refused."""
    optuna = optuna_module()
    where = storage_of(sweep, search)
    direction = "maximize" if search.mode == "max" else "minimize"
    try:
        study = optuna.create_study(
            study_name=sweep.directory.name,
            storage=open_storage(where),
            direction=direction,
            load_if_exists=True,
        )
    except ValueError as exc:  # the study is there, with the other direction
        raise UserError(f"{where} holds another study: {first_line(exc)}") from None
    settings = {**asked, "pruner": search.pruner}
    there = study.user_attrs.get(SETTINGS)
    if there is None:
        study.set_user_attr(SETTINGS, settings)
    elif there != settings:
        raise UserError(
            f"{where} holds the study {sweep.directory.name} of another sweep (other "
            "experiment, flags, space, sampler or pruner); pass another --name or --storage"
        )


def _study(sweep: Sweep, search: Search, slot: int) -> Any:
    space = sweep.load()["space"]
    return optuna_module().load_study(
        study_name=sweep.directory.name,
        storage=open_storage(storage_of(sweep, search)),
        sampler=make_sampler(search, space, slot),
        pruner=make_pruner(search.pruner),
    )


def search_of(sweep: Sweep) -> Search:
    return Search(**sweep.load()["search"])


def ready(sweep: Sweep, slot: int) -> str | None:
    """Make slot ``slot`` ready to run (see the module's text): None when it is, else how
    its trial ended (``complete``, ``pruned``, ``failed``)."""
    search = search_of(sweep)
    study = _study(sweep, search, slot)
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(sweep.directory.resolve() / "slots"))
    lock.acquire()
    try:
        return _ready(sweep, search, study, slot)
    finally:
        lock.release()


def _ready(sweep: Sweep, search: Search, study: Any, slot: int) -> str | None:
    state_of = optuna_module().trial.TrialState
    run = sweep.trial_dir(slot)
    path = run / TRIAL_FILE
    record = TrialFile.read(path) if path.is_file() else None
    if record is not None:
        frozen = study.get_trials(deepcopy=False)[record.number]
        state = frozen.state.name
        if state == "RUNNING":
            why = _lost(run)
            if why is None:
                return None  # its first start, or a resume of its checkpoint
            study.tell(record.number, state=state_of.FAIL)
            state = "FAIL"
            _say(f"trial {slot} {why}: it is failed in the study")
        if state.lower() in FINISHED:
            return state.lower()
        if state != "FAIL" or record.attempt >= search.retry_failed:
            return "failed"
        shutil.move(run, sweep.directory / f"trial-{slot}.failed-{record.attempt}")
        study.enqueue_trial(dict(frozen.params), skip_if_exists=False)
        _say(f"trial {slot} runs again (--retry-failed {search.retry_failed})")
    space = sweep.load()["space"]
    trial = study.ask(distributions(space))
    trial.set_user_attr("slot", slot)
    attempt = 0 if record is None else record.attempt + 1
    run.mkdir(parents=True, exist_ok=True)
    storage = search.storage or f"../{JOURNAL}"  # the journal beside: a moved sweep keeps it
    TrialFile(storage, study.study_name, trial.number, attempt, trial.params).write(path)
    sweep.write_args(slot, trial.params, ["--search-trial", str(path.resolve())])
    return None


def _say(line: str) -> None:
    """On stderr: an array task's ``dmltrain sweep ask`` prints the command line to run."""
    print(f"dmltrain sweep: {line}", file=sys.stderr, flush=True)


def fail_running(sweep: Sweep, slot: int) -> None:
    """A trial whose process ended without telling the study (killed) is failed in it."""
    path = sweep.trial_dir(slot) / TRIAL_FILE
    if not path.is_file() or rundir.in_use(sweep.trial_dir(slot)):  # another job runs it
        return
    search, number = search_of(sweep), TrialFile.read(path).number
    study = _study(sweep, search, slot)
    if study.get_trials(deepcopy=False)[number].state.name == "RUNNING":
        study.tell(number, state=optuna_module().trial.TrialState.FAIL)
        _say(f"trial {slot} ended without telling the study: it is failed in the study")


def corners(space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Options that show each value of the space once (a range by its two ends), each
    with the other options at their first: what is parsed before a search starts."""
    values = {
        name: [entry["low"], entry["high"]]
        if isinstance(entry, dict) and "low" in entry
        else (entry["values"] if isinstance(entry, dict) else entry)
        for name, entry in space.items()
    }
    first = {name: found[0] for name, found in values.items()}
    out = [first]
    for name, found in values.items():
        out += [{**first, name: value} for value in found[1:]]
    return out


def _lost(run: Path) -> str | None:
    """Why a trial the study holds as running cannot go on: its run is held by no job,
    started, and left no checkpoint (its node was lost) or failed; None when it can."""
    if rundir.in_use(run):
        return None
    outcome = rundir.read_outcome(run)
    status = None if outcome is None else outcome["status"]
    if status in ("stopped", "lost") or list_checkpoints(run / "checkpoints"):
        return None  # resumed from its checkpoint
    if status is not None:
        return f"ended {status}"
    if (run / "config.yaml").exists():
        return "was lost before its first checkpoint"
    return None  # asked, never started


def finished(sweep: Sweep, slot: int) -> bool:
    """Whether no task needs to run slot ``slot`` again (read from its run alone)."""
    run = sweep.trial_dir(slot)
    path = run / TRIAL_FILE
    if not path.is_file():
        return False
    outcome = rundir.read_outcome(run)
    status = None if outcome is None else outcome["status"]
    if status in ("done", "pruned"):
        return True
    if status in (None, "stopped", "lost"):
        return False
    return TrialFile.read(path).attempt >= search_of(sweep).retry_failed


def summary(sweep: Sweep) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """Each slot's row (options, state, value, steps) and the lines that follow the table:
    the counts by state, the best trial, the steps pruning saved; and what of the study or
    the trials' files could not be read (their rows then say what the runs' own records
    do), or None."""
    search = search_of(sweep)
    damaged: list[str] = []
    try:
        trials = _study(sweep, search, 0).get_trials(deepcopy=False)
    except Exception as exc:  # a journal truncated, deleted, moved, or not Optuna's
        trials = []
        damaged.append(f"the study {storage_of(sweep, search)} cannot be read ({first_line(exc)})")
    rows, saved, planned = [], 0, 0
    for slot in range(search.trials):
        run = sweep.trial_dir(slot)
        outcome = rundir.read_outcome(run) or {}
        row: dict[str, Any] = {"trial": slot, "number": None, "state": "pending"}
        try:
            record = TrialFile.read(run / TRIAL_FILE) if (run / TRIAL_FILE).is_file() else None
        except UserError:
            record = None
            damaged.append(f"{run / TRIAL_FILE} is not a trial file")
            row["state"] = outcome.get("status", "unknown")
        number = getattr(record, "number", None)
        if record is not None and not (isinstance(number, int) and 0 <= number < len(trials)):
            row.update(number=number, state=outcome.get("status", "unknown"))
            if trials:
                damaged.append(f"trial {slot}'s number {number!r} is not in the study")
            record = None
        if record is not None:
            frozen = trials[record.number]
            row.update(number=record.number, **frozen.params, state=frozen.state.name.lower())
            if row["state"] == "running" and outcome.get("status") in ("stopped", "lost"):
                row["state"] = "paused"
            row[search.metric] = frozen.value
            row["steps"] = ran = int(outcome.get("global_step", 0))
            plan = frozen.user_attrs.get("planned_steps")
            if row["state"] in FINISHED and isinstance(plan, int):
                planned += plan
                saved += plan - ran
        rows.append(row)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    lines = ["dmltrain sweep: " + ", ".join(f"{n} {state}" for state, n in counts.items())]
    scored = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None]
    if scored:
        pick = max if search.mode == "max" else min
        top = pick(scored, key=lambda t: t.value)
        slot = top.user_attrs.get("slot")
        lines.append(
            f"dmltrain sweep: best trial {slot} ({search.metric} {top.value:.6g}): "
            f"{sweep.trial_dir(slot)}"
        )
    else:
        lines.append(f"dmltrain sweep: no trial is complete yet ({search.metric})")
    if planned:
        lines.append(
            f"dmltrain sweep: pruning saved {saved} of {planned} steps ({saved / planned:.0%}) "
            "over the finished trials"
        )
    return rows, lines, "; ".join(damaged) or None


def write_table(sweep: Sweep, rows: list[dict[str, Any]] | None = None) -> None:
    """``trials.csv`` of a search: a row a slot, its options, state, value and steps."""
    rows = rows if rows is not None else summary(sweep)[0]
    names: list[str] = []
    for row in rows:
        names += [name for name in row if name not in names]
    with open(sweep.directory / "trials.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(sweep: Sweep) -> list[Path]:
    """Optuna's figures of the study, beside the sweep's curves: the optimisation history,
    each trial's reports by step, and the options' importances (from 2 complete trials)."""
    optuna_module()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as figures

    study = _study(sweep, search_of(sweep), 0)
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    drawn = {
        "search_history.png": figures.plot_optimization_history,
        "search_reports.png": figures.plot_intermediate_values,
    }
    if len(complete) >= 2:
        drawn["search_importances.png"] = figures.plot_param_importances
    written = []
    for name, draw in drawn.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            axes = draw(study)
        figure: Any = axes.figure
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        try:
            figure.savefig(sweep.directory / name, dpi=100)
        except OSError as exc:
            raise UserError(f"cannot write {sweep.directory / name}: {exc.strerror}") from None
        finally:
            plt.close(figure)
        written.append(sweep.directory / name)
    return written

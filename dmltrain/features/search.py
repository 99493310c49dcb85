"""A search's trial (``--search-trial``): each validation's ``--best-metric`` is reported
to an Optuna study, and the study's pruner may end the run, on every rank at one step.

``dmltrain sweep --search`` makes the study and writes each trial's ``trial.json`` (the
study's storage, its name, the trial's number; ``dmltrain.tools.search``). Rank 0 alone
talks to the study; one collective at each validation gives its decision to every rank.
A resumed trial reports no step twice: the study holds what an earlier job reported, and
a step reported then was not pruned then, so the resumed run goes on past it as it did.
The trial's value is its best report; a run that fails (not one stopped to go on) fails it.
"""

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dmltrain.callback import Callback, Stop, TrainerView
from dmltrain.errors import PeerLost, StopForRequeue, UserError, first_line

TRIAL_FILE = "trial.json"
PRUNERS = ("median", "asha", "hyperband", "none")
SETTINGS = "dmltrain"  # the study's user attribute holding the sweep's settings


def optuna_module() -> Any:
    """Optuna, quiet but for warnings, or one line on how to install it."""
    try:
        import optuna
    except ImportError:
        raise UserError(
            "a search needs Optuna: pip install 'dmltrain[search]' (or pip install optuna)"
        ) from None
    optuna.logging.set_verbosity(logging.WARNING)
    return optuna


def open_storage(where: str) -> Any:
    """An Optuna storage: a journal file (a path: no server, file locks only) or the URL
    of a database (``sqlite:///...``, ``postgresql://...``)."""
    optuna = optuna_module()
    try:
        if "://" in where:
            return optuna.storages.RDBStorage(where)
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(where))
    except Exception as exc:  # a bad URL, a driver missing, a file that cannot be written
        raise UserError(
            f"the search's storage {where} cannot be opened: {first_line(exc)}"
        ) from None


def make_pruner(name: str, planned_steps: int | None = None) -> Any:
    """Optuna's pruner named ``name`` (``PRUNERS``). ASHA keeps the best third of the
    trials at a ninth and at a third of a trial's ``planned_steps`` (Hyperband's brackets
    start at a 27th), so its rungs fall on reports at any validation interval; Optuna's
    own default (rungs from a hundredth of the first trial's steps, kept for a stream of
    unknown length) stops nearly every trial at its first report."""
    pruners = optuna_module().pruners
    if name not in PRUNERS:
        raise UserError(f"--pruner {name}: give one of {', '.join(PRUNERS)}")
    if name == "median":
        return pruners.MedianPruner()
    if name == "none":
        return pruners.NopPruner()
    if planned_steps is None:  # a stream of unknown length: Optuna's own
        return pruners.SuccessiveHalvingPruner() if name == "asha" else pruners.HyperbandPruner()
    if name == "asha":
        return pruners.SuccessiveHalvingPruner(
            min_resource=max(1, planned_steps // 9), reduction_factor=3
        )
    return pruners.HyperbandPruner(
        min_resource=max(1, planned_steps // 27), max_resource=planned_steps, reduction_factor=3
    )


@dataclasses.dataclass(frozen=True)
class TrialFile:
    """What ``trial.json`` says: the study's ``storage`` (a URL, or a journal path
    relative to the file's folder), the study's name, the trial's number, its attempt."""

    storage: str
    study: str
    number: int
    attempt: int = 0
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @staticmethod
    def read(path: Path) -> "TrialFile":
        try:
            found = json.loads(path.read_text())
            return TrialFile(**found)
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(
                f"--search-trial {path} is not a trial of a search ({first_line(exc)}); "
                "dmltrain sweep --search writes it: leave the flag out to train alone"
            ) from None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    def where(self, path: Path) -> str:
        """The storage, a journal path made whole against ``path``'s folder."""
        return self.storage if "://" in self.storage else str(path.parent / self.storage)


class SearchTrial(Callback):
    """Every rank: reports and pruning at each validation; rank 0 holds the study."""

    def __init__(
        self,
        path: Path,
        metric: str,
        planned_steps: int | None,
        is_main: bool,
        max_over_ranks: Callable[[list[int]], list[int]],
        broadcast_object: Callable[[Any], Any],
    ) -> None:
        self.metric = metric
        self.max_over_ranks = max_over_ranks
        self.trial: Any = None  # rank 0's optuna.Trial
        self.reported: dict[int, float] = {}
        self.ended = False
        problem, pruner = None, ""
        if is_main:
            try:
                pruner = self._open(path, planned_steps)
            except UserError as exc:
                problem = str(exc)
        problem, self.pruner = broadcast_object((problem, pruner))
        if problem:
            raise UserError(problem)

    def _open(self, path: Path, planned_steps: int | None) -> str:
        """The study and the trial, which must still be running; the steps it holds. The
        steps the run plans are the trial's ``planned_steps`` (what pruning saves)."""
        optuna = optuna_module()
        record = TrialFile.read(path)
        storage = open_storage(record.where(path))
        try:
            study_id = storage.get_study_id_from_name(record.study)
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, record.number)
        except KeyError:
            raise UserError(
                f"--search-trial {path}: the storage holds no trial {record.number} of study "
                f"{record.study}; run the search's dmltrain sweep command again"
            ) from None
        settings = storage.get_study_user_attrs(study_id).get(SETTINGS, {})
        pruner = str(settings.get("pruner", "none"))
        study = optuna.load_study(
            study_name=record.study, storage=storage, pruner=make_pruner(pruner, planned_steps)
        )
        frozen = storage.get_trial(trial_id)
        if frozen.state != optuna.trial.TrialState.RUNNING:
            raise UserError(
                f"--search-trial {path}: trial {record.number} of the search is "
                f"{frozen.state.name.lower()} and takes no more reports; leave the flag out "
                "to train this run alone"
            )
        self.study, self.number = study, record.number
        self.trial = optuna.trial.Trial(study, trial_id)
        self.reported = dict(frozen.intermediate_values)
        if planned_steps is not None and "planned_steps" not in frozen.user_attrs:
            self.trial.set_user_attr("planned_steps", planned_steps)
        return pruner

    def should_stop(self, trainer: TrainerView, row: Mapping[str, Any]) -> Stop | None:
        if self.metric not in row:  # every rank alike: the row is the same on each
            columns = ", ".join(k for k in row if k.startswith(("val_", "train_")))
            raise UserError(
                f"--best-metric {self.metric} is not in the validation's row ({columns}): the "
                "search cannot rank this trial; give one of those to dmltrain sweep"
            )
        value, step = row.get(self.metric), int(row["step"])
        prune = 0
        if self.trial is not None and value is not None and step not in self.reported:
            self.trial.report(float(value), step)
            self.reported[step] = float(value)
            prune = int(self.trial.should_prune())
        if not self.max_over_ranks([prune])[0]:  # every rank, at every validation
            return None
        if self.trial is not None:
            self._tell(state="PRUNED")
        shown = "none" if value is None else f"{float(value):.6g}"
        return Stop(
            "pruned",
            f"pruned by the search ({self.pruner} pruner) at global step {step}, "
            f"{self.metric} {shown}; the checkpoint is kept",
        )

    def on_train_end(self, trainer: TrainerView) -> None:
        """Rank 0: the trial's value is its best report (min or max as the study goes)."""
        if self.trial is None or self.ended:
            return
        values = [v for v in self.reported.values() if v == v]
        if not values:
            trainer.warn(
                f"no validation reported --best-metric {self.metric}: the search fails this "
                "trial; give a metric of the training log's val_ columns"
            )
            self._tell(state="FAIL")
            return
        maximize = self.study.direction.name == "MAXIMIZE"
        self._tell(value=max(values) if maximize else min(values))

    def on_close(self, trainer: TrainerView, error: BaseException | None) -> None:
        """Rank 0: a run that failed fails its trial; one stopped to go on keeps it running."""
        if self.trial is None or self.ended or error is None:
            return
        if isinstance(error, StopForRequeue | PeerLost):
            return
        try:
            self._tell(state="FAIL")
        except Exception as exc:  # the run's own error is the one to report
            trainer.warn(f"the search's study was not told that this trial failed: {exc!r}")

    def _tell(self, value: float | None = None, state: str = "COMPLETE") -> None:
        state_of = optuna_module().trial.TrialState
        self.ended = True
        self.study.tell(self.number, value, state=state_of[state])

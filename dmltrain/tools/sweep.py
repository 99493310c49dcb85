"""``dmltrain sweep``: the trials of a search, each an ordinary run in its own directory.

``sweep.yaml`` maps options to what they take: a list is a grid axis (every value, in
every combination), ``{values: [...]}`` one value drawn at random, ``{low, high}`` a
uniform draw (``log: true``: log-uniform; integers when both ends are). The trials are the
grid's combinations, each with ``--trials N`` draws of the random options (seeded by
``--seed``). Flags given on the command line are the same for every trial.

The sweep lives in ``runs/<name>/``: ``sweep.json`` (what was asked), ``trials.csv``
(trial, options, status) and ``trial-<i>/`` per trial, whose ``args`` file is the trial's
command line and which is the trial's run directory: a preempted trial requeues and
resumes there like any run, and one whose ``outcome.json`` says done is never started
again. The trials run as a Slurm job array (``dmltrain.tools.sweep_submit``) or on this machine
(``--local``).
"""

import csv
import io
import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import yaml

from dmltrain.errors import UserError, first_line
from dmltrain.records import rundir
from dmltrain.records.training_log import read_training_log

# Settings the sweep gives each trial itself.
SWEEP_OWN = frozenset({"run_dir", "resume", "status_file", "config", "print_config"})


def load_space(path: Path, known: set[str]) -> dict[str, Any]:
    """``sweep.yaml``, checked: option names of the experiment (``known``, with ``_``),
    and each entry a non-empty list, ``{values: [...]}`` or ``{low, high[, log]}``."""
    try:
        space = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--space {path}: cannot be read: {first_line(exc)}") from None
    if not isinstance(space, dict) or not space:
        raise UserError(f"--space {path}: give a mapping of options to values; it is empty")
    checked = {}
    for raw, entry in space.items():
        name = str(raw).replace("-", "_")
        if name not in known:
            raise UserError(f"--space {path}: '{raw}' is not an option of this experiment")
        if name in SWEEP_OWN:
            raise UserError(
                f"--space {path}: '{raw}' is the sweep's to set (each trial has its own run "
                "directory, and resumes there); leave it out of the space"
            )
        where = f"--space {path}: '{raw}'"
        if isinstance(entry, dict) and set(entry) == {"values"}:
            entry = {"values": entry["values"]}
            if not isinstance(entry["values"], list) or not entry["values"]:
                raise UserError(f"{where}: values must be a non-empty list")
        elif isinstance(entry, dict) and {"low", "high"} <= set(entry) <= {"low", "high", "log"}:
            low, high = entry["low"], entry["high"]
            numbers = all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)
            )
            if not numbers or not low < high or (entry.get("log") and low <= 0):
                raise UserError(f"{where}: low and high must be numbers, low < high (> 0 with log)")
        elif not isinstance(entry, list) or not entry:
            raise UserError(
                f"{where}: give a list (grid), {{values: [...]}} or {{low, high, log}} (random)"
            )
        checked[name] = entry
    return checked


def expand(space: dict[str, Any], trials: int, seed: int) -> list[dict[str, Any]]:
    """The trials: every combination of the grid's lists, each with ``trials`` draws of
    the random options."""
    grid = {name: entry for name, entry in space.items() if isinstance(entry, list)}
    drawn = {name: entry for name, entry in space.items() if not isinstance(entry, list)}
    if trials > 1 and not drawn:
        raise UserError(
            f"--trials {trials}: the space has no random option ({{low, high}} or "
            "{values: [...]}) to draw; leave --trials out for a grid"
        )
    generator = random.Random(seed)
    out = []
    for combination in itertools.product(*grid.values()):
        for _ in range(trials):
            options = dict(zip(grid, combination, strict=True))
            for name, entry in drawn.items():
                options[name] = _draw(entry, generator)
            out.append({name: options[name] for name in space})  # in the file's order
    return out


def _draw(entry: dict[str, Any], generator: random.Random) -> Any:
    if "values" in entry:
        return generator.choice(entry["values"])
    low, high = entry["low"], entry["high"]
    if entry.get("log"):
        value = math.exp(generator.uniform(math.log(low), math.log(high)))
    else:
        value = generator.uniform(low, high)
    if isinstance(low, int) and isinstance(high, int):
        return min(high, max(low, round(value)))
    return float(f"{value:.6g}")  # as it is written in trials.csv and the command line


def given(args: list[str], flag: str) -> bool:
    """Whether command line ``args`` sets ``flag`` (``--flag V`` or ``--flag=V``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flags(options: dict[str, Any]) -> list[str]:
    """A trial's options as command-line flags (booleans as ``--x``/``--no-x``)."""
    out = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def check_trials(
    trials: list[dict[str, Any]],
    fixed: list[str],
    experiment: str,
    check_flags: Callable[[list[str]], object],
) -> None:
    """Each trial's command line parsed as the experiment would; the first refused is one
    line naming the trial and the option."""
    for i, options in enumerate(trials):
        stderr = io.StringIO()
        try:
            with redirect_stderr(stderr):
                check_flags([experiment, *fixed, *flags(options)])
        except (UserError, SystemExit) as exc:
            said = stderr.getvalue().strip().splitlines()
            why = said[-1] if said else first_line(exc)
            why = why.removeprefix(f"dmltrain {experiment}: error: ").removeprefix(
                "dmltrain: error: "
            )
            shown = ", ".join(f"{k}={v}" for k, v in options.items())
            raise UserError(f"trial {i} ({shown}) is refused: {why}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path} cannot be read ({first_line(exc)}): restore it, or start "
            "the sweep again under another --name"
        ) from None
    if not isinstance(found, dict):
        raise UserError(f"{path} is not a sweep's record: restore it, or use another --name")
    return found


class Sweep:
    """A sweep's directory: what was asked, its trials and where each stands."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.file = directory / "sweep.json"

    def create(
        self,
        experiment: str,
        fixed: list[str],
        trials: list[dict[str, Any]],
        search: dict[str, Any] | None = None,
    ) -> bool:
        """Write the sweep, or check that the one there is the same (a resubmission).
        A search (``search``: its settings and space) writes each trial's command line
        when the trial is asked for (``write_args``). Whether the sweep was there."""
        asked = {"experiment": experiment, "fixed": fixed, "trials": trials, **(search or {})}
        if self.file.exists():
            there = _read_json(self.file)
            if {k: there.get(k) for k in asked} != asked:
                raise UserError(
                    f"{self.directory} holds another sweep (other experiment, flags, trials or "
                    "search); pass another --name"
                )
            return True
        self.directory.mkdir(parents=True, exist_ok=True)
        self.file.write_text(json.dumps({**asked, "jobs": []}, indent=1) + "\n")
        for i, options in enumerate(trials):
            self.write_args(i, options)
        if trials:
            self.write_table()
        return False

    def write_args(self, i: int, options: dict[str, Any], extra: Sequence[str] = ()) -> None:
        """Trial ``i``'s ``args``: its command line, run in its own directory, the sweep's
        trials one group of runs (``--group``)."""
        record = self.load()
        fixed = record["fixed"]
        group = ["--group", self.directory.name]
        group = [] if given(fixed, "--group") or given(fixed, "--wandb-group") else group
        run = self.trial_dir(i)
        run.mkdir(exist_ok=True)
        command = [record["experiment"], *fixed, *group, *flags(options), *extra]
        (run / "args").write_text("\n".join([*command, "--run-dir", str(run.resolve())]) + "\n")

    def options(self, i: int) -> dict[str, Any]:
        """Trial ``i``'s options: the grid's, or what the search drew ({} before)."""
        record = self.load()
        if "search" not in record:
            return dict(record["trials"][i])
        path = self.trial_dir(i) / "trial.json"
        try:
            return dict(json.loads(path.read_text())["params"])
        except (OSError, ValueError, KeyError):
            return {}

    def searching(self) -> bool:
        """Whether the sweep is a search (``dmltrain.tools.search``)."""
        return "search" in self.load()

    def count(self) -> int:
        """How many trials the sweep runs (a search's --trials)."""
        record = self.load()
        return int(record["search"]["trials"]) if "search" in record else len(record["trials"])

    def load(self) -> dict[str, Any]:
        if not self.file.is_file():
            raise UserError(f"{self.directory} is not a sweep (no sweep.json)")
        return _read_json(self.file)

    def trial_dir(self, i: int) -> Path:
        return self.directory / f"trial-{i}"

    def args(self, i: int) -> list[str]:
        """Trial ``i``'s command line, run in its directory where the sweep is now (a copied
        or moved sweep runs its trials in the copy)."""
        lines = (self.trial_dir(i) / "args").read_text().splitlines()
        here = self.trial_dir(i).resolve()
        if "--run-dir" not in lines[:-1]:
            lines += ["--run-dir", ""]
        for flag, value in (("--run-dir", here), ("--search-trial", here / "trial.json")):
            if flag in lines[:-1]:
                at = lines.index(flag) + 1
                lines[at] = str(value)
        return lines

    def add_job(self, job: str) -> None:
        record = self.load()
        record["jobs"].append(job)
        self.file.write_text(json.dumps(record, indent=1) + "\n")

    def left(self) -> list[int]:
        """The trials not done yet."""
        trials = self.load()["trials"]
        return [i for i in range(len(trials)) if self.outcome(i) != "done"]

    def outcome(self, i: int) -> str:
        """What the trial's run directory says: pending (never ran), running (started, no
        job ended), or its outcome.json's status (done, stopped, failed, ...)."""
        return str(self._record(i)["status"])

    def _record(self, i: int) -> dict[str, Any]:
        """The trial's outcome.json, or a status of pending or running without one."""
        run = self.trial_dir(i)
        record = rundir.read_outcome(run)
        if record is not None:
            return record
        return {"status": "running" if (run / "config.yaml").exists() else "pending"}

    def rows(
        self, metric: str, mode: str = "min", scheduler: dict[int, str] | None = None
    ) -> list[dict[str, Any]]:
        """One row a trial: its options, status (the scheduler's pending/running wins over
        the run directory's), the best ``metric`` so far and the last line of a failure."""
        out = []
        for i, options in enumerate(self.load()["trials"]):
            record = self._record(i)
            status = str(record["status"])
            queued = (scheduler or {}).get(i)
            if queued and status != "done":
                status = queued
            elif status == "stopped":
                status = "preempted"  # stopped to go on, and no job holds it now
            log = self.trial_dir(i) / "training_log.csv"
            rows = read_training_log(log) if log.exists() else []
            values = [row.get(metric, math.nan) for row in rows]
            values = [v for v in values if v == v]  # NaN: not validated in that row
            value = (min if mode == "min" else max)(values) if values else None
            last = record.get("message", "") if status == "failed" else ""
            out.append({"trial": i, **options, "status": status, metric: value, "last": last})
        return out

    def write_table(self, rows: list[dict[str, Any]] | None = None) -> None:
        """``trials.csv``: trial, the options, status."""
        trials = self.load()["trials"]
        rows = rows or [{"trial": i, **o, "status": self.outcome(i)} for i, o in enumerate(trials)]
        names = ["trial", *trials[0], "status"]
        with open(self.directory / "trials.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, names, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)


def best(rows: list[dict[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    """The row with the best ``metric`` (``min`` or ``max``)."""
    scored = [row for row in rows if row.get(metric) is not None]
    if not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda row: row[metric])

"""MLflow tracking (``--tracker mlflow``; ``pip install 'dmltrain[mlflow]'``), and the sync
that sends a run directory's record to a tracking store (``dmltrain mlflow-sync``).

The tracker is an installed one (entry-point group ``dmltrain.trackers``, dmltrain's own
``setup.cfg``), rank 0's. The tracking store is MLflow's choice: ``MLFLOW_TRACKING_URI``,
a server, or on offline compute nodes a file store or SQLite file on a shared file system.

Nothing depends on the store being up: rank 0 appends whatever it tracks to
``RUN_DIR/mlflow/journal.jsonl`` before sending it. A store that cannot be reached at the
start, or fails mid-run, is one line, and the job goes on with the journal alone; the next
job of the run, or ``dmltrain mlflow-sync RUN_DIR``, sends what the store lacks (a metric
point by its key and step, a param or tag by its key, an artifact by its path and size),
so sending twice adds nothing.

One run across jobs: its id is kept in the checkpoints (as every tracker's) and in
``RUN_DIR/mlflow/runs.json`` by tracking URI; a later job, on any number of processes,
continues it, and a step logged again (a resume from an earlier checkpoint) is not logged
twice: the first value logged at a step stays.
"""

import json
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError, first_line
from dmltrain.features.images import is_figure
from dmltrain.features.tracking import Tracker, TrackerStart
from dmltrain.records.files import append_own
from dmltrain.runtime import launch

JOURNAL, RUNS = "journal.jsonl", "runs.json"
ARTIFACTS = ("training_log.csv", "config.yaml", "diagnostics.json")  # at the end of each job
MAX_PARAM, MAX_KEY = 6000, 250  # MLflow's limits on a param's value and a key
BATCH = 100  # params or tags in one request (MLflow's limit); metrics: 1000


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise UserError("--tracker mlflow needs MLflow: pip install 'dmltrain[mlflow]'") from None
    return mlflow


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config's values as MLflow params: nested keys joined with dots, values as text
    cut to MLflow's limit."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}".replace(" ", "_")[:MAX_KEY]
        if isinstance(value, dict):
            params.update(flatten(value, name + "."))
        else:
            params[name] = str(value)[:MAX_PARAM]
    return params


class Journal:
    """``RUN_DIR/mlflow``: what rank 0 tracked, one JSON record a line, and the run's id on
    each tracking store it was sent to."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.file = directory / JOURNAL

    def records(self, say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """The journal's records. A line cut short by a kill is left out (what it held was
        not sent either), and so is a line that is no record (edited by hand, another
        program's), said in one line through ``say``: it must not fail the store or the
        run that reads them."""
        if not self.file.is_file():
            return []
        records, foreign = [], []
        for number, line in enumerate(self.file.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if _is_record(record):
                records.append(record)
            else:
                foreign.append(number)
        if foreign and say is not None:
            shown = ", ".join(map(str, foreign[:5])) + (" ..." if len(foreign) > 5 else "")
            say(
                f"dmltrain: mlflow: {self.file} line(s) {shown} are no record of dmltrain's; "
                "left out"
            )
        return records

    def append(self, record: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        append_own(self.file, f"{json.dumps(record)}\n".encode())

    def runs(self) -> dict[str, str]:
        path = self.directory / RUNS
        try:
            found = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return found if isinstance(found, dict) else {}

    def keep_run(self, uri: str, run_id: str) -> None:
        runs = {**self.runs(), uri: run_id}
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / RUNS).write_text(json.dumps(runs, indent=1) + "\n")


# The fields each kind of record holds (the journal's own lines).
_FIELDS = {
    "run": ("experiment", "name"),
    "params": ("values",),
    "tags": ("values",),
    "status": ("value",),
    "metrics": ("values", "step", "time"),
    "artifact": ("path", "to"),
}


def _is_record(record: Any) -> bool:
    if not isinstance(record, dict) or record.get("kind") not in _FIELDS:
        return False
    if not all(name in record for name in _FIELDS[record["kind"]]):
        return False
    return not ("values" in record and not isinstance(record["values"], dict))


def last_steps(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The highest step each metric was logged at."""
    last: dict[str, int] = {}
    for record in records:
        if record["kind"] == "metrics":
            for key in record["values"]:
                last[key] = max(last.get(key, -1), record["step"])
    return last


class Remote:
    """The run on one tracking store, and what to send it."""

    def __init__(self, client: Any, run_id: str, run_dir: Path) -> None:
        self.client, self.run_id, self.run_dir = client, run_id, run_dir

    @classmethod
    def open(cls, uri: str, run: dict[str, Any], run_id: str | None, run_dir: Path) -> "Remote":
        """The run ``run_id`` on the store at ``uri`` (it must be there), or a new one in
        the journal's experiment."""
        client = _mlflow().MlflowClient(tracking_uri=uri)
        if run_id is not None:
            client.get_run(run_id)
            return cls(client, run_id, run_dir)
        experiment = client.get_experiment_by_name(run["experiment"])
        experiment_id = (
            client.create_experiment(run["experiment"])
            if experiment is None
            else experiment.experiment_id
        )
        made = client.create_run(experiment_id, run_name=run["name"])
        return cls(client, made.info.run_id, run_dir)

    def send(self, records: list[dict[str, Any]]) -> None:
        """The records as they are, in order (no check of what the store has)."""
        from mlflow.entities import Metric, Param, RunTag

        metrics, params, tags = [], [], []
        for record in records:
            kind = record["kind"]
            if kind == "metrics":
                step, at = record["step"], record["time"]
                metrics += [Metric(k, v, at, step) for k, v in record["values"].items()]
            elif kind == "params":
                params += [Param(k, v) for k, v in record["values"].items()]
            elif kind == "tags":
                tags += [RunTag(k, v) for k, v in record["values"].items()]
            elif kind == "artifact":
                self._artifact(record)
            elif kind == "status" and record["value"] == "RUNNING":  # a job continues it
                self.client.update_run(self.run_id, status="RUNNING")
            elif kind == "status":  # FINISHED, with its end time
                self.client.set_terminated(self.run_id, record["value"])
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])
        for i in range(0, len(tags), BATCH):
            self.client.log_batch(self.run_id, tags=tags[i : i + BATCH])
        for i in range(0, len(metrics), 10 * BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 10 * BATCH])

    def _artifact(self, record: dict[str, Any]) -> None:
        path = self.run_dir / record["path"]
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), record["to"] or None)
        elif path.is_file():
            self.client.log_artifact(self.run_id, str(path), record["to"] or None)

    def missing(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records, less what the store has already: a metric point by key and step, a
        param or tag by key (and value), an artifact by path and size (each job records
        the same files: the last record of each); the last status."""
        there = self.client.get_run(self.run_id)
        have_steps: dict[str, set[int]] = {}
        left: list[dict[str, Any]] = []
        params: dict[str, str] = {}
        tags: dict[str, str] = {}
        artifacts: dict[tuple[str, str], dict[str, Any]] = {}
        for record in records:
            kind = record["kind"]
            if kind == "params":
                params.update(record["values"])
            elif kind == "tags":
                tags.update(record["values"])
            elif kind == "metrics":
                values = {}
                for key, value in record["values"].items():
                    if key not in have_steps:
                        history = self.client.get_metric_history(self.run_id, key)
                        have_steps[key] = {point.step for point in history}
                    if record["step"] not in have_steps[key]:
                        values[key] = value
                        have_steps[key].add(record["step"])
                if values:
                    left.append({**record, "values": values})
            elif kind == "artifact":
                artifacts[record["path"], record["to"]] = record
        listed: dict[str, dict[str, int]] = {}  # folder -> name -> size, one listing each
        left += [record for record in artifacts.values() if self._lacks(record, listed)]
        params = {k: v for k, v in params.items() if k not in there.data.params}
        tags = {k: v for k, v in tags.items() if there.data.tags.get(k) != v}
        statuses = [r for r in records if r["kind"] == "status"]
        if statuses and there.info.status != statuses[-1]["value"]:
            left.append(statuses[-1])
        first = [{"kind": "params", "values": params}] if params else []
        first += [{"kind": "tags", "values": tags}] if tags else []
        return first + left

    def _lacks(self, record: dict[str, Any], listed: dict[str, dict[str, int]]) -> bool:
        """Whether the store lacks the artifact (``listed``: the folders read so far)."""
        path = self.run_dir / record["path"]
        if not path.is_file():
            return path.is_dir()  # a sharded checkpoint: sent again (files overwritten)
        folder = record["to"]
        if folder not in listed:
            listed[folder] = {
                Path(info.path).name: info.file_size
                for info in self.client.list_artifacts(self.run_id, folder or None)
            }
        return listed[folder].get(path.name) != path.stat().st_size


class MlflowTracker(Tracker):
    """Rank 0's MLflow run: journal first, then the store while it answers."""

    def __init__(self, start: TrackerStart) -> None:
        mlflow = _mlflow()
        launch.mlflow_defaults()
        self.say, self.run_dir = start.say, start.run_dir
        self.settings = start.settings
        self.journal = Journal(start.run_dir / "mlflow")
        records = self.journal.records(start.say)
        self.logged = last_steps(records)
        self.step = start.global_step
        run = next((r for r in records if r["kind"] == "run"), None)
        this_job: list[dict[str, Any]] = []
        if run is None:  # the run's first job
            experiment = start.settings.mlflow_experiment or start.experiment
            name = start.settings.mlflow_run_name or start.run_dir.name
            run = {"kind": "run", "experiment": experiment, "name": name}
            this_job += [run, {"kind": "params", "values": flatten(start.config)}]
        tags = {"dmltrain.experiment": start.experiment, **start.tags}
        if start.settings.group:
            tags["group"] = start.settings.group
        this_job += [{"kind": "tags", "values": tags}, {"kind": "status", "value": "RUNNING"}]
        for record in this_job:
            self.journal.append(record)
        self.uri = str(mlflow.get_tracking_uri())
        runs = self.journal.runs()  # by store: the checkpoint's id is of the store it had
        self.run_id = runs.get(self.uri, None if runs else start.run_id)
        self.remote: Remote | None = None
        try:
            self.remote = Remote.open(self.uri, run, self.run_id, self.run_dir)
            self.run_id = self.remote.run_id
            self.journal.keep_run(self.uri, self.run_id)
            # what earlier jobs could not send, and this job's first records
            self.remote.send(self.remote.missing(records + this_job))
        except Exception as exc:
            self._offline(exc)
        else:
            self.say(f"dmltrain: mlflow run {self.run_id} of {run['experiment']!r} at {self.uri}")

    def _offline(self, exc: BaseException) -> None:
        self.remote = None
        self.say(
            f"dmltrain: mlflow: {self.uri} failed ({first_line(exc)}); this job logs to "
            f"{self.journal.file} alone, and 'dmltrain mlflow-sync {self.run_dir}' sends it "
            "(as does the run's next job)"
        )

    def _record(self, record: dict[str, Any]) -> None:
        self.journal.append(record)
        if self.remote is not None:
            try:
                self.remote.send([record])
            except Exception as exc:
                self._offline(exc)

    def log(self, metrics: dict[str, Any], global_step: int) -> None:
        self.step = global_step
        values = {
            key: float(value)
            for key, value in metrics.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and global_step > self.logged.get(key, -1)
        }
        if not values:
            return
        for key in values:
            self.logged[key] = global_step
        stamp = int(time.time() * 1000)
        self._record({"kind": "metrics", "step": global_step, "time": stamp, "values": values})

    def summary(self, values: dict[str, Any]) -> None:
        self.log(values, self.step)

    def log_images(self, images: dict[str, Any], global_step: int) -> None:
        for name, image in images.items():
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
            path = self.journal.directory / "images" / safe / f"step-{global_step}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            if is_figure(image):
                image.savefig(path)
            else:
                from matplotlib import pyplot

                pyplot.imsave(path, image[:, :, 0] if image.shape[-1] == 1 else image, cmap="gray")
            relative = str(path.relative_to(self.run_dir))
            self._record({"kind": "artifact", "path": relative, "to": f"images/{safe}"})

    def finish(self, preempted: bool = False) -> None:
        for name in ARTIFACTS:
            self._record({"kind": "artifact", "path": name, "to": ""})
        best = self.run_dir / "checkpoints" / "best.pt"
        if self.settings.mlflow_log_checkpoint and best.exists():
            target = best.resolve()
            relative = str(target.relative_to(self.run_dir.resolve()))
            self._record({"kind": "artifact", "path": relative, "to": "checkpoints"})
        if not preempted:  # a preempted run stays RUNNING: a later job continues it
            self._record({"kind": "status", "value": "FINISHED"})


def create(start: TrackerStart) -> Tracker:
    """The entry point ``dmltrain.trackers: mlflow``."""
    return MlflowTracker(start)


def sync(run_dir: Path, uri: str | None, say: Callable[[str], None]) -> str:
    """``dmltrain mlflow-sync``: the run directory's journal to the store at ``uri`` (by
    default the one the run logged to), what the store lacks only; returns the run id."""
    launch.mlflow_defaults()
    journal = Journal(run_dir / "mlflow")
    records = journal.records(say)
    run = next((r for r in records if r["kind"] == "run"), None)
    if run is None:
        raise UserError(f"{run_dir} holds no MLflow journal (mlflow/{JOURNAL}): was it run "
                        "with --tracker mlflow?")  # fmt: skip
    runs = journal.runs()
    if uri is None:
        if len(runs) != 1:
            raise UserError(f"name the tracking store: dmltrain mlflow-sync {run_dir} --to URI")
        uri = next(iter(runs))
    try:
        remote = Remote.open(uri, run, runs.get(uri), run_dir)
        journal.keep_run(uri, remote.run_id)
        left = remote.missing(records)
        remote.send(left)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"mlflow-sync to {uri}: {first_line(exc)}") from None
    points = sum(len(r["values"]) for r in left if r["kind"] == "metrics")
    files = sum(r["kind"] == "artifact" for r in left)
    say(f"dmltrain: mlflow-sync: run {remote.run_id} at {uri}: sent {points} metric points, "
        f"{files} artifacts, {len(left)} records in all")  # fmt: skip
    return str(remote.run_id)

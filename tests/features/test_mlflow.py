"""--tracker mlflow (dmltrain/features/mlflow_tracker.py) against a real MLflow tracking
server, started here on 127.0.0.1 (``mlflow server``, a SQLite backend store, artifacts
served from a local directory), and against a SQLite file with no server; everything is
read back with MLflow's own client."""

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import AT_ONCE, cli_env, run_cli, wait_for
from mlflow import MlflowClient  # the dev extra installs MLflow, its server included

TINY = ["tiny", "--epochs", "2", "--batch-size", "8", "--progress", "off", "--log-every", "3",
        "--tracker", "mlflow"]  # fmt: skip


class Server:
    """``mlflow server`` on a free port of 127.0.0.1, its store and artifacts in
    ``directory``; ``stop`` kills it, ``start`` brings it back on the same port and store."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> "Server":
        with open(self.directory / "server.log", "a") as log:
            self.process = self._popen(log)
        wait_for(self.healthy, 120, "the MLflow server")
        return self

    def _popen(self, log) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.directory / 'store.db'}",
             "--artifacts-destination", str(self.directory / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def healthy(self) -> bool:
        assert self.process is not None and self.process.poll() is None, self.log()
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return (self.directory / "server.log").read_text()[-3000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the server and its workers
            self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(tmp_path_factory.mktemp("mlflow-server")).start()
    yield running
    running.stop()


def train(tmp_path, run, *args, uri, **env):
    return run_cli(*TINY, *args, "--run-dir", str(run), cwd=tmp_path, timeout=300,
                   MLFLOW_TRACKING_URI=uri, **env)  # fmt: skip


def the_run(uri, experiment):
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, experiment
    (run,) = client.search_runs([found.experiment_id])
    return client, run


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_a_run_logs_params_metrics_tags_and_artifacts_to_a_server(server, tmp_path):
    run = tmp_path / "run"
    done = train(tmp_path, run, "--mlflow-experiment", "online", "--group", "sweep-a",
                 "--mlflow-log-checkpoint", uri=server.uri)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    client, logged = the_run(server.uri, "online")
    assert f"dmltrain: mlflow run {logged.info.run_id} of 'online' at {server.uri}" in done.stdout
    assert logged.info.status == "FINISHED" and logged.info.run_name == "run"
    params = logged.data.params
    assert params["train.lr"] == "0.001" and params["train.epochs"] == "2"
    assert params["options.samples"] == "96"
    tags = logged.data.tags
    assert tags["group"] == "sweep-a" and tags["dmltrain.experiment"] == "tiny"
    assert tags["launcher"] == "single" and tags["world_size"] == "1"
    assert len(tags["code_commit"]) == 40
    # 12 steps an epoch, logged every 3 steps; each epoch's row at its last step
    assert [step for step, _ in history(client, logged.info.run_id, "train/loss")] == list(
        range(3, 25, 3)
    )
    assert [step for step, _ in history(client, logged.info.run_id, "val_loss")] == [12, 24]
    assert "best_val_loss" in logged.data.metrics
    names = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert {"training_log.csv", "config.yaml", "diagnostics.json", "checkpoints"} <= names
    (best,) = client.list_artifacts(logged.info.run_id, "checkpoints")
    assert best.path.startswith("checkpoints/ckpt-") and best.file_size > 0


def test_a_preempted_run_on_two_processes_continues_the_same_run(server, tmp_path):
    """Preempted at step 8 (rank 1 signalled), resumed: one MLflow run, each metric's
    points (steps and values) those of an uninterrupted run."""
    args = ["--nprocs", "2", "--batch-size", "4"]
    whole = train(tmp_path, tmp_path / "whole", *args, "--mlflow-experiment", "whole",
                  uri=server.uri)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    run, named = tmp_path / "run", [*args, "--mlflow-experiment", "resumed"]
    first = train(tmp_path, run, *named, "--signal-rank", "1", "--signal-at-step", "8",
                  *AT_ONCE, uri=server.uri)  # fmt: skip
    assert first.returncode == 3, first.stderr[-3000:]
    client, logged = the_run(server.uri, "resumed")
    assert logged.info.status == "RUNNING"  # a later job continues it
    second = train(tmp_path, run, *named, uri=server.uri)
    assert second.returncode == 0, second.stderr[-3000:]
    client, resumed = the_run(server.uri, "resumed")  # still one run
    assert resumed.info.run_id == logged.info.run_id and resumed.info.status == "FINISHED"
    _, reference = the_run(server.uri, "whole")
    for key in ("train/loss", "val_loss", "train/lr"):
        got = history(client, resumed.info.run_id, key)
        expected = history(client, reference.info.run_id, key)
        assert [s for s, _ in got] == [s for s, _ in expected], key
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), key


def test_a_store_that_is_gone_loses_nothing_and_the_sync_sends_it_once(tmp_path):
    """A server unreachable at the start, and one killed mid-run: each run trains to the
    end with one line, and ``dmltrain mlflow-sync`` sends it all; a second sync adds
    nothing."""
    server = Server(tmp_path)
    run_unreached, run_killed = tmp_path / "unreached", tmp_path / "killed"
    # nothing listens on the server's port yet
    done = train(tmp_path, run_unreached, uri=server.uri)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "mlflow" in line]
    assert len(lines) == 1 and lines[0].startswith(f"dmltrain: mlflow: {server.uri} failed ")
    assert f"'dmltrain mlflow-sync {run_unreached}' sends it" in lines[0]
    server.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dmltrain", *TINY, "--step-sleep", "0.25",
             "--run-dir", str(run_killed)],
            cwd=tmp_path, env=cli_env(MLFLOW_TRACKING_URI=server.uri),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        journal = run_killed / "mlflow" / "journal.jsonl"
        wait_for(lambda: journal.exists() and journal.read_text().count('"metrics"') >= 2, 120,
                 "two logged intervals")  # fmt: skip
        server.stop()
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        failed = [line for line in out.splitlines() if "mlflow: " in line and "failed" in line]
        assert len(failed) == 1, out
        server.start()
        for run, name in ((run_unreached, "unreached"), (run_killed, "killed")):
            synced = run_cli("mlflow-sync", str(run), "--to", server.uri, cwd=tmp_path)
            assert synced.returncode == 0, synced.stderr
            client = MlflowClient(tracking_uri=server.uri)
            experiment = client.get_experiment_by_name("tiny")
            runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
            logged = runs[name]
            assert logged.info.status == "FINISHED", name
            steps = [s for s, _ in history(client, logged.info.run_id, "train/loss")]
            assert steps == list(range(3, 25, 3)), (name, steps)
            names = {a.path for a in client.list_artifacts(logged.info.run_id)}
            assert {"training_log.csv", "config.yaml", "diagnostics.json"} <= names
            again = run_cli("mlflow-sync", str(run), cwd=tmp_path)  # the store it knows
            assert again.returncode == 0, again.stderr
            assert "sent 0 metric points, 0 artifacts, 0 records in all" in again.stdout
            assert len(client.search_runs([experiment.experiment_id])) == len(runs)
    finally:
        server.stop()


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_a_sweep_logs_its_trials_to_a_file_without_a_server(tmp_path, store, monkeypatch):
    """Offline nodes: MLFLOW_TRACKING_URI names a SQLite file, or a file store (which
    MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true); a local sweep's two trials are
    two runs of one experiment, tagged with the sweep's name."""
    uri = f"sqlite:///{tmp_path / 'offline.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    if store == "file":
        uri = f"file://{tmp_path / 'mlruns'}"
        env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the client below
    (tmp_path / "sweep.yaml").write_text("lr: [0.01, 0.001]\n")
    done = run_cli("sweep", "tiny", "--epochs", "1", "--tracker", "mlflow", "--space",
                   "sweep.yaml", "--name", "s", "--local", cwd=tmp_path, **env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["train.lr"] for r in runs) == ["0.001", "0.01"]
    assert {r.data.tags["group"] for r in runs} == {"s"}
    assert all(r.info.status == "FINISHED" and "val_loss" in r.data.metrics for r in runs)


def test_a_journal_line_that_is_no_record_is_left_out_and_said(tmp_path):
    """A JSON line in mlflow/journal.jsonl that is no record (added by hand): mlflow-sync
    and the run's next job leave it out with one line and go on; the sync blamed the
    store ('mlflow-sync to URI: 'kind''), and the next job turned the tracker off and
    journaled nothing."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    run = tmp_path / "run"
    done = train(tmp_path, run, "--epochs", "1", uri=uri)
    assert done.returncode == 0, done.stderr[-3000:]
    journal = run / "mlflow" / "journal.jsonl"
    lines = len(journal.read_text().splitlines())
    with journal.open("a") as handle:
        handle.write('{"note": "checked by hand"}\n[1, 2]\n')
    synced = run_cli("mlflow-sync", str(run), "--to", uri, cwd=tmp_path)
    assert synced.returncode == 0, synced.stderr
    said = f"{journal} line(s) {lines + 1}, {lines + 2} are no record of dmltrain's; left out"
    assert said in synced.stdout
    before = journal.read_text().count('"metrics"')
    more = train(tmp_path, run, "--epochs", "2", uri=uri)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "are no record of dmltrain's; left out" in more.stdout
    assert journal.read_text().count('"metrics"') > before
    client, logged = the_run(uri, "tiny")
    steps = [s for s, _ in history(client, logged.info.run_id, "train/loss")]
    assert steps == list(range(3, 25, 3)), steps

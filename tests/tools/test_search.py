"""``dmltrain sweep --search`` (dmltrain/tools/search.py, dmltrain/features/search.py): an
Optuna study in a journal file, real trials of the tiny experiment reporting to it.

Here: bad input is one line before anything runs; a local search prunes and says so; a
trial on 2 processes is pruned on both ranks at one step; a trial killed after a
validation and resumed reports each step once and ends as one never stopped; a failed or
lost trial is failed in the study and run again; optuna-dashboard reads the journal. On
the local Slurm cluster: 4 trials as an array, 2 at once, writing the journal together,
one preempted with scancel --signal=USR1; and a PBS array (PBS faked)."""

import json
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
from helpers import (
    AT_ONCE,
    TINY,
    TINY_RUN,
    assert_same_run,
    job_field,
    pbs_env,
    release_requeues_until_done,
    require,
    run_cli,
    wait_for,
)

optuna = pytest.importorskip("optuna")  # the dev extra's
from optuna.storages import JournalStorage  # noqa: E402
from optuna.storages.journal import JournalFileBackend  # noqa: E402

from dmltrain.tools import search  # noqa: E402
from dmltrain.tools.sweep import Sweep  # noqa: E402

SPACE = "lr: {low: 0.001, high: 0.1, log: true}\nbatch-size: [8, 16]\n"
VALIDATED = ["--val-every-steps", "4"]  # a report every 4 steps, and at each epoch's end


def load(path, name):
    return optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(path))))


@pytest.mark.parametrize(
    "space, extra, message",
    [
        (SPACE, ["--search", "bayes"], "argument --search: invalid choice: 'bayes'"),
        (SPACE, ["--search", "tpe", "--pruner", "wild"], "argument --pruner: invalid choice"),
        (SPACE, ["--search", "grid"], "--search grid takes lists and {values: [...]} only"),
        ("lr: [0.1, 0.2]\n", ["--search", "grid", "--trials", "3"], "the grid has 2 point(s)"),
        (SPACE, ["--search", "tpe", "--best-metric", "loss"], "--best-metric loss: a validation "
                                                              "reports the training log's val_"),
        ("lr: [{a: 1}]\n", ["--search", "tpe"], "a search chooses among numbers, strings"),
        (SPACE, ["--pruner", "median"], "--pruner is for a search: add --search tpe"),
        (SPACE, ["--search", "tpe", "--retry-failed", "-1"], "--retry-failed must be 0 or more"),
        (SPACE, ["--search", "tpe", "--in-turn"], "--in-turn runs a task's trials one after "
                                                  "another: add --trials-per-task T"),
        ("lr: [0.1, -1]\n", ["--search", "tpe"], "(lr=-1) is refused: --lr must be a positive"),
    ],
)  # fmt: skip
def test_bad_search_input_is_one_line_before_anything_runs(tmp_path, space, extra, message):
    (tmp_path / "sweep.yaml").write_text(space)
    done = run_cli("sweep", "tiny", "--space", "sweep.yaml", *extra, "--local", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert message in line and "Traceback" not in line, line
    assert not (tmp_path / "runs").exists()


def test_a_journal_holding_another_sweeps_study_is_refused(tmp_path):
    """Two sweeps of one name on one --storage: the second, with another space, is refused."""
    journal = tmp_path / "shared.journal"
    for where, space in (("a", SPACE), ("b", "lr: [0.1, 0.2]\n")):
        (tmp_path / where).mkdir()
        (tmp_path / where / "sweep.yaml").write_text(space)
        args = ["sweep", "tiny", "--space", "sweep.yaml", "--search", "random", "--name", "s",
                "--storage", str(journal), "--dry-run"]  # fmt: skip
        done = run_cli(*args, cwd=tmp_path / where)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"{journal} holds the study s of another sweep" in line, line
    assert not (tmp_path / "b" / "runs" / "s" / "sweep-slurm.sh").exists()
    assert len(load(journal, "s").trials) == 0  # nothing was asked


def test_a_local_search_prunes_with_its_own_outcome_and_status_says_so(tmp_path):
    """8 trials, one at a time (the draws then fixed by the seed); the median pruner acts
    from the 6th: a trial whose report is above the median of the trials before it at the
    same step stops there."""
    (tmp_path / "sweep.yaml").write_text(SPACE)
    args = ["sweep", *TINY, "--epochs", "4", *VALIDATED, "--space", "sweep.yaml", "--search",
            "tpe", "--pruner", "median", "--trials", "8", "--name", "s", "--local"]  # fmt: skip
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = tmp_path / "runs" / "s"
    study = load(sweep / "study.journal", "s")
    assert [t.user_attrs["slot"] for t in study.trials] == list(range(8))
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert pruned and len(pruned) + len(complete) == 8, done.stdout
    for t in study.trials:  # a report per validation row, its value the training log's
        rows = [r for r in _log(sweep / f"trial-{t.number}") if "val_loss" in r]
        assert t.intermediate_values == {int(r["step"]): pytest.approx(r["val_loss"]) for r in rows}
    for t in pruned:
        stop = max(t.intermediate_values)
        assert f"trial {t.number}: pruned (exit status 0)" in done.stdout, done.stdout
        outcome = json.loads((sweep / f"trial-{t.number}" / "outcome.json").read_text())
        assert outcome["status"] == "pruned" and outcome["global_step"] == stop
        assert (sweep / f"trial-{t.number}" / "checkpoints" / "latest.pt").is_file()  # kept
        log = (sweep / f"trial-{t.number}" / "output.log").read_text()
        assert f"done: pruned by the search (median pruner) at global step {stop}, val_loss" in log
        assert stop < t.user_attrs["planned_steps"]

    status = run_cli("sweep", "status", "runs/s", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].split() == ["trial", "number", "state", "lr", "batch_size", "val_loss", "steps"]
    assert [line.split()[2] for line in lines[1:9]] == [t.state.name.lower() for t in study.trials]
    counts = lines[9].removeprefix("dmltrain sweep: ").split(", ")
    assert sorted(counts) == sorted([f"{len(complete)} complete", f"{len(pruned)} pruned"])
    best = min(complete, key=lambda t: t.value)
    assert lines[10].startswith(f"dmltrain sweep: best trial {best.number} (val_loss")
    saved = sum(t.user_attrs["planned_steps"] - max(t.intermediate_values) for t in pruned)
    assert re.match(rf"dmltrain sweep: pruning saved {saved} of \d+ steps", lines[11]), lines
    assert (sweep / "trials.csv").read_text().count(",pruned,") == len(pruned)

    plotted = run_cli("plot", "runs/s", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    for name in ("sweep_curves", "search_history", "search_reports", "search_importances"):
        assert (sweep / f"{name}.png").stat().st_size > 10_000, name
    again = run_cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "every trial is done; nothing to run" in again.stdout
    assert len(load(sweep / "study.journal", "s").trials) == 8  # nothing more asked


def test_a_grid_search_runs_each_point_once(tmp_path):
    (tmp_path / "sweep.yaml").write_text("lr: [0.001, 0.01]\nbatch-size: {values: [8, 16]}\n")
    args = ["sweep", *TINY, "--epochs", "1", "--space", "sweep.yaml", "--search", "grid",
            "--trials", "4", "--name", "g", "--local", "--parallel", "2"]  # fmt: skip
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    study = load(tmp_path / "runs" / "g" / "study.journal", "g")
    points = {(t.params["lr"], t.params["batch_size"]) for t in study.trials}
    assert points == {(0.001, 8), (0.001, 16), (0.01, 8), (0.01, 16)}


@pytest.mark.parametrize("name, first_rung", [("asha", 10), ("hyperband", 3)])
def test_asha_and_hyperband_rungs_fall_at_shares_of_the_trials_steps(name, first_rung):
    """A trial of 90 planned steps, worse than 3 finished ones: ASHA judges it first at
    90 // 9 steps (and stops it), Hyperband's first bracket at 90 // 27; not before
    (Optuna's own ASHA would at step 1)."""
    from dmltrain.features.search import make_pruner

    pruner = make_pruner(name, 90)
    study = optuna.create_study(pruner=pruner, sampler=optuna.samplers.RandomSampler(0))
    for _ in range(3):
        good = study.ask()
        for step in range(1, 91):
            good.report(0.0, step)
            good.should_prune()  # each rung records its value
        study.tell(good, 0.0)
    bad = study.ask()
    decisions = {}
    for step in range(1, first_rung + 1):
        bad.report(1.0, step)
        decisions[step] = bad.should_prune()
    assert not any(decisions[step] for step in range(1, first_rung))
    if name == "asha":  # Hyperband's later brackets start later, and each its own trials
        assert decisions[first_rung]


def test_a_search_keeps_its_study_in_a_database_given_by_url(tmp_path):
    """--storage sqlite:///...: the study lives there, not in a journal."""
    (tmp_path / "sweep.yaml").write_text(SPACE)
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    args = ["sweep", *TINY, "--epochs", "1", "--space", "sweep.yaml", "--search", "random",
            "--trials", "2", "--storage", url, "--name", "db", "--local"]  # fmt: skip
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="db", storage=url)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert not (tmp_path / "runs" / "db" / "study.journal").exists()
    status = run_cli("sweep", "status", "runs/db", cwd=tmp_path)
    assert "dmltrain sweep: 2 complete" in status.stdout, status.stdout


def _log(run):
    from dmltrain.records.training_log import read_training_log

    return read_training_log(run / "training_log.csv")


def _study_with_a_trial(tmp_path, pruner="median", good=5):
    """A journal whose study has ``good`` complete trials that report 0.0 at every step
    (so the median pruner prunes any other), and a running trial: its trial.json."""
    journal = tmp_path / "study.journal"
    study = optuna.create_study(
        study_name="s", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    study.set_user_attr("dmltrain", {"pruner": pruner})
    for _ in range(good):
        done = study.ask()
        for step in range(1, 200):
            done.report(0.0, step)
        study.tell(done, 0.0)
    trial = study.ask()
    path = tmp_path / "trial.json"
    path.write_text(json.dumps({"storage": "study.journal", "study": "s", "number": trial.number}))
    return path, trial.number


def test_a_trial_on_two_processes_is_pruned_on_both_ranks_at_the_same_step(tmp_path):
    path, number = _study_with_a_trial(tmp_path)
    run = tmp_path / "run"
    done = run_cli(*TINY, *VALIDATED, "--nprocs", "2", "--search-trial", str(path), "--run-dir",
                   str(run), "--listen-all", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pruned by the search (median pruner) at global step 4" in done.stdout, done.stdout
    for rank in (0, 1):  # every rank took its last step at the report, and ended the run
        events = json.loads((run / f"events.{rank}.json").read_text())
        assert events["steps"][-1] == 4 and events["seen"]["on_train_end"] == 1, events
    assert json.loads((run / "outcome.json").read_text())["status"] == "pruned"
    trial = load(tmp_path / "study.journal", "s").trials[number]
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [4]
    again = run_cli(*TINY, "--nprocs", "2", "--search-trial", str(path), "--run-dir", str(run),
                    cwd=tmp_path)  # fmt: skip
    assert again.returncode == 2, again.stderr
    assert f"trial {number} of the search is pruned and takes no more reports" in again.stderr


def test_a_trial_killed_after_a_report_resumes_and_reports_each_step_once(tmp_path):
    """Killed at step 10 (reports at 4 and 8 made, the checkpoint of step 6 the newest: with
    --best-mode max the falling val_loss saves no best.pt after step 4): the next job resumes
    at 6, does the validation of step 8 again without reporting it, and the trial's reports
    and weights equal those of the same trial never stopped."""
    values = {}
    for name, fault in (("whole", []), ("killed", ["--die-rank", "0", "--die-at-step", "10"])):
        where = tmp_path / name
        where.mkdir()
        path, number = _study_with_a_trial(where, pruner="none", good=0)
        args = [*TINY_RUN, *VALIDATED, "--checkpoint-every-steps", "6", "--best-mode", "max",
                "--search-trial",
                str(path), "--run-dir", str(where / "run")]  # fmt: skip
        done = run_cli(*args, *fault, cwd=where)
        if fault:
            assert done.returncode != 0
            reported = load(where / "study.journal", "s").trials[number].intermediate_values
            assert list(reported) == [4, 8]
            done = run_cli(*args, cwd=where)  # no fault: the next job
            assert "resuming from" in done.stdout and "00000006.pt" in done.stdout, done.stdout
        assert done.returncode == 0, done.stderr[-3000:]
        trial = load(where / "study.journal", "s").trials[number]
        assert trial.state.name == "COMPLETE"
        assert trial.value == min(trial.intermediate_values.values())
        values[name] = trial.intermediate_values
    assert values["killed"] == values["whole"]  # the same steps, the same values
    assert list(values["whole"]) == [4, 8, 12, 16, 20, 24, 28, 32, 36]
    assert_same_run(tmp_path / "whole" / "run", tmp_path / "killed" / "run")


def test_failed_and_lost_trials_are_failed_in_the_study_and_run_again(tmp_path):
    """A trial whose code raises fails, and runs again with its options once
    (--retry-failed 1); then a trial whose run started and left no checkpoint (its node
    lost) is failed when its slot is readied, and run again."""
    (tmp_path / "sweep.yaml").write_text("lr: {low: 0.001, high: 0.1}\n")
    args = ["sweep", *TINY, "--space", "sweep.yaml", "--search", "random", "--trials", "1",
            "--retry-failed", "1", "--name", "s", "--local"]  # fmt: skip
    done = run_cli(*args, "--raise-rank", "0", "--raise-at-step", "3", cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "trial 0: failed (exit status 1)" in done.stdout, done.stdout
    sweep = tmp_path / "runs" / "s"
    study = load(sweep / "study.journal", "s")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    assert study.trials[0].params == study.trials[1].params
    outcome = json.loads((sweep / "trial-0.failed-0" / "outcome.json").read_text())
    assert outcome["status"] == "failed"

    (tmp_path / "lost.yaml").write_text("lr: {low: 0.001, high: 0.1}\n")
    lost = Sweep(tmp_path / "runs" / "lost")
    made = ["sweep", *TINY, "--space", "lost.yaml", "--search", "random", "--trials", "1",
            "--retry-failed", "1", "--name", "lost", "--dry-run"]  # fmt: skip
    assert run_cli(*made, cwd=tmp_path).returncode == 0
    assert search.ready(lost, 0) is None  # asked: trial 0 of the study
    (lost.trial_dir(0) / "config.yaml").write_text("started: true\n")  # a run, then nothing
    assert search.ready(lost, 0) is None  # failed, and asked again with its options
    study = load(lost.directory / "study.journal", "lost")
    assert [t.state.name for t in study.trials] == ["FAIL", "RUNNING"]
    assert study.trials[0].params == study.trials[1].params
    assert (lost.directory / "trial-0.failed-0" / "config.yaml").is_file()
    assert json.loads((lost.trial_dir(0) / "trial.json").read_text())["attempt"] == 1
    (lost.trial_dir(0) / "config.yaml").write_text("started: true\n")
    assert search.ready(lost, 0) == "failed"  # no retry left: done with, not RUNNING
    assert load(lost.directory / "study.journal", "lost").trials[1].state.name == "FAIL"


def test_a_metric_no_validation_reports_fails_the_trial_at_the_first_one(tmp_path):
    """The sweep checks only that it is a val_ or train_ column: a misspelt one ends the
    trial at its first validation, in one line, not after its whole training."""
    path, number = _study_with_a_trial(tmp_path, pruner="none", good=0)
    done = run_cli(*TINY, *VALIDATED, "--best-metric", "val_los", "--search-trial", str(path),
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert "--best-metric val_los is not in the validation's row (train_loss, val_loss)" in line
    assert json.loads((tmp_path / "run" / "outcome.json").read_text())["global_step"] == 4
    assert load(tmp_path / "study.journal", "s").trials[number].state.name == "FAIL"


@pytest.mark.parametrize("turn", [[], ["--in-turn"]], ids=["side-by-side", "in-turn"])
def test_two_trials_of_a_task_are_asked_for_and_run_side_by_side_or_in_turn(tmp_path, turn):
    """``dmltrain sweep task DIR 0 2`` (what an array task of --trials-per-task 2 runs),
    started here: both trials as two processes at once, or, --in-turn, the second asked
    for and started once the first has ended (it learns from the first's reports)."""
    (tmp_path / "sweep.yaml").write_text(SPACE)
    made = ["sweep", *TINY, "--space", "sweep.yaml", "--search", "tpe", "--trials", "2",
            "--trials-per-task", "2", *turn, "--name", "p", "--dry-run"]  # fmt: skip
    assert run_cli(*made, cwd=tmp_path).returncode == 0
    script = (tmp_path / "runs" / "p" / "sweep-slurm.sh").read_text()
    assert f'set -- sweep task "$sweep" "$trial" 2{" --in-turn" if turn else ""}\n' in script
    done = run_cli("sweep", "task", "runs/p", "0", "2", *turn, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "task 0: trials [0, 1] ended with [0, 0]" in done.stdout, done.stdout
    study = load(tmp_path / "runs" / "p" / "study.journal", "p")
    first, second = sorted(study.trials, key=lambda t: t.user_attrs["slot"])
    assert {first.state.name, second.state.name} == {"COMPLETE"}
    assert (second.datetime_start >= first.datetime_complete) == bool(turn)
    again = run_cli("sweep", "task", "runs/p", "0", "2", *turn, cwd=tmp_path)
    assert again.returncode == 0 and "starts trial" not in again.stdout  # both done


def test_optuna_dashboard_reads_the_journal(tmp_path):
    """What docs/sweeps.md says to type: optuna-dashboard runs/NAME/study.journal."""
    require("optuna-dashboard")
    _study_with_a_trial(tmp_path, good=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["optuna-dashboard", str(tmp_path / "study.journal"), "--host",
                               "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        found = {}

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies") as reply:
                    found.update(json.load(reply))
                return True
            except OSError:
                return False

        wait_for(answers, 60, "optuna-dashboard to answer")
        (summary,) = found["study_summaries"]
        assert summary["study_name"] == "s"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/0") as reply:
            assert len(json.load(reply)["trials"]) == 3
    finally:
        server.terminate()
        server.wait(10)


# ----- the local Slurm cluster, and PBS faked --------------------------------------------
TASK = ["--tasks-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00"]
SEARCH = ["--space", "sweep.yaml", "--search", "random", "--trials", "4", "--space-seed", "3"]


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """The search run here, one trial at a time: each slot's options are drawn by the
    slot's own seed, so every slot must end equal to it wherever it runs."""
    cwd = tmp_path_factory.mktemp("search-here")
    (cwd / "sweep.yaml").write_text(SPACE)
    done = run_cli("sweep", *TINY_RUN, *VALIDATED, *SEARCH, "--name", "here", "--local", cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("complete (exit status 0)") == 4, done.stdout
    return cwd / "runs" / "here"


def _same_trials(here, ran) -> None:
    """Each slot: the same options, reports and run as here; 4 trials in the study."""
    a, b = load(here / "study.journal", "here"), load(ran / "study.journal", ran.name)
    assert len(b.trials) == 4 and {t.state.name for t in b.trials} == {"COMPLETE"}
    by_slot = {t.user_attrs["slot"]: t for t in a.trials}
    for trial in b.trials:
        slot = trial.user_attrs["slot"]
        assert trial.params == by_slot[slot].params
        assert trial.intermediate_values == by_slot[slot].intermediate_values
        assert_same_run(here / f"trial-{slot}", ran / f"trial-{slot}")


def test_a_search_as_an_array_writes_one_journal_from_two_tasks_and_resumes_exactly(
    slurm, here, tmp_path
):
    (tmp_path / "sweep.yaml").write_text(SPACE)
    args = ["sweep", *TINY_RUN, *VALIDATED, "--step-sleep", "0.3", "--first-job-only", *SEARCH,
            "--name", "array", "--max-parallel", "2", *TASK, *AT_ONCE]  # fmt: skip
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    array = re.search(r"submitted job array (\d+) \(trials 0,1,2,3%2\)", done.stdout).group(1)
    sweep = tmp_path / "runs" / "array"
    out = sweep / f"slurm-{array}_1.out"
    wait_for(lambda: out.exists() and "(step 16)" in out.read_text(), 240, "trial 1")
    for _ in range(5):
        subprocess.run(["scancel", "--signal=USR1", f"{array}_1"], capture_output=True)
        try:
            wait_for(lambda: "preempted (SIGUSR1)" in out.read_text(), 10, "trial 1 to stop")
            break
        except AssertionError:
            continue
    release_requeues_until_done(f"{array}_1", tmp_path)
    for task in (0, 2, 3):
        wait_for(lambda t=task: job_field(f"{array}_{t}", "JobState") == "COMPLETED", 240, "tasks")
    assert job_field(f"{array}_1", "Restarts") == "1"
    _same_trials(here, sweep)  # the paused trial reported each step once, to its own trial
    trials = load(sweep / "study.journal", "array").trials
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    assert spans[1][0] < spans[0][1]  # two tasks wrote the journal at once

    status = run_cli("sweep", "status", "runs/array", cwd=tmp_path)
    assert "dmltrain sweep: 4 complete" in status.stdout, status.stdout
    again = run_cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "every trial is done; nothing to run" in again.stdout


def test_a_search_as_a_pbs_array_runs_every_trial(here, tmp_path):
    """PBS faked (tests/cluster/qsub runs the subjobs one after another)."""
    env = pbs_env(tmp_path)
    (tmp_path / "sweep.yaml").write_text(SPACE)
    args = [sys.executable, "-m", "dmltrain", "sweep", *TINY_RUN, *VALIDATED, *SEARCH, "--name",
            "pbs", "--system", "pbs", "--script", "casper"]  # fmt: skip
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"submitted array job \d+\[\]\.fakepbs \(trials 0-3\)", done.stdout)
    _same_trials(here, tmp_path / "runs" / "pbs")


def test_a_local_search_run_twice_or_killed_loses_no_trial(tmp_path):
    """The same ``sweep --search --local`` started again while it runs is refused, and
    fails nothing; a trial killed (SIGKILL) after its first checkpoint goes on from it.
    A damaged study (journal deleted, a trial.json edited) is reported from what the
    trials' own records say, exit status 2."""
    import os
    import signal

    from helpers import cli_env

    (tmp_path / "sweep.yaml").write_text(SPACE)
    args = [*TINY, "--epochs", "2", "--checkpoint-every-steps", "2", "--step-sleep", "0.5",
            "--space", "sweep.yaml", "--search", "random", "--trials", "2", "--name", "s",
            "--local"]  # fmt: skip
    first = subprocess.Popen([sys.executable, "-m", "dmltrain", "sweep", *args], cwd=tmp_path,
                             env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)  # fmt: skip
    trial = tmp_path / "runs" / "s" / "trial-0"
    try:
        wait_for(lambda: (trial / "checkpoints" / "latest.pt").exists(), 120, "a checkpoint")
        again = run_cli("sweep", *args, cwd=tmp_path)
        assert again.returncode == 2, again.stderr
        assert "is being run here by another dmltrain sweep --local" in again.stderr
        found = subprocess.run(["pgrep", "-f", "--", f"--run-dir {trial.resolve()}$"],
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        assert len(found) == 1 and not (trial / "outcome.json").exists(), found
        os.kill(int(found[0]), signal.SIGKILL)
        out, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, out[-3000:]
    assert "trial 0 stopped (exit status -9); it goes on from its checkpoint" in out
    study = load(tmp_path / "runs" / "s" / "study.journal", "s")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], out[-3000:]
    assert "resuming from" in (trial / "output.log").read_text()
    assert len(_log(trial)) == 2  # both epochs, each once

    record = json.loads((trial / "trial.json").read_text())
    (trial / "trial.json").write_text(json.dumps({**record, "number": 99}))
    status = run_cli("sweep", "status", "runs/s", cwd=tmp_path)
    assert status.returncode == 2 and "trial 0's number 99 is not in the study" in status.stderr
    assert "Traceback" not in status.stderr
    (tmp_path / "runs" / "s" / "study.journal").unlink()
    status = run_cli("sweep", "status", "runs/s", cwd=tmp_path)
    assert status.returncode == 2, status.stderr
    assert "study.journal cannot be read" in status.stderr and "Traceback" not in status.stderr
    rows = [line.split() for line in status.stdout.splitlines()[1:3]]
    assert [row[2] for row in rows] == ["done", "done"], status.stdout  # from outcome.json

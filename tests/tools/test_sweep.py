"""A sweep's space, its trials and its directory (dmltrain/tools/sweep.py); bad sweep.yaml files
are one line and exit 2 before anything runs."""

import json

import pytest
from helpers import run_cli

from dmltrain.errors import UserError
from dmltrain.tools.sweep import Sweep, best, expand, flags, load_space

KNOWN = {"lr", "dropout", "batch_size", "augment", "run_dir"}


def space(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return load_space(path, KNOWN)


def test_lists_are_a_grid_and_the_random_options_are_drawn_per_grid_point(tmp_path):
    grid = space(tmp_path, "lr: [0.1, 0.01]\nbatch-size: [8, 16]\n")
    assert expand(grid, 1, 0) == [
        {"lr": 0.1, "batch_size": 8},
        {"lr": 0.1, "batch_size": 16},
        {"lr": 0.01, "batch_size": 8},
        {"lr": 0.01, "batch_size": 16},
    ]
    mixed = space(
        tmp_path,
        "augment: [true, false]\nlr: {low: 0.0001, high: 0.1, log: true}\n"
        "batch_size: {low: 4, high: 64}\ndropout: {values: [0.0, 0.5]}\n",
    )
    trials = expand(mixed, 3, seed=7)
    assert len(trials) == 6 and [t["augment"] for t in trials] == [True] * 3 + [False] * 3
    assert all(1e-4 <= t["lr"] <= 0.1 and t["dropout"] in (0.0, 0.5) for t in trials)
    assert all(isinstance(t["batch_size"], int) and 4 <= t["batch_size"] <= 64 for t in trials)
    assert len({t["lr"] for t in trials}) == 6  # drawn, not repeated
    assert expand(mixed, 3, seed=7) == trials  # the seed fixes them
    assert expand(mixed, 3, seed=8) != trials


def test_a_trials_options_are_flags_and_booleans_a_pair():
    assert flags({"lr": 0.1, "augment": True, "batch_size": 8}) == [
        "--lr", "0.1", "--augment", "--batch-size", "8",
    ]  # fmt: skip
    assert flags({"augment": False}) == ["--no-augment"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("lrr: [1]\n", "'lrr' is not an option of this experiment"),
        ("{}\n", "it is empty"),
        ("lr: []\n", "give a list (grid)"),
        ("lr: 0.1\n", "give a list (grid)"),
        ("lr: {values: []}\n", "values must be a non-empty list"),
        ("lr: {low: 1, high: 0}\n", "low < high"),
        ("lr: {low: 0, high: 1, log: true}\n", "> 0 with log"),
        ("lr: {low: a, high: 1}\n", "must be numbers"),
        ("lr: [1\n", "cannot be read"),
        ("run-dir: [a, b]\n", "'run-dir' is the sweep's to set"),
    ],
)
def test_a_bad_space_is_refused_with_the_option_named(tmp_path, text, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        space(tmp_path, text)


def test_trials_cannot_be_asked_of_a_grid(tmp_path):
    with pytest.raises(UserError, match="--trials 2: the space has no random option"):
        expand(space(tmp_path, "lr: [0.1]\n"), 2, 0)


def test_the_directory_holds_each_trials_command_and_refuses_another_sweep(tmp_path):
    sweep = Sweep(tmp_path / "s")
    trials = [{"lr": 0.1}, {"lr": 0.01}]
    sweep.create("tiny", ["--epochs", "2"], trials)
    run = (tmp_path / "s" / "trial-1").resolve()
    assert sweep.args(1) == ["tiny", "--epochs", "2", "--group", "s", "--lr", "0.01",
                             "--run-dir", str(run)]  # fmt: skip
    assert (tmp_path / "s" / "trials.csv").read_text().splitlines() == [
        "trial,lr,status", "0,0.1,pending", "1,0.01,pending",
    ]  # fmt: skip
    sweep.create("tiny", ["--epochs", "2"], trials)  # the same again: a resubmission
    with pytest.raises(UserError, match="holds another sweep"):
        sweep.create("tiny", ["--epochs", "3"], trials)
    (run / "outcome.json").write_text(json.dumps({"status": "done"}))
    (run / "training_log.csv").write_text("epoch,val_loss,val_acc\n1,0.5,0.7\n2,0.25,0.9\n")
    assert sweep.left() == [0]
    rows = sweep.rows("val_acc", "max")
    assert [(r["status"], r["val_acc"]) for r in rows] == [("pending", None), ("done", 0.9)]
    assert best(rows, "val_acc", "max")["trial"] == 1


@pytest.mark.parametrize(
    "text, extra, message",
    [
        ("dropout: [0.1, abc]\n", [], "trial 1 (dropout=abc) is refused: argument --dropout: "
                                       "invalid float value: 'abc'"),
        ("lr: [-1]\n", [], "trial 0 (lr=-1) is refused: --lr must be a positive number"),
        ("dropout: [0.1]\n", ["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_and_exit_2_before_anything_is_written(
    tmp_path, text, extra, message
):
    (tmp_path / "sweep.yaml").write_text(text)
    done = run_cli("sweep", "tiny", "--space", "sweep.yaml", *extra, "--local", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert message in line, line
    assert not (tmp_path / "runs").exists()


def test_a_local_sweep_runs_each_trial_and_status_names_a_failure_and_the_best(tmp_path):
    """Trial 1 runs out of memory (tiny raises it on CPU): its run records the failure."""
    (tmp_path / "sweep.yaml").write_text("oom-at-step: [0, 2]\n")
    args = ["sweep", "tiny", "--epochs", "1", "--space", "sweep.yaml", "--name", "s", "--local"]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 1 and "trial(s) 1 failed" in done.stderr, done.stderr
    status = run_cli("sweep", "status", "runs/s", "--best-metric", "val_loss", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].split() == ["trial", "oom_at_step", "status", "val_loss"]
    assert lines[1].split()[2] == "done" and lines[2].split()[2:4] == ["failed", "-"]
    assert "(out of memory in step 2 on rank 0" in lines[2]
    assert lines[-1].startswith("dmltrain sweep: best trial 0 (val_loss ")
    outcome = json.loads((tmp_path / "runs" / "s" / "trial-1" / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["global_step"] == 1
    (tmp_path / "runs" / "s" / "trial-1" / "outcome.json").write_text("")  # 0 bytes: no record
    status = run_cli("sweep", "status", "runs/s", cwd=tmp_path)
    assert status.stdout.splitlines()[2].split()[2] == "unreadable", status.stdout


@pytest.mark.parametrize("args", [[], ["runs/s", "zero", "2"]])
def test_a_task_command_without_its_arguments_is_one_line(tmp_path, args):
    done = run_cli("sweep", "task", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("dmltrain: error: dmltrain sweep task DIR K T runs array task")
    assert "Traceback" not in done.stderr

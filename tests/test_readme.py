"""The README's commands and the Python examples of README.md and docs/ work as written
(tests/test_docs.py holds every example of the docs to one of these)."""

import math
import re
import subprocess
import sys

import pytest
from helpers import ROOT, cli_env, readme_experiment, tensorboard_scalars

from dmltrain import TrainConfig
from dmltrain.records.training_log import read_training_log

README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "pip install torch==2.13.0 -e . && dmltrain mnist --epochs 1",
        "bash tests/run.sh",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash tests/run.sh" in ci


def test_example_runs_from_the_command_line(tmp_path):
    readme_experiment(tmp_path)
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "my_experiment.py",
            "--epochs",
            "20",
            "--lr",
            "0.1",
            "--batch-size",
            "32",
            "--run-dir",
            str(run),
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = read_training_log(run / "training_log.csv")
    assert len(rows) == 20 and rows[-1]["val_loss"] < 0.02
    # dmltrain FILE.py runs the experiment the file registers, on 2 processes too
    done = subprocess.run(
        ["dmltrain", "my_experiment.py", "--epochs", "20", "--lr", "0.1", "--batch-size", "16",
         "--nprocs", "2", "--run-dir", str(tmp_path / "two"), "--noise", "0.1"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert read_training_log(tmp_path / "two" / "training_log.csv")[-1]["val_loss"] < 0.02


def test_the_files_only_experiment_runs_without_its_name(tmp_path):
    """``python my_experiment.py --epochs 1``: the file registers one experiment, so its
    flags come first; a file of two names them in one line."""
    readme_experiment(tmp_path)
    done = subprocess.run([sys.executable, "my_experiment.py", "--epochs", "1", "--run-dir",
                           "run"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(read_training_log(tmp_path / "run" / "training_log.csv")) == 1
    two = (
        (tmp_path / "my_experiment.py")
        .read_text()
        .replace(
            "main(experiments=[EXPERIMENT])",
            "main(experiments=[EXPERIMENT, register_experiment('other', LineTrainer)])",
        )
    )
    (tmp_path / "two.py").write_text(two)
    done = subprocess.run([sys.executable, "two.py", "--epochs", "1"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == ("dmltrain: error: this file registers 2 experiments (line, other): "
                           "name one first, e.g. line --epochs 1\n")  # fmt: skip


def test_example_runs_from_a_notebook(tmp_path, monkeypatch):
    namespace: dict = {"__name__": "notebook"}
    source = readme_experiment(tmp_path).read_text()
    exec(compile(source, "README example", "exec"), namespace)
    trainer = namespace["LineTrainer"](
        TrainConfig(epochs=20, lr=0.1, batch_size=32, run_dir=str(tmp_path / "nb"), progress="off"),
        namespace["LineOptions"](),
    )
    rows = trainer.fit()
    weight, bias = trainer.model.weight.item(), trainer.model.bias.item()
    assert abs(weight - 3) < 0.1 and abs(bias - 1) < 0.1, (weight, bias)
    assert rows[-1]["val_loss"] < 0.02


def block(page: str, heading: str, lang: str = "python") -> str:
    """The first ``lang`` code block under ``heading`` of ``docs/<page>``."""
    part = (ROOT / "docs" / page).read_text().split(heading + "\n", 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", part, re.S).group(1)


def test_the_callback_example_logs_and_checkpoints_its_state(tmp_path):
    from dmltrain.checkpoint.storage import load_file

    readme_experiment(tmp_path)
    (tmp_path / "my_callbacks.py").write_text(block("extending.md", "## Callbacks"))
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "my_callbacks.py", "line-monitored", "--epochs", "2", "--batch-size",
         "32", "--tracker", "", "--tensorboard", "--run-dir", str(run)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scalars = tensorboard_scalars(run)  # 14 steps an epoch: logged at steps 10 and 20
    assert scalars["grad_norms_logged"] == [(10, 1.0), (20, 2.0)]
    assert [step for step, _ in scalars["grad_norm/weight"]] == [10, 20]
    state = load_file(run / "checkpoints" / "latest.pt")
    assert state["states"] == {"GradNorms": {"logged": 2}}


def test_the_callback_example_writes_its_scalars_to_steps_csv_in_a_default_run(tmp_path):
    """No tracker (the default run): what a callback logs still lands in the run
    directory, in the rows of its steps."""
    import csv

    readme_experiment(tmp_path)
    (tmp_path / "my_callbacks.py").write_text(block("extending.md", "## Callbacks"))
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "my_callbacks.py", "line-monitored", "--epochs", "2", "--batch-size",
         "32", "--run-dir", str(run)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with open(run / "steps.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    logged = {r["step"]: r["grad_norms_logged"] for r in rows if r["grad_norms_logged"]}
    assert logged == {"10": "1.0", "20": "2.0"}
    assert all(r["grad_norm/weight"] for r in rows if r["step"] in logged)


def test_the_metrics_example_logs_the_whole_sets_rmse_and_a_figure(tmp_path):
    """On 2 processes, 64 validation samples in batches of 16 a rank: val_rmse is the root
    of val_loss (both over every sample), and TensorBoard holds the figure of each epoch."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    readme_experiment(tmp_path)
    (tmp_path / "my_metrics.py").write_text(
        block("experiments.md", "## Metrics over the whole validation set, and images")
    )
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "my_metrics.py", "measured-line", "--epochs", "2", "--batch-size",
         "16", "--nprocs", "2", "--tracker", "tensorboard", "--run-dir", str(run)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in read_training_log(run / "training_log.csv"):
        assert row["val_rmse"] == pytest.approx(row["val_loss"] ** 0.5, rel=1e-6)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [image.step for image in events.Images("val/fit")] == [14, 28]


def test_the_manual_step_shown_is_the_bundled_gans():
    shown = block("extending.md", "## Several models and optimizers (a GAN)")
    assert shown in (ROOT / "experiments" / "mnist_gan.py").read_text()


def test_the_tracker_example_is_named_by_its_entry_point(tmp_path):
    readme_experiment(tmp_path)
    (tmp_path / "my_tracker.py").write_text(block("extending.md", "## A tracker of your own"))
    info = tmp_path / "my_tracker-0.dist-info"  # what pip writes for the README's entry point
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-tracker\nVersion: 0\n")
    points = block("extending.md", "## A tracker of your own", "ini").split("\n", 1)[1]
    (info / "entry_points.txt").write_text(
        points.replace("dmltrain.trackers =", "[dmltrain.trackers]")
    )
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run(
        ["dmltrain", "my_experiment.py", "--epochs", "1", "--tracker", "printer", "--run-dir",
         str(tmp_path / "run"), "--progress", "off"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "printer: run run from step 0" in done.stdout
    assert "printer: 7 ['train/data_wait', 'train/loss', 'train/lr'," in done.stdout  # steps
    assert "'train_loss', 'val_loss', 'world_size']" in done.stdout  # the epoch's row
    assert "printer: finished (preempted: False)" in done.stdout


def test_the_notebook_example_trains_on_two_processes(tmp_path):
    """docs/launching.md's cell beside the README's my_experiment.py, run as a kernel runs
    a cell: in a __main__ with no file (python -c), which spawned workers do not import."""
    readme_experiment(tmp_path)
    cell = block("launching.md", "## From a notebook to a cluster")
    cell += "print(len(rows), int(rows[-1]['world_size']))\n"
    done = subprocess.run([sys.executable, "-c", cell], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "2 2"
    assert (tmp_path / "runs" / "line" / "checkpoints" / "latest.pt").is_file()


def test_the_large_model_example_trains_in_pairs_of_shards_recomputed(tmp_path):
    """docs/large-models.md's transformer with the command the page shows, for one epoch."""
    (tmp_path / "big.py").write_text(block("large-models.md", "## Activation checkpointing"))
    run = tmp_path / "run"
    done = subprocess.run(
        ["dmltrain", "big.py", "--nprocs", "4", "--strategy", "fsdp", "--fsdp-shard-size", "2",
         "--activation-checkpointing", "--epochs", "1", "--run-dir", str(run)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = read_training_log(run / "training_log.csv")
    assert row["world_size"] == 4 and row["train_loss"] < math.log(256) + 0.5

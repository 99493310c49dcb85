import contextlib
import gc
import io
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import cli_env, run_cli
from torch import nn
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, register_experiment
from dmltrain.cli import main, parse
from dmltrain.records.files import read_status_record
from dmltrain.records.training_log import read_training_log
from tiny import EXPERIMENT as TINY


@dataclass(frozen=True)
class SquareOptions:
    width: int = field(default=4, metadata={"help": "hidden width"})
    note: str | None = field(default=None, metadata={"help": "a PEP 604 optional field"})


class SquareTrainer(BaseTrainer):
    def create_model(self):
        return nn.Sequential(
            nn.Linear(1, self.options.width), nn.ReLU(), nn.Linear(self.options.width, 1)
        )

    def create_datasets(self):
        x = torch.linspace(-1, 1, 64).unsqueeze(1)
        return TensorDataset(x, x**2), None

    def train_step(self, batch):
        return F.mse_loss(self.model(batch[0]), batch[1])


SQUARE = register_experiment("square", SquareTrainer, SquareOptions, help="fit x^2")


def test_custom_experiment_through_main(tmp_path):
    run = tmp_path / "run"
    code = main(
        ["square", "--epochs", "2", "--width", "8", "--note", "hello", "--run-dir", str(run)],
        experiments=[SQUARE],
    )
    assert code == 0
    rows = read_training_log(run / "training_log.csv")
    assert [r["epoch"] for r in rows] == [1, 2]
    written = (run / "config.yaml").read_text()
    assert "width: 8" in written and "note: hello" in written


def test_experiment_from_an_outside_package_entry_point(tmp_path):
    """A package that is not dmltrain adds a subcommand via the entry-point group."""
    (tmp_path / "outside_exp.py").write_text(
        textwrap.dedent("""
        import torch, torch.nn.functional as F
        from torch.utils.data import TensorDataset
        from dmltrain import BaseTrainer, register_experiment

        class Outside(BaseTrainer):
            def create_model(self):
                return torch.nn.Linear(2, 1)
            def create_datasets(self):
                x = torch.randn(40, 2)
                return TensorDataset(x, x.sum(1, keepdim=True)), None
            def train_step(self, batch):
                return F.mse_loss(self.model(batch[0]), batch[1])

        EXPERIMENT = register_experiment("outside", Outside, help="from another package")
    """)
    )
    info = tmp_path / "outside_exp-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-exp\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[dmltrain.experiments]\noutside = outside_exp:EXPERIMENT\n"
    )
    env = cli_env(PYTHONPATH=str(tmp_path))
    dmltrain = shutil.which("dmltrain")
    assert dmltrain, "the dmltrain console script is not installed"
    listing = subprocess.run([dmltrain, "--help"], env=env, capture_output=True, text=True)
    assert "outside" in listing.stdout and "mnist" in listing.stdout
    done = subprocess.run(
        [dmltrain, "outside", "--epochs", "1", "--run-dir", str(tmp_path / "r")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r" / "training_log.csv").is_file()


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 2\nlr: 0.5\nbatch_size: 8\nsamples: 20\n")
    experiment, config, options = parse(
        ["tiny", "--config", str(path), "--lr", "0.25", "--features", "3"], {"tiny": TINY}
    )
    assert experiment is TINY
    assert (config.epochs, config.lr, config.batch_size, config.seed) == (2, 0.25, 8, 0)
    assert (options.samples, options.features) == (20, 3)


def test_boolean_flags_come_in_pairs_and_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("check_nans: true\nrequeue: false\nsave_weights: true\n")
    _, config, options = parse(["tiny", "--config", str(path)], {"tiny": TINY})
    assert (config.check_nans, config.requeue, options.save_weights) == (True, False, True)
    flags = ["--no-check-nans", "--requeue", "--no-save-weights"]
    _, config, options = parse(["tiny", "--config", str(path), *flags], {"tiny": TINY})
    assert (config.check_nans, config.requeue, options.save_weights) == (False, True, False)
    assert config.numerics.check_nans is False and config.preemption.requeue is True
    _, config, _ = parse(["tiny", "--no-requeue", "--compile"], {"tiny": TINY})
    assert (config.requeue, config.loop.compile) == (False, True)


def test_help_groups_flags_by_section_and_says_what_each_flag_does():
    sub = subprocess.run(
        [sys.executable, "-m", "dmltrain", "mnist", "--help"],
        capture_output=True, text=True, env=cli_env(), check=True,
    ).stdout  # fmt: skip
    for title in ("training:", "data:", "precision:", "distributed:", "checkpointing:",
                  "preemption:", "tracking:", "mnist options:"):  # fmt: skip
        assert f"\n{title}\n" in sub
    flat = " ".join(sub.split())
    assert "--requeue, --no-requeue under Slurm, run 'scontrol requeue'" in flat
    assert "--epochs EPOCHS number of training epochs (0: 10, or as many as --max- steps" in flat
    assert "--download, --no-download download MNIST when it is missing" in flat


def test_resolved_config_is_written_and_print_config_prints_it(tmp_path):
    """The run opens with a compact summary, not the 60-line config: the config is in
    config.yaml, and --print-config prints the same text and exits without training."""
    path = tmp_path / "c.json"
    path.write_text('{"epochs": 1, "batch-size": 8}')
    run = tmp_path / "run"
    args = ["tiny", "--config", str(path), "--seed", "7", "--run-dir", str(run)]
    done = run_cli(*args, "--progress", "log", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = (run / "config.yaml").read_text()
    for line in ("epochs: 1", "batch_size: 8", "seed: 7", f"# run_dir: {run}", "samples: 96"):
        assert line in written and line not in done.stdout
    summary = done.stdout.split("epoch 1/1", 1)[0]
    assert f"tiny -> {run} (options: config.yaml there" in summary
    assert "model Sequential: 49 trainable of 49 parameters (196 B), precision fp32" in summary
    assert "data 96 training and 32 validation samples; 12 steps an epoch of global batch 8 " \
        "(1 process(es) x 8)" in summary  # fmt: skip
    assert len(summary.splitlines()) <= 8, summary
    # The written file is itself a valid --config, for a run of its own (not this one's).
    again = parse(["tiny", "--config", str(run / "config.yaml")], {"tiny": TINY})
    assert again[1].seed == 7 and again[1].run_dir is None
    log = (run / "training_log.csv").read_text()
    printed = run_cli(*args, "--progress", "log", "--print-config", "--epochs", "2", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    # config.yaml holds what ran: --num-workers auto as the number it became
    ran = re.search(r"^num_workers: (\d+)$", written, re.MULTILINE).group(0)
    options, made = written.split("\n# what was built\n")  # made: what ran, not options
    assert "# optimizer: Adam lr=0.001 " in made
    assert printed.stdout == options.replace("epochs: 1", "epochs: 2").replace(
        ran, "num_workers: auto"
    )
    assert (run / "training_log.csv").read_text() == log  # printing trained nothing more
    reused = run_cli("tiny", "--config", str(run / "config.yaml"), "--progress", "log",
                     cwd=tmp_path)  # fmt: skip
    assert reused.returncode == 0 and "resuming" not in reused.stdout, reused.stdout
    assert (run / "training_log.csv").read_text() == log  # a run of its own, elsewhere
    assert re.search(r"tiny -> (\S+) \(options", reused.stdout).group(1) != str(run)


def test_a_file_that_registers_no_experiment_or_two_is_one_line(tmp_path):
    (tmp_path / "none.py").write_text("x = 1\n")
    (tmp_path / "two.py").write_text(
        "from tiny import EXPERIMENT as A\nfrom dmltrain import register_experiment\n"
        "B = register_experiment('b', A.trainer_cls)\n"
    )
    for name, message in (
        ("missing.py", "missing.py: no such file (dmltrain FILE.py runs the experiment"),
        ("none.py", "none.py registers 0 experiments; dmltrain FILE.py needs exactly one"),
        ("two.py", "two.py registers 2 experiments; dmltrain FILE.py needs exactly one"),
    ):
        done = run_cli(name, "--epochs", "1", cwd=tmp_path)
        assert done.returncode == 2 and done.stderr == f"dmltrain: error: {message}" + \
            done.stderr.split(message, 1)[1], done.stderr  # fmt: skip
        assert len(done.stderr.strip().splitlines()) == 1


BAD_INPUT = [
    (["nosuch"], "invalid choice: 'nosuch' (choose from"),
    (["tiny", "--epochs", "-1"], "--epochs must be at least 1"),
    (["tiny", "--lr", "abc"], "invalid float value: 'abc'"),
    (["tiny", "--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    (["tiny", "--config", "CFG", "--epochs", "1"], "unknown key 'epochz'"),
    (["tiny", "--config", "MISSING.yaml"], "does not exist"),
    (
        ["mnist", "--data-dir", "DATA", "--no-download", "--no-sample-fallback"],
        "full MNIST is not in",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "CFG").write_text("epochz: 3\n")
    args = [str(tmp_path / a) if a in ("CFG", "MISSING.yaml", "DATA") else a for a in args]
    done = (
        run_cli(*args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
        if len(args) > 1
        else run_cli(*args, cwd=tmp_path)
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0] and "Traceback" not in done.stderr
    if args[0] == "nosuch":
        assert "mnist" in lines[0] and "tiny" in lines[0]


def test_wrong_type_in_config_file_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("batch_size: big\n")
    done = run_cli("tiny", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"dmltrain: error: config file {path}: 'batch_size' must be of type int (got 'big')"
    )


def test_register_rejects_options_that_shadow_builtins():
    @dataclass(frozen=True)
    class Clash:
        epochs: int = 1

    with pytest.raises(ValueError, match="epochs"):
        register_experiment("clash", SquareTrainer, Clash)
    with pytest.raises(TypeError):
        register_experiment("notatrainer", object)  # type: ignore[arg-type]


def test_an_experiments_own_defaults_sit_between_the_builtins_and_a_config_file(tmp_path):
    """register_experiment(defaults=...): a port's lr 20, batch 20, seed 1111 and clip 0.25
    without repeating them on each command line; --config and flags still override them
    (cli.py: dataclass defaults < the experiment's < --config FILE < flags)."""
    own = {"lr": 20.0, "batch_size": 20, "seed": 1111, "grad_clip": 0.25, "check_nans": True}
    ported = register_experiment("ported", SquareTrainer, SquareOptions, defaults=own)
    known = {"ported": ported}
    _, config, options = parse(["ported"], known)
    assert (config.lr, config.batch_size, config.seed, config.grad_clip) == (20.0, 20, 1111, 0.25)
    assert config.check_nans is True and config.epochs == 0 and options.width == 4
    path = tmp_path / "c.yaml"
    path.write_text("lr: 5\nepochs: 3\n")
    _, config, _ = parse(["ported", "--config", str(path)], known)
    assert (config.lr, config.epochs, config.seed) == (5.0, 3, 1111)
    _, config, _ = parse(["ported", "--config", str(path), "--lr", "7", "--no-check-nans"], known)
    assert (config.lr, config.check_nans, config.batch_size) == (7.0, False, 20)
    _, plain, _ = parse(["square"], {"square": SQUARE})  # another experiment keeps torch's own
    assert (plain.lr, plain.seed) == (1e-3, 0)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        main(["ported", "--help"], experiments=[ported])
    flat = " ".join(shown.getvalue().split())
    assert "(default: 20.0)" in flat and "(default: 1111)" in flat and "(default: 0.25)" in flat
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["ported", "--print-config", "--seed", "3"], experiments=[ported]) == 0
    assert "\nlr: 20.0\n" in printed.getvalue() and "\nseed: 3\n" in printed.getvalue()
    with pytest.raises(ValueError, match=r"name no built-in setting: \['width'\]"):
        register_experiment("bad", SquareTrainer, SquareOptions, defaults={"width": 3})
    with pytest.raises(ValueError, match="--batch-size must be at least 1"):
        register_experiment("bad", SquareTrainer, defaults={"batch_size": 0})


def test_plot_writes_a_png_of_the_curves(tmp_path):
    run = tmp_path / "run"
    args = ["tiny", "--epochs", "3", "--progress", "off", "--run-dir", str(run)]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plotted = run_cli("plot", str(run), cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    png = (run / "training_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    # loss and metrics by epoch; steps.csv by step: loss, and throughput with data wait
    assert (width, height) == (2400, 450)
    (run / "steps.csv").unlink()
    assert run_cli("plot", str(run), cwd=tmp_path).returncode == 0
    png = (run / "training_curves.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == (1200, 450)  # no steps.csv: by epoch only
    missing = run_cli("plot", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2
    (line,) = missing.stderr.strip().splitlines()
    assert "training_log.csv does not exist: pass a run directory" in line


def test_only_the_command_freezes_what_it_imported():
    """``dmltrain`` (``entry``) takes its imports out of the collector's passes; ``main``,
    called from a script or notebook, leaves the caller's collector as it was."""
    before = gc.get_freeze_count()
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert gc.get_freeze_count() == before
    probe = (
        "import gc, sys\n"
        "from dmltrain.cli import entry\n"
        "sys.argv = ['dmltrain', '--help']\n"
        "try:\n    entry()\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
        "print(gc.get_freeze_count(), file=sys.stderr)\n"
    )
    frozen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert frozen.returncode == 0, frozen.stderr
    assert int(frozen.stderr.split()[-1]) > 100_000  # torch's objects among them


@pytest.mark.parametrize("nprocs", ["1", "2"])
def test_a_run_dir_that_is_a_file_is_one_line(tmp_path, nprocs):
    (tmp_path / "notes").write_text("not a run\n")
    done = run_cli("tiny", "--epochs", "1", "--nprocs", nprocs, "--run-dir",
                   str(tmp_path / "notes"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"--run-dir {tmp_path / 'notes'} is a file, not a directory" in line
    assert (tmp_path / "notes").read_text() == "not a run\n"


def test_the_status_file_counts_the_checkpoints_this_job_saved(tmp_path):
    """--status-file holds the exit status and the checkpoints this job saved, which the
    batch scripts read to requeue a job that keeps losing nodes only while it makes
    progress: a job of one epoch (of 3) saves one and exits 3."""
    status = tmp_path / "status"
    args = ["tiny", "--epochs", "3", "--epochs-per-job", "1", "--progress", "off",
            "--status-file", str(status), "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(args, experiments=[TINY]) == 3
    assert read_status_record(status) == (3, 1)


SHAPED = """
from dataclasses import dataclass, field

from dmltrain import BaseTrainer, register_experiment


@dataclass(frozen=True)
class Options:
    img_size: tuple[int, int] = (720, 1440)
    widths: list[int] = field(default_factory=lambda: [64])
    dropout: tuple[float, ...] | None = None


EXPERIMENT = register_experiment("vit", BaseTrainer, Options)
"""


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--img-size", "16", "32"], {"img_size": [16, 32]}),
        (["--img-size", "16,32", "--widths", "1", "2", "3"], {"img_size": [16, 32],
                                                              "widths": [1, 2, 3]}),
        (["--dropout", "0.1,0.2,0.3"], {"dropout": [0.1, 0.2, 0.3]}),
        ([], {"img_size": [720, 1440], "widths": [64], "dropout": None}),
    ],
)  # fmt: skip
def test_list_and_tuple_options_take_words_or_commas(tmp_path, flags, expected):
    """``img_size: tuple[int, int]`` with ``--img-size 16,32`` became ['1', '6', ',', ...]
    and ``--img-size 16 32`` was refused; both give (16, 32) now, and a config file's list
    comes back as the same tuple."""
    experiment = tmp_path / "vit.py"
    experiment.write_text(SHAPED)
    done = run_cli(str(experiment), *flags, "--print-config", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert {k: printed[k] for k in expected} == expected
    (tmp_path / "saved.yaml").write_text(done.stdout)
    again = run_cli(str(experiment), "--config", str(tmp_path / "saved.yaml"), "--print-config",
                    cwd=tmp_path)  # fmt: skip
    assert yaml.safe_load(again.stdout) == printed


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--img-size", "16"], "argument --img-size: takes 2 values, got 1"),
        (["--img-size", "a,b"], "argument --img-size: a b are not ints"),
    ],
)
def test_bad_list_and_tuple_values_are_one_line(tmp_path, flags, said):
    experiment = tmp_path / "vit.py"
    experiment.write_text(SHAPED)
    done = run_cli(str(experiment), *flags, "--print-config", cwd=tmp_path)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr


def test_an_option_type_no_flag_can_give_is_refused_when_registered(tmp_path):
    experiment = tmp_path / "table.py"
    experiment.write_text(SHAPED.replace("widths: list[int]", "widths: dict[str, int]").replace(
        "lambda: [64]", "dict"))  # fmt: skip
    done = run_cli(str(experiment), "--print-config", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "option 'widths' of experiment 'vit' has type dict[str, int], which a flag cannot give"\
        in done.stderr  # fmt: skip

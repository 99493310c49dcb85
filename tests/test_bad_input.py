"""Bad input and faults that must lose no work and never loop: each ends with one line and
its documented exit status, and what was in the run directory before is there after,
byte for byte. (The Slurm side, a failing rank's job not requeued: test_slurm.)"""

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import AT_ONCE, TINY, assert_same_run, cli_env, run_cli, sigint_at_default

from dmltrain.records import rundir
from dmltrain.runtime.launch import hostname

STEPS = [*TINY, "--epochs", "1", "--checkpoint-every-steps", "4"]


def contents(directory: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target under ``directory``."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            found[name] = str(path.readlink())
        elif path.is_file():
            found[name] = path.read_bytes()
    return found


def one_error(stderr: str) -> str:
    """The one ``dmltrain: error:`` line of a run that stopped on bad input."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("dmltrain: error:")]
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One epoch of 12 steps, a checkpoint every 4 (3 checkpoints)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    done = run_cli(*STEPS, "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("damage", ["truncated", "newer format"])
def test_checkpoints_that_do_not_load_stop_the_run_and_nothing_is_touched(
    finished, tmp_path, damage
):
    """Every checkpoint truncated, or written by a newer dmltrain: extending the run stops
    with one line (exit 2) instead of training from step 0 and rotating them away."""
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(run)], check=True)
    checkpoints = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    assert len(checkpoints) == 3
    for path in checkpoints:
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:1000])
        else:
            state = torch.load(path, weights_only=True)
            torch.save({**state, "format_version": 2}, path)
    before = contents(run)
    done = run_cli(*STEPS, "--epochs", "3", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_error(done.stderr)
    if damage == "truncated":
        assert f"none of the 3 checkpoint(s) in {run / 'checkpoints'} loads" in line, line
        assert "nothing was changed" in line and "pass a new --run-dir" in line
    else:  # the newest, not skipped for an older one
        assert f"checkpoint {checkpoints[-1]} has format 2" in line and "upgrade" in line, line
    assert contents(run) == before


def test_two_runs_in_one_run_directory_one_is_refused(tmp_path):
    """Started together into one --run-dir: one trains, the other stops at once with one
    line (exit 2) and writes nothing; the directory holds the one run's records."""
    run = tmp_path / "run"
    args = [*STEPS, "--step-sleep", "0.1", "--run-dir", str(run)]
    procs = {
        lr: subprocess.Popen(
            [sys.executable, "-m", "dmltrain", *args, "--lr", lr],
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for lr in ("0.001", "0.01")
    }
    ends = {}
    for lr, proc in procs.items():
        err = proc.communicate(timeout=300)[1]
        ends[lr] = (proc.returncode, err)
    (winner,) = [lr for lr, (code, _) in ends.items() if code == 0]
    (loser,) = [lr for lr, (code, _) in ends.items() if code != 0]
    assert ends[loser][0] == 2
    line = one_error(ends[loser][1])
    assert f"run directory {run} is in use by another run" in line, line
    assert f"lr: {winner}" in (run / "config.yaml").read_text()
    assert len((run / "training_log.csv").read_text().splitlines()) == 2
    assert json.loads((run / "outcome.json").read_text())["status"] == "done"


def test_default_run_directories_never_collide(tmp_path, monkeypatch):
    """Two runs started in the same second get runs/NAME-TIME and runs/NAME-TIME-2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-000000")
    first, second = rundir.default_path("tiny", None), rundir.default_path("tiny", None)
    assert (first, second) == ("runs/tiny-20260101-000000", "runs/tiny-20260101-000000-2")
    assert Path(first).is_dir() and Path(second).is_dir()
    assert rundir.default_path("tiny", "123") == "runs/tiny-123"  # a job's, on every requeue


def test_a_full_disk_at_an_epochs_end_is_one_line_and_the_log_is_written_later(small_disk):
    """The disk is full from step 3 to step 15: the epoch-1 row of training_log.csv cannot
    be written (one warning), epoch 2 writes both rows; no partial file is left, and the run
    ends as one that never lacked space."""
    run, reference = small_disk / "run", small_disk / "reference"
    args = [*TINY, "--epochs", "2", "--features", "2048", "--checkpoint-every-steps", "2"]
    done = run_cli(*args, "--fill-disk-at-step", "3", "--free-disk-at-step", "15",
                   "--fill-disk-leave", "0", "--run-dir", str(run), cwd=small_disk)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "training_log.csv" in line]
    assert f"cannot write {run / 'training_log.csv'}: no space left on its file system" in line
    assert "writes it again at the next epoch" in line, line
    assert not [p.name for p in run.rglob(".*tmp*")]
    ok = run_cli(*args, "--run-dir", str(reference), cwd=small_disk)
    assert ok.returncode == 0, ok.stderr
    assert_same_run(reference, run)


def test_a_disk_full_to_the_end_leaves_the_records_whole(small_disk):
    """The second job of a run fills the disk and it stays full: its last checkpoint cannot
    be written (exit 2, one line); outcome.json and training_log.csv hold the first job's
    records, whole, and no partial file is left."""
    run = small_disk / "run"
    args = [*TINY, "--epochs", "1", "--features", "2048", "--run-dir", str(run)]
    assert run_cli(*args, cwd=small_disk).returncode == 0
    before = {name: (run / name).read_bytes() for name in ("outcome.json", "training_log.csv")}
    done = run_cli(*args, "--epochs", "2", "--fill-disk-at-step", "14", "--fill-disk-leave", "0",
                   cwd=small_disk)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "no space left for checkpoint" in one_error(done.stderr)
    assert {name: (run / name).read_bytes() for name in before} == before
    assert json.loads(before["outcome.json"])["status"] == "done"
    assert not [p.name for p in run.rglob(".*tmp*")]


def test_a_disk_that_holds_the_last_checkpoint_once_still_ends_the_run_done(small_disk):
    """The step checkpoint of the last step fits, and its rewrite at the epoch's end does
    not: the run exits 0 and says that the checkpoint of that step stands (it exited 2
    'failed', naming an older checkpoint as the last good one)."""
    run = small_disk / "run"
    args = [*TINY, "--epochs", "1", "--features", "2048", "--checkpoint-every-steps", "12"]
    done = run_cli(*args, "--fill-disk-at-step", "11", "--fill-disk-leave", "320",
                   "--run-dir", str(run), cwd=small_disk)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "error" not in done.stderr
    step = run / "checkpoints" / "ckpt-000001-00000012.pt"
    (line,) = [line for line in done.stderr.splitlines() if "no space left" in line]
    assert f"{step}, of the same step, stands" in line, line
    assert (run / "checkpoints" / "latest.pt").resolve() == step
    assert json.loads((run / "outcome.json").read_text())["status"] == "done"
    assert not [p.name for p in run.rglob(".*tmp*")]
    (run / "filler").unlink()  # the run goes on from that checkpoint as from any
    more = run_cli(*args, "--epochs", "2", "--run-dir", str(run), cwd=small_disk)
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"resuming from {step}" in more.stdout + more.stderr
    reference = small_disk / "reference"
    ok = run_cli(*args, "--epochs", "2", "--run-dir", str(reference), cwd=small_disk)
    assert ok.returncode == 0, ok.stderr
    assert_same_run(reference, run)


def test_a_full_disk_during_sharded_saves_is_a_line_each_and_nothing_is_left(small_disk):
    """FSDP on 2 processes, sharded checkpoints, the disk full from step 3 to step 7: each
    save that cannot be written is one warning (6 to 12 tracebacks and a temporary folder
    left behind before); the run ends 0 with its last checkpoint whole."""
    run = small_disk / "run"
    done = run_cli(*STEPS, "--nprocs", "2", "--batch-size", "4", "--strategy", "fsdp",
                   "--features", "2048", "--checkpoint-every-steps", "2",
                   "--fill-disk-at-step", "3", "--free-disk-at-step", "7",
                   "--fill-disk-leave", "0", "--run-dir", str(run), cwd=small_disk)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "no space left for checkpoint" in line]
    assert len(said) == 2 and "the last good checkpoint is " in said[0], done.stderr[-3000:]
    assert not [p.name for p in run.rglob(".*tmp*")]
    latest = (run / "checkpoints" / "latest.dcp").resolve()
    assert latest.name == "ckpt-000001-00000012.dcp" and (latest / ".metadata").is_file()


def test_a_status_file_in_a_missing_folder_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    status = tmp_path / "nodir" / "status"
    done = run_cli(*STEPS, "--status-file", str(status), "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2
    assert f"--status-file {status}: the folder {status.parent} does not exist" in one_error(
        done.stderr
    )
    assert not run.exists()


@pytest.mark.parametrize("bad", ["resume", "load-weights", "run directory"])
def test_bad_input_that_rank_0_finds_is_one_line_under_two_processes(finished, tmp_path, bad):
    """A checkpoint that does not load, found by rank 0 and handed to every rank: rank 0
    says it once; the other rank and the --nprocs parent add nothing (each rank said it,
    then torch's warning that it stopped the other, then the parent's line)."""
    run = tmp_path / "run"
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    flags = {"resume": ["--resume", str(junk)], "load-weights": ["--load-weights", str(junk)],
             "run directory": []}[bad]  # fmt: skip
    if bad == "run directory":
        subprocess.run(["cp", "-a", str(finished), str(run)], check=True)
        for path in (run / "checkpoints").glob("ckpt-*.pt"):
            path.write_bytes(path.read_bytes()[:100])
    done = run_cli(*STEPS, "--nprocs", "2", *flags, "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    # rank 0's warnings of the corrupt ones it skipped, then its one line
    said = [line for line in done.stderr.splitlines() if not line.startswith("WARNING: checkpoint")]
    assert len(said) == 1, done.stderr[-3000:]
    line = one_error(done.stderr)
    assert "[rank" not in line, line
    assert any(says in line for says in ("is not a checkpoint", "loads", "holds none of")), line


@pytest.mark.parametrize("where", ["train_step", "create_model"])
def test_a_rank_that_fails_in_its_own_code_is_named_and_the_run_fails(tmp_path, where):
    """Rank 1 raises (a bug): rank 0 stops at once with a line naming rank 1 and its error,
    exit status 1, not 5 (a lost peer, which the batch scripts requeue); the record says
    failed."""
    run = tmp_path / "run"
    step = "5" if where == "train_step" else "-2"
    done = run_cli(*STEPS, "--nprocs", "2", "--raise-rank", "1", "--raise-at-step", step,
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "[rank 0] stopping:" in line]
    assert f"rank 1 on {hostname()} failed: RuntimeError: a bug in {where}" in line, line
    assert "not a lost node, so nothing is requeued" in line and line.endswith("(exit status 1)")
    assert "exit status 5" not in done.stderr
    assert json.loads((run / "outcome.json").read_text())["status"] == "failed"


# Flags that were taken silently or raised from deep inside; each now stops before anything
# starts (in this process: nothing is trained).
BAD_FLAGS = [
    (["--max-time", "-1"], "--max-time '-1': give a duration like"),
    (["--lr", "inf"], "--lr must be a positive number (got inf)"),
    (["--weight-decay", "inf"], "--weight-decay must be a number >= 0 (got inf)"),
    (["--load-weights", "a.pt", "--resume", "a.pt"], "give one of them"),
    (["--profile-steps", "1:2", "--profile-ranks", "7"],
     "--profile-ranks 7: this run has 1 process(es), ranks 0 to 0"),
    (["--preempt-check-seconds", "inf"], "--preempt-check-seconds must be a number >= 0"),
    (["--dist-timeout", "inf"], "--dist-timeout must be positive seconds, at most a day"),
    (["--init-timeout", "0"], "--init-timeout must be positive seconds, at most a day"),
    (["--hang-timeout", "inf"], "--hang-timeout must be a number >= 0"),
    (["--preempt-signals", "SIGTERM,SIGKILL"], "--preempt-signals: SIGKILL cannot be caught"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[f[0][0] for f in BAD_FLAGS])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    from dmltrain.cli import main

    code = main(["tiny", *flags, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in one_error(err), err
    assert not (tmp_path / "run").exists()


def test_a_yaml_float_without_a_dot_is_read_as_a_number(tmp_path):
    from dmltrain.cli import discover_experiments, parse

    (tmp_path / "c.yaml").write_text("lr: 1e-3\nweight_decay: 5E-4\n")
    _, config, _ = parse(["tiny", "--config", str(tmp_path / "c.yaml")], discover_experiments())
    assert (config.loop.lr, config.loop.weight_decay) == (1e-3, 5e-4)


# Experiments that break the contract: (the method, as the user wrote it; what is said).
BROKEN = {
    "train_step returns None": ("def train_step(self, batch):\n        return None",
                                "train_step must return the loss (a scalar tensor) or (loss, "
                                "dict of metrics); it returned a NoneType as the loss"),
    "train_step returns a float": ("def train_step(self, batch):\n        return 1.0",
                                   "it returned a float as the loss"),
    "a loss that is not a scalar": (
        "def train_step(self, batch):\n        x, y = batch\n"
        "        return (self.model(x) - y) ** 2", "its loss has shape (8, 1): reduce it"),
    "a loss without grad": (
        "def train_step(self, batch):\n        x, y = batch\n"
        "        return ((self.model(x) - y) ** 2).mean().detach()",
        "its loss does not require grad"),
    "val_step returns a tensor": (
        "def val_step(self, batch):\n        x, y = batch\n"
        "        return ((self.model(x) - y) ** 2).mean()",
        "val_step must return a dict of metrics (e.g. {'loss': loss}); it returned a Tensor"),
    "a model without parameters": ("def create_model(self):\n        return torch.nn.ReLU()",
                                   "create_model returned a ReLU with no trainable parameters"),
    "one dataset": ("def create_datasets(self):\n        return self.data()[0]",
                    "create_datasets must return (train dataset, validation dataset or None); "
                    "it returned a TensorDataset"),
    "samples of two shapes": (
        "def create_datasets(self):\n        return Ragged(), None",
        "the dataset's samples differ in shape (stack expects each tensor to be equal size"),
    "an empty validation set": (
        "def create_datasets(self):\n        return self.data()[0], TensorDataset("
        "torch.zeros(0, 4), torch.zeros(0, 1))", "the validation dataset is empty"),
    "a failing import": ("import no_such_module_here", "importing {file} failed, line 9: "
                         "ModuleNotFoundError: No module named 'no_such_module_here'"),
    "a syntax error": ("def train_step(self, batch) return 1", "{file}, line 9: "),
}  # fmt: skip

EXPERIMENT = """import torch
from torch.utils.data import Dataset, TensorDataset

from dmltrain import BaseTrainer, register_experiment


class Broken(BaseTrainer):
    name = "broken"
    {method}

    def data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=g)
        return TensorDataset(x, x.sum(1, keepdim=True)), TensorDataset(x[:8], x[:8, :1])

    def create_model(self):
        return torch.nn.Linear(4, 1)

    def create_datasets(self):
        return self.data()

    def train_step(self, batch):
        x, y = batch
        return ((self.model(x) - y) ** 2).mean()

    def val_step(self, batch):
        x, y = batch
        return {{"loss": ((self.model(x) - y) ** 2).mean()}}


class Ragged(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(3 + i % 2), torch.zeros(1)


EXPERIMENT = register_experiment("broken", Broken)
"""


@pytest.mark.parametrize("case", BROKEN)
def test_an_experiment_that_breaks_the_contract_is_told_which_method_and_what(tmp_path, case):
    method, message = BROKEN[case]
    file = tmp_path / "broken.py"
    # the first definition of a name in a class body is overridden by a later one: put the
    # broken method last
    text = EXPERIMENT.replace("    {method}\n", "")
    if method.startswith(("import", "def train_step(self, batch) return")):
        lines = text.splitlines()
        lines.insert(8, "    " + method)
        text = "\n".join(lines) + "\n"
    else:
        text = text.replace("\n\nclass Ragged", f"\n    {method}\n\n\nclass Ragged")
    file.write_text(text)
    done = run_cli(str(file), "--epochs", "1", "--batch-size", "8", "--progress", "off",
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert message.replace("{file}", str(file)) in one_error(done.stderr), done.stderr


def test_resume_from_what_is_not_a_checkpoint_says_what_to_pass(finished, tmp_path):
    for given, message in (
        (finished, "is a directory, not a checkpoint: pass one of its checkpoint files"),
        (finished / "config.yaml", "is not a checkpoint (not a file that torch.save wrote)"),
    ):
        done = run_cli(*STEPS, "--resume", str(given), "--run-dir", str(tmp_path / "r"),
                       cwd=tmp_path)  # fmt: skip
        assert done.returncode == 2 and message in one_error(done.stderr), done.stderr
        assert "weights_only" not in done.stderr
    run = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(finished), str(run)], check=True)
    before = contents(run)
    done = run_cli(*STEPS, "--resume", "never", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2
    assert "already holds a run with checkpoints: --resume never starts a new run only in a " \
        "new --run-dir" in one_error(done.stderr)  # fmt: skip
    assert contents(run) == before


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` mounted over itself read-only, read-only for root too (needs root, as
    in CI), while the block runs."""
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_resuming_into_a_read_only_run_directory_is_one_line(finished, tmp_path):
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(run)], check=True)
    before = contents(run)
    with read_only(run):
        done = run_cli(*STEPS, "--epochs", "2", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cannot write in the run directory {run}: Read-only" in one_error(done.stderr)
    assert contents(run) == before


def test_the_tools_on_broken_files_are_one_line(finished, tmp_path):
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(run)], check=True)
    nowhere = run_cli("plot", str(run), "-o", str(tmp_path / "nodir" / "x.png"), cwd=tmp_path)
    assert nowhere.returncode == 2
    assert f"cannot write {tmp_path / 'nodir' / 'x.png'}" in one_error(nowhere.stderr)
    with open(run / "steps.csv", "a") as steps:  # a run stopped while writing a row
        steps.write("13,1,0.5")
    partial = run_cli("plot", str(run), cwd=tmp_path)
    assert partial.returncode == 0, partial.stderr[-3000:]
    log = run / "training_log.csv"
    log.write_text(log.read_text().replace("\n1,", "\nx,", 1))
    text = run_cli("plot", str(run), cwd=tmp_path)
    assert text.returncode == 2 and "holds a value that is not a number" in one_error(text.stderr)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text('{"experiment": "tiny", "tri')
    status = run_cli("sweep", "status", str(sweep), cwd=tmp_path)
    assert status.returncode == 2 and f"{sweep / 'sweep.json'} cannot be read" in one_error(
        status.stderr
    )


def test_a_rendezvous_port_in_use_says_so(tmp_path):
    """MASTER_PORT taken by another program: one line saying so, at once. Rank 1, blocked
    connecting to that port, cannot act on a SIGTERM: it is killed once rank 0's line had
    its time (torch's spawn would send SIGTERM and wait 30 s more, saying so)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        started = time.monotonic()
        done = run_cli(*STEPS, "--nprocs", "2", "--run-dir", str(tmp_path / "run"),
                       cwd=tmp_path, MASTER_PORT=port)  # fmt: skip
    assert time.monotonic() - started < 60  # not --dist-timeout's 300 s
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"the rendezvous port {port} is in use by another program: set MASTER_PORT" in (
        done.stderr
    )
    assert "dmltrain: rank 0 failed first (exit code 2)" in done.stderr
    assert "SIGTERM" not in done.stderr, done.stderr[-3000:]


def test_a_copied_sweep_runs_its_trials_in_the_copy(tmp_path):
    from dmltrain.tools.sweep import Sweep

    first = Sweep(tmp_path / "first")
    first.create("tiny", ["--epochs", "1"], [{"lr": 0.1}])
    subprocess.run(["cp", "-a", str(tmp_path / "first"), str(tmp_path / "copy")], check=True)
    args = Sweep(tmp_path / "copy").args(0)
    assert args.count("--run-dir") == 1
    assert args[args.index("--run-dir") + 1] == str((tmp_path / "copy" / "trial-0").resolve())


def wait_for_torch_to_load(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``proc`` maps torch's library: dmltrain's command is running and imports torch.
    A signal before that reaches Python's own start-up (its site packages' .pth files),
    whose KeyboardInterrupt is the interpreter's, not dmltrain's; on a loaded machine that
    start-up alone can outlast a fixed wait."""
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:  # it ended meanwhile: poll() says how
            pass
        time.sleep(0.01)
    raise AssertionError(f"torch was never loaded (exit status {proc.returncode})")


@pytest.mark.parametrize("after", [0.0, 1.5])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, after):
    """SIGINT while the command starts (as torch's library loads: torch being imported; 1.5 s
    later: imported, or the run set up): one line and exit 130, or, once the run catches
    signals, a preemption (exit 3); never a traceback, never a run that goes on. The steps
    sleep, so that the signal never comes once the run has ended (a process in its teardown
    dies of it, as any does)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "dmltrain", *STEPS, "--step-sleep", "0.2",
                             "--run-dir", str(tmp_path / "run")], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_at_default)  # fmt: skip
    wait_for_torch_to_load(proc)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err[-3000:]
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1] in (
            "dmltrain: interrupted while starting",
            "dmltrain: interrupted",
        ), err[-2000:]
    else:
        assert proc.returncode == 3 and "preempted (SIGINT)" in err, (proc.returncode, err)


def test_workers_whose_nprocs_parent_is_killed_say_so_and_save(tmp_path):
    """kill -9 of the --nprocs parent: its workers (told by SIGINT) save a checkpoint and
    say that the parent ended, not that they were preempted by a SIGINT; the run resumes."""
    import signal

    run = tmp_path / "run"
    args = [*STEPS, "--epochs", "3", "--nprocs", "2", "--step-sleep", "0.2", "--progress",
            "log", "--log-every", "1", *AT_ONCE, "--run-dir", str(run)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "dmltrain", *args], cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 3/" in line:
            proc.send_signal(signal.SIGKILL)
            break
    out = proc.stdout.read()  # until the workers, which share the pipe, have ended
    proc.wait(timeout=60)
    assert "preempted (the --nprocs parent process ended): checkpoint saved" in out, out[-3000:]
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "dmltrain: resuming from" in resumed.stdout, resumed.stderr


def test_a_best_metric_not_in_the_log_is_said_once(tmp_path):
    done = run_cli(*TINY, "--best-metric", "val_los", "--run-dir", str(tmp_path / "run"),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "--best-metric val_los" in line]
    assert (
        len(lines) == 1 and "is not in the training log (it has train_loss, val_loss" in (lines[0])
    ), done.stderr


def test_an_experiment_file_named_like_a_standard_module_says_rename_it(tmp_path):
    file = tmp_path / "copy.py"
    file.write_text(EXPERIMENT.replace("    {method}\n", ""))
    (tmp_path / "elsewhere").mkdir()  # run from beside it, copy.py would shadow Python's own
    done = run_cli(str(file), "--epochs", "1", cwd=tmp_path / "elsewhere")
    assert done.returncode == 2
    assert f"{file} has the name of a module Python already has (copy)" in one_error(done.stderr)


def test_a_batch_size_that_the_global_batch_overrides_is_said(tmp_path):
    done = run_cli(*STEPS, "--batch-size", "4", "--global-batch-size", "8", "--run-dir",
                   str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "WARNING: --global-batch-size 8 on 1 process(es) sets --batch-size 8, not the 4 " \
        "given" in done.stderr  # fmt: skip


LOADER = """
import torch
from torch.utils.data import DataLoader

batches = DataLoader(torch.arange(8), batch_size=2, num_workers=1, timeout=10)
print("samples", sum(len(batch) for batch in batches))
"""


def test_a_temporary_directory_too_long_for_the_loader_workers_sockets_is_said_at_once():
    """TMPDIR one character longer than the loader's workers can hand batches over from
    (a real DataLoader with a worker: it fails there, and works one character shorter):
    one line before training, not the loader's error minutes later. --nprocs, whose fork
    server listens on a socket of the same path, starts its workers without it there."""
    from dmltrain.runtime.processes import loader_workers_problem

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # tmp_path may be too long a path already
    try:
        name = "d"
        while loader_workers_problem(str(base / (name + "d"))) is None:
            name += "d"
        fits, too_long = base / name, base / (name + "d")
        fits.mkdir()
        too_long.mkdir()
        assert loader_workers_problem(str(fits)) is None
        for directory, works in ((fits, True), (too_long, False)):
            env = {**cli_env(), "TMPDIR": str(directory)}
            done = subprocess.run([sys.executable, "-c", LOADER], env=env, capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
            assert (done.returncode == 0) is works, done.stderr[-2000:]
            assert ("samples 8" in done.stdout) is works
            assert ("AF_UNIX path too long" in done.stderr) is not works
        started = time.monotonic()
        done = run_cli(*TINY, "--num-workers", "1", "--run-dir", str(base / "run"), cwd=base,
                       TMPDIR=str(too_long))  # fmt: skip
        assert time.monotonic() - started < 60  # not the loader's timeout
        assert done.returncode == 2
        assert f"the temporary directory {too_long} (TMPDIR) is too long a path" in one_error(
            done.stderr
        )
        done = run_cli(*TINY, "--epochs", "1", "--nprocs", "2", "--run-dir",
                       str(base / "spawned"), cwd=base, TMPDIR=str(too_long))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        done = run_cli(*TINY, "--nprocs", "2", "--start-method", "forkserver", "--run-dir",
                       str(base / "asked"), cwd=base, TMPDIR=str(too_long))  # fmt: skip
        assert done.returncode == 2
        assert "--start-method forkserver: the temporary directory" in one_error(done.stderr)
    finally:
        shutil.rmtree(base)


def test_a_nan_stop_on_two_processes_is_one_line(tmp_path):
    """--on-nan raise on 2 processes: rank 0's line and no more (the parent's SIGTERM of
    the other rank, torch's warning of it and a C++ store stack came with it)."""
    done = run_cli(*STEPS, "--nprocs", "2", "--check-nans", "--on-nan", "raise", "--nan-rank",
                   "1", "--nan-at-step", "3", "--run-dir", str(tmp_path / "run"),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 4, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1, done.stderr[-3000:]
    assert said[0].startswith("dmltrain: stopped: NaN check:"), said


def test_a_read_only_run_directory_on_two_processes_is_one_line(tmp_path):
    """A run directory mounted read-only (for root too: needs root, as in CI): one line
    before training, exit 2, where rank 0 failed at config.yaml and rank 1 added C++ store
    stacks and 'exit status 5'."""
    run = tmp_path / "run"
    run.mkdir()
    with read_only(run):
        done = run_cli(*STEPS, "--nprocs", "2", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        f"dmltrain: error: cannot write in the run directory {run}: Read-only file system; "
        "pass another --run-dir"
    )

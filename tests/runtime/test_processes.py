"""Workers of ``nprocs`` started from a notebook (dmltrain/runtime/processes.py): a trainer class
defined in a Jupyter cell trains on 2 processes (forks of the kernel), survives the
cell's interrupt, resumes bitwise, and runs unchanged as a script under Slurm.

Real notebooks in a real kernel: nbclient and jupyter_client drive ipykernel (installed
with the dev extra); the Slurm job is a real one on the local cluster.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest
import torch
from helpers import (
    assert_same_run,
    cli_env,
    job_field,
    run_cli,
    run_fresh,
    sbatch,
    wait_for,
)
from jupyter_client.manager import KernelManager

# The class a user writes in a cell: dropout, so every step draws random numbers.
LINE = """
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, TrainConfig
from dmltrain.runtime.strategies import unwrap


class Line(BaseTrainer):
    sleep = 0.0  # seconds in each step, for an interrupt to land mid-epoch

    def create_model(self):
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

    def create_datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(160, 4, generator=g)
        y = x.sum(1, keepdim=True)
        return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])

    def train_step(self, batch):
        time.sleep(self.sleep)
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def on_train_end(self):
        if self.dist.is_main:
            torch.save(unwrap(self.model).state_dict(), self.run_dir / "final_weights.pt")
"""

# The same class as a script (README: "From a notebook to a cluster").
SCRIPT = (
    LINE
    + """
from dmltrain import register_experiment
from dmltrain.cli import main

EXPERIMENT = register_experiment("line", Line)

if __name__ == "__main__":
    raise SystemExit(main(experiments=[EXPERIMENT]))
"""
)

CHILDREN = (
    "import os, subprocess\n"
    "print('children', subprocess.run(['pgrep', '-P', str(os.getpid())], capture_output=True,"
    " text=True).stdout.split())"
)


def fit(run_dir: str, nprocs: int = 2, epochs: int = 2, extra: str = "") -> str:
    return (
        f"rows = Line(TrainConfig(epochs={epochs}, batch_size=8, nprocs={nprocs}, "
        f"run_dir={run_dir!r}{extra})).fit()\nprint('rows', len(rows))"
    )


def texts(cell) -> tuple[str, list]:
    """A cell's stream text, and its error outputs."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    return text, [o for o in cell.outputs if o.output_type == "error"]


def test_a_notebook_class_trains_on_two_processes_and_as_a_script_under_slurm(tmp_path, slurm):
    cells = [
        LINE,
        fit("nb2"),
        CHILDREN,
        fit("nb1", nprocs=1, epochs=1),
        # No GPU here: CUDA "already used" in the kernel is faked to see the message.
        "import torch\ntorch.cuda.is_initialized = lambda: True\n" + fit("nbcuda"),
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            allow_errors=True).execute(cwd=str(tmp_path))  # fmt: skip
    two, one, cuda = notebook.cells[1], notebook.cells[3], notebook.cells[4]

    text, errors = texts(two)
    assert not errors and "Traceback" not in text, text
    assert "rows 2" in text  # fit() returned the training log's rows in the kernel
    assert "epoch 2/2 train_loss" in text  # rank 0's lines reach the cell
    assert "global batch 16 (2 process(es) x 8)" in text and "batch_size: 8" not in text
    assert "children []" in texts(notebook.cells[2])[0]  # no worker outlives the call
    # One process, in the kernel: tqdm's notebook widget, not lines
    text, errors = texts(one)
    assert not errors and "rows 1" in text, text
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               for o in one.outputs if o.output_type == "display_data")  # fmt: skip
    text, errors = texts(cuda)
    assert len(errors) == 1 and errors[0].ename == "UserError", cuda.outputs
    assert errors[0].traceback == [
        "dmltrain: Line is defined where a new process cannot import it (a notebook), so its "
        "workers are forks of this process, and CUDA was already used here: restart the "
        "kernel and call fit() before any CUDA call, or move the class into a .py file and "
        "import it from there"
    ]

    # The same class in a file, run by slurm/run.sh as 2 tasks: the same weights, bitwise.
    (tmp_path / "line.py").write_text(SCRIPT)
    job = sbatch(tmp_path, "line.py", "--epochs", "2", "--batch-size", "8", "--run-dir",
                 str(tmp_path / "script"), "--progress", "log")  # fmt: skip
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 180, f"job {job} to complete")
    assert_same_run(tmp_path / "nb2", tmp_path / "script")


def test_a_class_from_python_stdin_trains_on_two_processes(tmp_path):
    """``python -`` has no file for spawn to import again, as a kernel has none."""
    done = subprocess.run(
        [sys.executable, "-"], input=LINE + fit("stdin", extra=", progress='log'"),
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rows 2" in done.stdout and (tmp_path / "stdin" / "final_weights.pt").is_file()


class Kernel:
    """A real Jupyter kernel, driven as a notebook front end drives it."""

    def __init__(self, cwd: Path, gpus: bool = False) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env=cli_env(gpus))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, interrupt_at: str | None = None, timeout: float = 300):
        """Execute a cell; interrupt it (as Jupyter's button does) once its output holds
        ``interrupt_at``. Returns the cell's stream text and its error messages."""
        msg_id = self.client.execute(code)
        text, errors, deadline = "", [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text += content["text"]
                if interrupt_at and interrupt_at in text:
                    self.manager.interrupt_kernel()
                    interrupt_at = None
            elif kind == "error":
                errors.append(content)
            elif kind == "status" and content["execution_state"] == "idle":
                return text, errors
        raise AssertionError(f"the cell did not finish in {timeout} s: {text[-2000:]}")

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def test_interrupting_the_cell_checkpoints_and_running_it_again_resumes_bitwise(tmp_path):
    kernel = Kernel(tmp_path)
    try:
        text, errors = kernel.run(LINE)
        assert not errors, errors
        text, errors = kernel.run(fit("full", extra=", progress='log'"))
        assert not errors and "rows 2" in text, (text, errors)

        cut = fit("cut", extra=", progress='log', log_every=1")
        kernel.run("Line.sleep = 0.2")
        text, errors = kernel.run(cut, interrupt_at="epoch 1/2 step 2/8")
        # One line ends the cell: no traceback from the kernel or from any worker.
        assert len(errors) == 1 and errors[0]["ename"] == "StopForRequeue", errors
        assert len(errors[0]["traceback"]) == 1, errors[0]["traceback"]
        assert errors[0]["traceback"] == [
            "dmltrain: checkpoint saved; run the same again to resume (exit status 3)"
        ]
        assert "Traceback" not in text, text
        # after the progress lines, rank 0's one line (the others leave by themselves)
        after = text.rsplit("epoch 1/2 step", 1)[1].splitlines()[1:]
        assert [line for line in after if line.strip()] == [after[0]], after
        assert after[0].startswith("dmltrain: preempted (SIGINT): checkpoint saved at epoch 1")
        assert "rows" not in text and "epoch 2/2 train_loss" not in text  # stopped mid-way
        assert list((tmp_path / "cut" / "checkpoints").glob("*.pt"))
        text, _ = kernel.run(CHILDREN)
        assert "children []" in text, text

        kernel.run("Line.sleep = 0.0")
        text, errors = kernel.run(cut)  # the same cell again
        assert not errors and "rows 2" in text, (text, errors)
        assert "resum" in text.lower(), text
    finally:
        kernel.close()
    assert_same_run(tmp_path / "full", tmp_path / "cut")


GPUS = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")
def test_on_gpus_forks_train_and_a_kernel_that_used_cuda_gets_the_line(tmp_path):
    kernel = Kernel(tmp_path, gpus=True)
    try:
        kernel.run(LINE)
        if GPUS >= 2:  # one process per GPU, NCCL
            text, errors = kernel.run(fit("gpus", extra=", progress='log'"))
            assert not errors and "rows 2" in text and "backend nccl" in text, (text, errors)
        text, errors = kernel.run("torch.zeros(1, device='cuda')\n" + fit("used"))
        assert len(errors) == 1 and "CUDA was already used here" in errors[0]["evalue"], errors
    finally:
        kernel.close()


def test_the_open_files_limit_is_raised_to_what_the_site_allows():
    """A soft limit of 256 under a hard one of 4,096 (as clusters set them): a rank opens
    a socket a peer and more, so the soft limit is raised to the hard one at start."""
    import resource

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    code = "from dmltrain.runtime.processes import raise_open_files_limit as r; print(r())"
    done = subprocess.run([sys.executable, "-c", code], preexec_fn=low, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4096"


def test_the_fork_server_leaves_without_the_teardown_of_what_it_preloaded():
    """The server ends by SystemExit when its parent has gone; its workers are told their
    parent died only once it has left. What it preloaded registered exit handlers (torch's)
    that the teardown would run first: the last preloaded module skips them."""
    from dmltrain.runtime.processes import FORKSERVER_PRELOAD

    code = (
        "import atexit, sys\n"
        "atexit.register(print, 'teardown ran', flush=True)\n"  # what torch's handlers are
        f"__import__({FORKSERVER_PRELOAD[-1]!r})\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and "teardown ran" not in done.stdout, (done.stdout, done.stderr)


def marked(mark: str) -> list[str]:
    """The processes alive whose environment holds ``LEFTOVER_MARK=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if f"LEFTOVER_MARK={mark}".encode() in (entry / "environ").read_bytes():
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80])
        except (OSError, NotADirectoryError):
            continue
    return found


def test_nothing_outlives_a_run_whose_rank_was_killed(tmp_path):
    """kill -9 of rank 1 of --nprocs 2 --num-workers 2: its loader workers and their fork
    server lived on with parent 1 (each waiting for the other), about 240 MB each; now
    none of the run's processes is left once it has ended (exit 5)."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    done = run_cli("tiny", "--nprocs", "2", "--num-workers", "2", "--epochs", "2",
                   "--batch-size", "4", "--die-rank", "1", "--die-at-step", "3",
                   "--progress", "off", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                   LEFTOVER_MARK=mark)  # fmt: skip
    assert done.returncode == 5, done.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in done.stderr
    wait_for(lambda: not marked(mark), 10, "the run's processes to be gone")


def test_a_killed_rank_0_is_said_in_dmltrains_lines_alone_and_leaves_no_semaphore(tmp_path):
    """kill -9 of rank 0 of --nprocs 2 --num-workers 2: rank 1's line and the launcher's,
    with no C++ frames of torch's socket warnings, no "Terminating process" log, and no
    resource tracker's "leaked semaphore objects": the killed rank's semaphores are gone
    from /dev/shm before the tracker ends (a fresh interpreter: its own tracker)."""
    from dmltrain.runtime import processes

    before = processes._semaphores()
    args = ["tiny", "--nprocs", "2", "--num-workers", "2", "--epochs", "2", "--batch-size", "4",
            "--die-rank", "0", "--die-at-step", "3", "--progress", "off",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    done = run_fresh(args, tmp_path, cli_env())
    assert done.returncode == 5, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 2, done.stderr[-3000:]
    assert lines[0].startswith("dmltrain: [rank 1] stopping: lost contact with rank 0")
    assert lines[1] == (
        "dmltrain: rank 0 was killed by SIGKILL; the other ranks stopped, the "
        "checkpoints are intact: run the same command to resume (exit status 5)"
    )
    # none left that no process holds (another test's beside it may be in use)
    assert not processes.unheld(processes._semaphores() - before)


def test_workers_with_loader_workers_hand_back_their_semaphores(tmp_path):
    """--nprocs 2 --num-workers 1: the run ends without the resource tracker's "2 leaked
    semaphore objects" (each worker left before multiprocessing's end of a process)."""
    args = ["tiny", "--nprocs", "2", "--num-workers", "1", "--epochs", "1", "--batch-size", "4",
            "--progress", "off", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    done = run_fresh(args, tmp_path, cli_env())  # its own resource tracker, not a zygote's
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]


def test_semaphores_a_live_process_holds_are_never_handed_back():
    """_hand_back unlinks a killed rank's semaphores, not those of processes still running
    beside it (another run's loader workers): every semaphore this process holds stays. It
    read each process's memory map once for the first semaphore only, and unlinked the
    others of live processes, whose loaders then failed."""
    import multiprocessing

    from dmltrain.runtime import processes

    before = processes._semaphores()
    spawn = multiprocessing.get_context("spawn")  # named semaphores, kept until released
    held = [spawn.Semaphore() for _ in range(3)]
    names = {lock._semlock.name for lock in held}
    assert names <= processes._semaphores()
    processes._hand_back(before)
    assert names <= processes._semaphores()
    del held

"""An interpreter that has imported torch once and forks each ``python -m dmltrain`` run of
the tests from itself (``helpers.run_cli``).

Most of a short run's CPU is its imports: torch, then torch._dynamo, which torch's first
optimizer imports. Hundreds of the suite's runs paid them on two cores. A run forked from here
is the same code in a process of its own, started the way dmltrain starts the workers of
``--nprocs`` (its fork server preloads the same two modules): its own pid, exit status,
working directory, standard streams and ``sys.argv``, and ``__main__`` set up as ``python -m``
does. It is only used where nothing read at interpreter start differs: the run's environment
must be the one this interpreter started with, but for the variables read later
(``LATE_NAMES``, ``LATE_PREFIXES``); ``Zygote.run`` returns None otherwise, and the caller
starts a fresh interpreter. Nothing of dmltrain, the tests or the experiments is imported
here, so each run imports the files as they are when it starts.

Protocol on this process's stdin and stdout: length-prefixed pickles. A request is ``(cwd,
argv, the late variables, stdout FIFO, stderr FIFO)``; the answer is the run's pid, then its
exit status as ``subprocess`` reports it (negative: the signal that ended it).
"""

import contextlib
import locale
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_LENGTH = struct.Struct("!I")
# What may differ between the zygote's environment and a run's: variables read only after
# start-up. pytest sets PYTEST_CURRENT_TEST to each test's name and phase. The tests that
# train in their own process leave in os.environ what dmltrain sets for c10d (read when a
# process group is made) and what torch sets for its compiler's cache (read when it
# compiles). The zygote imports neither MLflow nor wandb; READS_ are tests/tiny.py's, read
# when the experiment is imported.
LATE_NAMES = ("PYTEST_CURRENT_TEST", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
              "TORCH_GLOO_LAZY_INIT", "TORCHINDUCTOR_CACHE_DIR", "MASTER_ADDR", "MASTER_PORT",
              "SLURM_JOB_ID")  # fmt: skip
LATE_PREFIXES = ("MLFLOW_", "WANDB_", "READS_", "AWS_")


def _late(name: str) -> bool:
    return name in LATE_NAMES or name.startswith(LATE_PREFIXES)


def _early(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not _late(k)}


def _send(fd: int, value) -> None:
    data = pickle.dumps(value)
    os.write(fd, _LENGTH.pack(len(data)) + data)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks = b""
    while len(chunks) < size:
        chunk = os.read(fd, size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return chunks


def _receive(fd: int):
    head = _read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    body = _read_exactly(fd, _LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _become_run(cwd: str, argv: list[str], late: dict[str, str], out: int, err: int) -> None:
    """In the forked child: become ``python -m dmltrain ARGV`` started in ``cwd`` with its
    output to the pipes ``out`` and ``err``. Returns only by the run's SystemExit or
    exception, which end this interpreter as they end any (atexit handlers, threads joined)."""
    import runpy

    for name in [name for name in os.environ if _late(name)]:
        del os.environ[name]
    os.environ.update(late)
    os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    sys.path[0] = cwd  # python -m puts the working directory first
    sys.argv = ["-m", *argv]
    runpy._run_module_as_main("dmltrain")  # what python -m runs


def serve() -> None:
    """The zygote's loop: one run at a time (a pytest worker runs one test at a time)."""
    import torch
    import torch._dynamo  # noqa: F401

    while True:
        request = _receive(0)
        if request is None:  # the pytest worker is gone
            return
        cwd, argv, late, out_fifo, err_fifo = request
        # Opened before the fork, so the reader's end of file means every process holding
        # them has closed them, as with subprocess's pipes.
        out, err = os.open(out_fifo, os.O_WRONLY), os.open(err_fifo, os.O_WRONLY)
        pid = os.fork()
        if pid == 0:
            _become_run(cwd, argv, late, out, err)
        os.close(out)
        os.close(err)
        _send(1, pid)
        _, status = os.waitpid(pid, 0)
        _send(1, os.waitstatus_to_exitcode(status))


class Zygote:
    """The test process's side: starts the zygote on first use, with ``env``."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.busy = threading.Lock()

    def run(
        self, args: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess | None:
        """``python -m dmltrain ARGS`` as ``subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)`` would return it; None where it cannot be forked from
        here (a different environment, or another run of this process in progress)."""
        if _early(env) != _early(self.env) or not self.busy.acquire(blocking=False):
            return None
        try:
            return self._run(args, cwd, {k: v for k, v in env.items() if _late(k)}, timeout)
        finally:
            self.busy.release()

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=self.env, cwd=self.cwd,
            )  # fmt: skip
        return self.proc

    def _run(
        self, args: list[str], cwd: Path, late: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        zygote = self._started()
        assert zygote.stdin is not None and zygote.stdout is not None
        command = [sys.executable, "-m", "dmltrain", *args]
        pid = None
        with tempfile.TemporaryDirectory(prefix="zygote-") as folder:
            fifos = [os.path.join(folder, name) for name in ("stdout", "stderr")]
            for fifo in fifos:
                os.mkfifo(fifo)
            output = {os.open(fifo, os.O_RDONLY | os.O_NONBLOCK): bytearray() for fifo in fifos}
            try:
                _send(zygote.stdin.fileno(), (str(cwd), list(args), late, *fifos))
                pid = _receive(zygote.stdout.fileno())
                if pid is None:
                    raise RuntimeError("tests/zygote.py: the zygote died; see its stderr")
                timed_out = _read_to_the_end(output, pid, timeout)
                status = _receive(zygote.stdout.fileno())
                if status is None:
                    raise RuntimeError("tests/zygote.py: the zygote died; see its stderr")
            except BaseException:
                # As subprocess.run kills its child on any exception (a test's timeout);
                # the zygote goes too, rather than answer this run's status to the next.
                if pid is not None:
                    _kill(pid)
                zygote.kill()
                zygote.wait()
                raise
            finally:
                for fd in output:
                    os.close(fd)
        stdout, stderr = (_text(bytes(data)) for data in output.values())
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, status, stdout, stderr)


def _read_to_the_end(output: dict[int, bytearray], pid: int, timeout: float) -> bool:
    """Read the run's output until every process holding it has closed it (as
    subprocess's communicate); kill the run at ``timeout``. Whether it timed out."""
    deadline = time.monotonic() + timeout
    open_ends = list(output)
    timed_out = False
    while open_ends:
        ready, _, _ = select.select(open_ends, [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            if timed_out:  # still held open 5 s after the kill: what came is enough
                break
            _kill(pid)
            timed_out, deadline = True, time.monotonic() + 5
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                output[fd] += chunk
            else:
                open_ends.remove(fd)
    return timed_out


def _kill(pid: int) -> None:
    """SIGKILL to the run, which may have ended already (its output held open by others)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _text(data: bytes) -> str:
    """Bytes as ``subprocess``'s text mode decodes them."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    serve()

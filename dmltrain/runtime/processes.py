"""Starting and ending processes: ``--nprocs N`` workers started here, and how a rank's
process leaves.

Who a process is in the job (rank, world size, launcher) is ``dmltrain.runtime.launch``'s
business; this module only starts the workers of ``--nprocs`` and ends ranks' processes.
"""

import contextlib
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

from dmltrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_NONFINITE,
    EXIT_PEER_LOST,
    EXIT_REQUEUE,
    RankFailed,
    StopForRequeue,
    UserError,
    run_reporting_errors,
)
from dmltrain.runtime.launch import DistInfo, quiet_native_warnings, spawned
from dmltrain.runtime.preemption import PreemptionWatcher

# What every --nprocs worker imports before it trains, imported once by the fork server
# that forks them: torch, and torch._dynamo, which torch's first optimizer imports
# (torch/_compile.py). Nothing of the experiment's: its module may touch CUDA when
# imported, which a forked worker could then not use, and in a notebook it may have
# changed since the last run. Last, what makes the server itself leave without the
# interpreter's teardown (forkserver_exit).
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "dmltrain.runtime.forkserver_exit")

# Once one worker left with one of these statuses, how long the others get to leave by
# themselves before they are killed: after a requeue they stop at the same step boundary
# (they agreed to) once their checkpoint is written; bad input is said by the rank that
# found it, and a verdict of rank 0's (SharedError) ends every rank alike, as a NaN stop
# does (every rank stops at the same step). One still
# running then is stuck (e.g. connecting to a rendezvous that never answers).
LEAVING_GRACE_SECONDS = {EXIT_REQUEUE: 60.0, EXIT_BAD_INPUT: 10.0, EXIT_NONFINITE: 10.0}
# Signals by which a process ends itself (an abort, a bad memory access): a crash of the
# rank's own code, not a node lost. The others get to say what they saw before they are
# stopped (their roll call waits up to 10 s for the crashed rank).
CRASHES = ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE")
# Signals that end a rank from outside (the OOM killer, kill -9): the others see a lost
# peer, say so and leave by themselves (their own resources handed back), not stopped.
KILLS = ("SIGKILL", "SIGTERM")
LEAVING_GRACE_SECONDS.update({-int(signal.Signals[name]): 20.0 for name in (*CRASHES, *KILLS)})


def spawn(
    nprocs: int,
    fn: Callable[..., None],
    args: tuple,
    forward: list[str],
    start_method: str = "spawn",
    first_rank: int = 0,
) -> None:
    """Run ``fn(local_rank, *args)`` in ``nprocs`` processes (fresh ones, or forks of this
    one: ``start_method``) and wait for all.

    When one fails, torch.multiprocessing stops the others; the failure is re-raised as
    ``RankFailed`` naming the rank that failed first (worker i is rank ``first_rank`` + i).
    While waiting, the signals named in
    ``forward`` that reach this parent are sent on to the workers, so a preemption signal
    that reaches only the parent still checkpoints the run. A worker gets such a signal
    once it catches it: while it still imports torch, the signal would kill it.
    """
    import logging

    import torch.multiprocessing as mp

    from dmltrain import compat

    quiet_native_warnings()
    # torch's own "Terminating process N via signal SIGTERM": the line below says it
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    watcher = PreemptionWatcher(forward)
    orphans = Orphans()
    semaphores = _semaphores()
    context = None
    try:
        if start_method == "forkserver":
            compat.start_forkserver(FORKSERVER_PRELOAD, [signal.Signals[n] for n in forward])
        context = mp.start_processes(
            fn, args=args, nprocs=nprocs, join=False, start_method=start_method
        )
        assert context is not None
        held: list[tuple[Any, int]] = []  # (worker, signal) not passed on yet
        left_at: dict[int, tuple[float, int]] = {}  # such a status: when, and who left first
        while True:
            workers = context.processes
            running = [w.sentinel for w in workers if w.exitcode is None]
            multiprocessing.connection.wait(running, timeout=0.2)
            codes = [w.exitcode for w in workers]
            if None not in codes or set(codes) - {None, 0, *LEAVING_GRACE_SECONDS}:
                break  # all ended, or one failed
            now = time.monotonic()
            for code in set(codes) & LEAVING_GRACE_SECONDS.keys():
                left_at.setdefault(code, (now, codes.index(code)))
            late = [
                (at, i, c) for c, (at, i) in left_at.items() if now - at > LEAVING_GRACE_SECONDS[c]
            ]
            if late:  # the others had their time: stopped now, the first to leave named
                _, first, code = min(late)
                _kill(workers)
                raise _left_first(first_rank + first, code)
            received = watcher.take_received()
            held += [(process, signum) for signum in received for process in workers]
            held = [(process, signum) for process, signum in held if not _pass_on(process, signum)]
        codes = [w.exitcode for w in context.processes]
        killed = [i for i, code in enumerate(codes) if code is not None and code < 0]
        if killed and None not in codes:  # the others saw a lost peer and left: it says why
            raise _left_first(first_rank + killed[0], codes[killed[0]])
        for said in (EXIT_BAD_INPUT, EXIT_NONFINITE):  # the ranks said why themselves
            if None not in codes and said in codes and set(codes) <= {0, said}:
                raise RankFailed("said by the ranks", said, said=True)
        context.join()  # raises for the first that failed, and stops the others
    except mp.ProcessExitedException as exc:
        raise _left_first(first_rank + exc.error_index, exc.exit_code) from None
    except mp.ProcessRaisedException as exc:
        raise RankFailed(f"rank {first_rank + exc.error_index} failed first: {exc}", 1) from None
    finally:
        watcher.restore()
        if start_method == "forkserver":
            compat.stop_forkserver()
        orphans.end()
        if context is not None and any((w.exitcode or 0) < 0 for w in context.processes):
            _hand_back(semaphores)  # a killed process's, once its own children are gone


# The longest path a Unix socket may have: sun_path (108 bytes on Linux, 104 on macOS)
# with the path's terminating NUL.
_SOCKET_PATH_BYTES = (104 if sys.platform == "darwin" else 108) - 1
# multiprocessing's listener under the temporary directory: pymp-XXXXXXXX/listener-XXXXXXXX
_LISTENER = os.path.join("pymp-" + 8 * "x", "listener-" + 8 * "x")


def _socket_room(temp_dir: str) -> int:
    """How many bytes are left under the socket path limit for multiprocessing's listener
    in ``temp_dir`` (negative: too long a path to bind)."""
    return _SOCKET_PATH_BYTES - len(os.fsencode(os.path.join(temp_dir, _LISTENER)))


def loader_workers_problem(temp_dir: str) -> str | None:
    """Why a DataLoader's worker processes could not hand their batches to this process,
    or None. Each batch's shared memory goes through a Unix socket that Python's
    multiprocessing makes in the temporary directory ``temp_dir`` (TMPDIR); past a
    socket's length limit every worker dies ("AF_UNIX path too long") and the loader
    raises its own error minutes later."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_descriptor":  # no sockets: file names instead
        return None
    room = _socket_room(temp_dir)
    if room >= 0:
        return None
    most = len(os.fsencode(temp_dir)) + room
    return (
        f"the temporary directory {temp_dir} (TMPDIR) is too long a path for the sockets "
        f"through which the loader's worker processes hand over batches (at most {most} "
        "characters here): set TMPDIR to a shorter directory (e.g. /tmp), or train with "
        "--num-workers 0"
    )


def _left_first(rank: int, code: int) -> RankFailed | StopForRequeue:
    """What ``spawn`` raises when worker ``rank`` was the first to leave, with ``code``."""
    if code == EXIT_REQUEUE:  # a checkpoint was saved; the run goes on later
        return StopForRequeue(
            f"checkpoint saved; run the same again to resume (exit status {EXIT_REQUEUE})"
        )
    name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else ""
    if name in CRASHES:
        return RankFailed(
            f"rank {rank} crashed ({name}: its own native code, or a library's, ended it; "
            "its output and the other ranks' lines above say where); not a lost node, so "
            "nothing is requeued (exit status 1)",
            1,
        )
    if name:  # killed from outside (the OOM killer, kill -9): a lost peer
        return RankFailed(
            f"rank {rank} was killed by {name}; the other ranks stopped, the checkpoints "
            f"are intact: run the same command to resume (exit status {EXIT_PEER_LOST})",
            EXIT_PEER_LOST,
        )
    return RankFailed(
        f"rank {rank} failed first (exit code {code}); the other ranks were stopped",
        code if code and code > 0 else 1,
    )


def _semaphores() -> set[str]:
    """The POSIX semaphores of this machine (/dev/shm/sem.*), by multiprocessing's name."""
    with contextlib.suppress(OSError):
        return {f"/{e.name[4:]}" for e in os.scandir("/dev/shm") if e.name.startswith("sem.mp-")}
    return set()


def _hand_back(before: set[str]) -> None:
    """After a rank was killed and the others left: its semaphores (made since ``before``,
    by this user, mapped by no live process) unlinked and struck from the resource tracker,
    which would clean them up at its end with a "leaked semaphore objects" warning."""
    import _multiprocessing
    from multiprocessing import resource_tracker

    for name in unheld(_semaphores() - before):
        with contextlib.suppress(OSError):
            _multiprocessing.sem_unlink(name)
            resource_tracker.unregister(name, "semaphore")


def unheld(names: set[str]) -> list[str]:
    """Of the semaphores ``names``, those of this user that no live process maps. A
    semaphore is told by its inode in the processes' memory maps: glibc maps a new one
    under a temporary name before linking it, so its maker's map never shows its name."""
    left = {}
    for name in names:
        with contextlib.suppress(OSError):
            info = os.stat(f"/dev/shm/sem.{name[1:]}")
            if info.st_uid == os.getuid():
                left[name] = info.st_ino
    if not left:
        return []
    used: set[int] = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry.name}/maps") as maps:
                    for line in maps:
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                            used.add(int(fields[4]))
    return [name for name, inode in left.items() if inode not in used]


_PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux


class Orphans:
    """The run's processes whose parent died: a worker killed by ``kill -9`` leaves its
    loader workers and their fork server, which would live on with parent 1 (each waits
    for the server, which waits for them). From here to ``end`` they become this
    process's children (a child subreaper, Linux), and ``end`` kills those still there:
    nothing outlives the run. Children this process had before, and multiprocessing's
    resource tracker, are not the run's."""

    def __init__(self) -> None:
        self.before = _children()
        self.libc: Any = None
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError):
                self.libc = ctypes.CDLL(None, use_errno=True)
                self.libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def end(self) -> None:
        if self.libc is None:
            return
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        for _ in range(8):  # a killed one's own children are adopted in turn
            left = _children() - self.before - {tracker}
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        self.libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _children() -> set[int]:
    """This process's children, from /proc (empty where there is none)."""
    me, found = str(os.getpid()), set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry.name}/stat") as handle:
                    if handle.read().rsplit(")", 1)[1].split()[1] == me:
                        found.add(int(entry.name))
    return found


def _kill(workers: list[Any]) -> None:
    """Stop the workers still running, at once (they had their time to leave)."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join()


def spawn_fits(trainer_cls: type, name: str, config: Any, options: Any, parent: DistInfo) -> None:
    """``--nprocs N``: ``trainer_cls(config, options).fit()`` in N workers (``spawn``):
    fresh processes where they can import ``trainer_cls`` (forks of the fork server, or
    fresh interpreters), forks of this process where they cannot (``start_method_for``)."""
    signals = config.preemption.signal_names()
    method = start_method_for(trainer_cls, config.distributed.start_method)
    spawn(
        parent.workers,
        _fit,
        (trainer_cls, name, config, options, parent, signals),
        signals,
        method,
        parent.rank,
    )


def start_method_for(trainer_cls: type, wanted: str = "auto") -> str:
    """How to start workers that run ``trainer_cls`` (``wanted``: ``--start-method``).

    A worker that can import the class's module is a fresh process: forked by a server
    that imported torch once for all of them ("forkserver", ``FORKSERVER_PRELOAD``), or a
    fresh interpreter ("spawn"); auto takes the server on Linux where TMPDIR is a short
    enough path for its socket. Where importing cannot work, the workers are forks of
    this process, which has the class already:
    a class defined in a notebook or in ``python -`` / ``python -c`` (a ``__main__``
    without a file), or inside a function. Fork carries no CUDA context into a child, so
    a process that has one gets one line saying what to do instead.
    """
    module = sys.modules.get(trainer_cls.__module__)
    from_file = module is not None and (
        trainer_cls.__module__ != "__main__"
        or getattr(module, "__spec__", None) is not None  # python -m
        or os.path.isfile(getattr(module, "__file__", None) or "")
    )
    if from_file and "<locals>" not in trainer_cls.__qualname__:
        return _fresh_start(wanted)
    where = f"{trainer_cls.__qualname__} is defined where a new process cannot import it"
    if "fork" not in mp_start_methods():
        raise UserError(
            f"{where}, and this platform cannot fork: move the class into a .py "
            "file and import it from there"
        )
    import torch

    if torch.cuda.is_initialized():
        raise UserError(
            f"{where} (a notebook), so its workers are forks of this process, and CUDA was "
            "already used here: restart the kernel and call fit() before any CUDA call, "
            "or move the class into a .py file and import it from there"
        )
    return "fork"


def _fresh_start(wanted: str) -> str:
    """``start_method_for`` a class the workers can import."""
    if wanted == "spawn":
        return "spawn"
    fits = _socket_room(tempfile.gettempdir()) >= 0
    if wanted == "auto":
        return "forkserver" if fits and sys.platform == "linux" else "spawn"
    if "forkserver" not in mp_start_methods():
        raise UserError("--start-method forkserver: this platform has no fork server; use spawn")
    if not fits:
        raise UserError(
            f"--start-method forkserver: the temporary directory {tempfile.gettempdir()} "
            "(TMPDIR) is too long a path for the fork server's socket: set TMPDIR to a "
            "shorter directory (e.g. /tmp), or use --start-method spawn"
        )
    return "forkserver"


def mp_start_methods() -> list[str]:
    return multiprocessing.get_all_start_methods()


def _fit(
    local_rank: int,
    trainer_cls: type,
    name: str,
    config: Any,
    options: Any,
    parent: DistInfo,
    signals: list[str],
) -> None:
    # A fork holds the parent's signal handlers and exit handlers. Its preemption signals
    # are ignored until the trainer catches them (the parent passes them on then: _pass_on),
    # and the parent's exit handlers (a notebook kernel's) are not this process's to run.
    numbers = [signal.Signals[name] for name in signals]
    for number in numbers:
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)  # held by the fork server
    from dmltrain import compat  # here: it imports torch, which the command loads later

    compat.forget_exit_handlers()
    compat.release_forkserver()
    trainer = trainer_cls(config, options, dist=spawned(parent, local_rank))
    trainer.name = name
    exit_on_error(trainer.fit, trainer.dist.rank, trainer.dist.world_size)


def _pass_on(process: Any, signum: int) -> bool:
    """Send ``signum`` to a worker that catches it; False while it does not catch it yet
    (Linux: ``SigCgt`` in ``/proc/<pid>/status``; elsewhere it is sent at once)."""
    if not process.is_alive() or process.pid is None:
        return True  # gone: nothing to pass on
    try:
        with open(f"/proc/{process.pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
        if not int(caught.split()[1], 16) >> (signum - 1) & 1:
            return False
    except (OSError, StopIteration, ValueError):
        pass  # no /proc here (or the worker just ended): send as before
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.kill(process.pid, signum)
    return True


def exit_on_error(fn: Callable[[], object], rank: int, world_size: int) -> NoReturn:
    """A worker's main: run ``fn`` and leave the process with its exit code.

    The worker leaves with ``os._exit`` once its output is flushed: tearing down the
    interpreter while Gloo's threads still hold tensors can abort the process
    ("terminate called without an active exception"), seen once in a few hundred runs,
    even after ``destroy_process_group``; ``dmltrain`` under torchrun, srun or mpirun
    leaves the same way (``leave``). Everything a run writes is closed and fsynced
    before ``fn`` returns.
    """
    leave(run_reporting_errors(fn, rank, world_size))


def raise_open_files_limit() -> int:
    """The soft limit of open files raised to the hard one, returned. Sockets to peers,
    a loader's workers and checkpoint shards are files: a soft limit of 1,024, common on
    clusters, is near what a large job opens, and the hard limit is what the site allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):  # a system's own ceiling
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def started_by_launcher(info: DistInfo) -> bool:
    """Whether this process is one rank of a job that a launcher (torchrun, srun,
    mpirun, horovodrun) started, and so ran collectives (a torch process group, or
    Horovod under horovodrun)."""
    return info.launcher not in ("single", "spawn")


def leave(code: int) -> NoReturn:
    """End a rank's process with ``code``: the ``atexit`` handlers run (an experiment's
    clean-up, logging's flush) and output is flushed, but the interpreter's teardown is
    skipped (see ``exit_on_error``)."""
    from dmltrain import compat  # here: it imports torch, which the command loads later

    compat.run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

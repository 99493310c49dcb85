"""Starting and ending processes: ``--nprocs N`` workers started here, and how a rank's
process leaves.

Who a process is in the job (rank, world size, launcher) is ``dmltrain.launch``'s
business; this module only starts the workers of ``--nprocs`` and ends ranks' processes.
"""

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from dmltrain.errors import (
    EXIT_REQUEUE,
    RankFailed,
    StopForRequeue,
    run_reporting_errors,
)
from dmltrain.launch import DistInfo, spawned
from dmltrain.preemption import PreemptionWatcher


def spawn(nprocs: int, fn: Callable[..., None], args: tuple, forward: list[str]) -> None:
    """Run ``fn(local_rank, *args)`` in ``nprocs`` fresh processes and wait for all.

    When one fails, torch.multiprocessing stops the others; the failure is re-raised as
    ``RankFailed`` naming the rank that failed first. While waiting, the signals named in
    ``forward`` that reach this parent are sent on to the workers, so a preemption signal
    that reaches only the parent still checkpoints the run. A worker gets such a signal
    once it catches it: while it still imports torch, the signal would kill it.
    """
    import torch.multiprocessing as mp

    watcher = PreemptionWatcher(forward)
    try:
        context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
        assert context is not None
        held: list[tuple[Any, int]] = []  # (worker, signal) not passed on yet
        while not context.join(timeout=0.2):
            received = watcher.take_received()
            held += [(process, signum) for signum in received for process in context.processes]
            held = [(process, signum) for process, signum in held if not _pass_on(process, signum)]
    except mp.ProcessExitedException as exc:
        if exc.exit_code == EXIT_REQUEUE:  # a checkpoint was saved; the run goes on later
            raise StopForRequeue(f"checkpoint saved; exit status {EXIT_REQUEUE}") from None
        how = f"killed by {exc.signal_name}" if exc.signal_name else f"exit code {exc.exit_code}"
        raise RankFailed(
            f"rank {exc.error_index} failed first ({how}); the other ranks were stopped",
            exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1,
        ) from None
    except mp.ProcessRaisedException as exc:
        raise RankFailed(f"rank {exc.error_index} failed first: {exc}", 1) from None
    finally:
        watcher.restore()


def spawn_fits(trainer_cls: type, name: str, config: Any, options: Any, parent: DistInfo) -> None:
    """``--nprocs N``: ``trainer_cls(config, options).fit()`` in N workers (``spawn``)."""
    signals = config.preemption.signal_names()
    spawn(parent.world_size, _fit, (trainer_cls, name, config, options, parent), signals)


def _fit(local_rank: int, trainer_cls: type, name: str, config: Any, options: Any,
         parent: DistInfo) -> None:  # fmt: skip
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


def started_by_launcher(info: DistInfo) -> bool:
    """Whether this process is one rank of a job that a launcher (torchrun, srun,
    mpirun, horovodrun) started, and so ran collectives (a torch process group, or
    Horovod under horovodrun)."""
    return info.launcher not in ("single", "spawn")


def leave(code: int) -> NoReturn:
    """End a rank's process with ``code``: the ``atexit`` handlers run (an experiment's
    clean-up, logging's flush) and output is flushed, but the interpreter's teardown is
    skipped (see ``exit_on_error``)."""
    # Private, as no public call runs the handlers without the teardown; errors in a
    # handler are printed and the others still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

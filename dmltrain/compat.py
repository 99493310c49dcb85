"""Every private API of torch and Python that dmltrain uses, each with why no public one
serves: when an upgrade breaks one, this page is where to look.

Imported lazily where torch is not yet loaded (the ``dmltrain`` command starts without it).
"""

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn


def foreach_copy_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """One fused copy of many tensors (EMA): ``torch._foreach_copy_``; a loop of ``copy_``
    launches a kernel per tensor."""
    torch._foreach_copy_(targets, sources)


def foreach_lerp_(targets: list[Tensor], ends: list[Tensor], weight: float) -> None:
    """One fused ``lerp_`` over many tensors (the EMA update): ``torch._foreach_lerp_``."""
    torch._foreach_lerp_(targets, ends, weight)


def foreach_norm(tensors: list[Tensor]) -> Sequence[Tensor]:
    """The float32 2-norms of many tensors in one fused kernel (NaN checks):
    ``torch._foreach_norm``; ``torch.linalg.vector_norm`` per tensor costs a kernel each."""
    return torch._foreach_norm(tensors, 2, dtype=torch.float32)


def scaler_scale(scaler: torch.amp.GradScaler) -> Tensor:
    """The loss scale as the scaler's device tensor (``_scale``): the public
    ``get_scale()`` returns a float, a host sync at every step."""
    return scaler._scale  # type: ignore[return-value]


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile``'s wrapper (its ``_orig_mod``: torch has no
    public way to it), or ``model`` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def nccl_flight_recorder() -> Callable[[], bytes] | None:
    """What dumps NCCL's flight recorder (``_dump_fr_trace``, the record of a hang's
    collectives), where this torch has it: there is no public call."""
    return getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)


def set_group_timeout(timeout: Any, group: Any = None) -> None:
    """Change a process group's collective timeout after it was made
    (``_set_pg_timeout``, which torchtitan uses the same way: a long one while the job
    starts, a shorter one for training). No public call changes it."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, group)


def record_memory_history(max_entries: int | None) -> None:
    """Start (``max_entries``) or stop (None) CUDA's allocation history: the private
    ``torch.cuda.memory._record_memory_history`` is the documented way (PyTorch's "Understanding
    CUDA Memory Usage")."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """The allocation history as a pickle for pytorch.org/memory_viz (``_dump_snapshot``,
    documented there as the way)."""
    torch.cuda.memory._dump_snapshot(path)


def main_thread_frame() -> FrameType | None:
    """The main thread's current frame, read from another thread (the hang watchdog):
    ``sys._current_frames`` is the only way."""
    return sys._current_frames().get(threading.main_thread().ident or 0)


def forget_exit_handlers() -> None:
    """A forked worker does not run its parent's exit handlers (a notebook kernel's):
    ``atexit._clear``, as no public call removes handlers one did not register."""
    atexit._clear()


def run_exit_handlers() -> Any:
    """The exit handlers without the interpreter's teardown (``atexit._run_exitfuncs``):
    no public call runs them alone; a handler's error is printed and the others run. In a
    process that multiprocessing started (an --nprocs worker, whose exit handlers were
    the parent's and are forgotten) also multiprocessing's own end of a process: its
    children stopped, its semaphores handed back (``util._exit_function``, which its
    ``Process`` runs after the target returns; a worker leaves before that). The resource
    tracker would report them leaked."""
    import multiprocessing
    from multiprocessing import util

    if multiprocessing.parent_process() is not None:
        util._exit_function()  # type: ignore[attr-defined]
    return atexit._run_exitfuncs()


def start_forkserver(preload: Sequence[str], blocked: Sequence[int]) -> None:
    """Start multiprocessing's fork server with ``preload`` imported, the signals
    ``blocked`` held in it and in the workers it forks (they unblock them themselves).
    A preemption signal sent to the whole process group would otherwise end the server,
    and with it every worker's exit status (the parent then reads 255 for each).
    ``set_forkserver_preload`` and ``ensure_running`` are public; the server they start
    is multiprocessing's one per process."""
    from multiprocessing import forkserver, resource_tracker

    forkserver.set_forkserver_preload(list(preload))
    # Before the mask: starting the resource tracker unblocks SIGINT and SIGTERM after it.
    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        forkserver.ensure_running()  # fork and exec: the new server keeps this mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stop_forkserver() -> None:
    """End the fork server (``_stop``, what Python's own tests call: no public call ends
    it), so the next workers come from one started with the environment of that time,
    not this one's."""
    from multiprocessing import forkserver

    with contextlib.suppress(OSError):  # already reaped, its socket already gone
        forkserver._forkserver._stop()  # type: ignore[attr-defined]


def release_forkserver() -> None:
    """In a worker of the fork server: let go of the server's "alive" pipe
    (``_forkserver_alive_fd``), which every worker is handed. Held, it keeps the server,
    this worker's parent, running after the process that started it died, and the
    worker's parent-death signal (torch's ``PR_SET_PDEATHSIG``) never comes."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def stop_loader_workers(loader: Any) -> None:
    """End a DataLoader's persistent workers now, while CUDA and the process group are
    still up, rather than in torch's exit handler or ``__del__`` (``_iterator`` and
    ``_shutdown_workers`` are private; Lightning stops its loaders the same way)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if iterator is not None:
        loader._iterator = None


def checkpoint_module(
    module: nn.Module, contexts: Callable[[], tuple[Any, Any]] | None = None
) -> None:
    """Recompute ``module``'s activations in the backward, by hooks on the module itself
    (``torch.distributed._composable.checkpoint``); ``contexts()`` gives a pair of contexts
    for each forward: one around it, one around its recomputation. torch's other way,
    ``checkpoint_wrapper`` (private too), puts a wrapper in the module's place: an
    experiment's step that calls the module's own methods would find the wrapper's."""
    from torch.distributed._composable import checkpoint

    if contexts is None:
        checkpoint(module)
    else:
        checkpoint(module, context_fn=contexts)


def fused_devices() -> list[str]:
    """The device types with fused optimizer kernels (Adam, AdamW, SGD, Adagrad) in this
    torch (``_get_fused_kernels_supported_devices``: no public list)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())

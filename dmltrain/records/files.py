"""The records dmltrain writes beside its checkpoints (training log, config, outcome, status):
each written whole or not at all, and a failure to write said in one line.

A record goes to a temporary file in the same folder that is then renamed over the old one,
so a full disk or a crash leaves the previous version, never a truncated one.
"""

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from dmltrain.errors import UserError

_MB = 1 << 20


class NotWritten(UserError):
    """A record could not be written (a full disk, a quota, a read-only folder); the file
    there before, if any, is unchanged."""


def write_atomic(path: Path, text: str | bytes) -> None:
    """``path`` holds ``text`` afterwards, or what it held before (``NotWritten``)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise NotWritten(why_not_written(path, exc)) from None


def append_own(path: Path, data: bytes, rewrite: bool = False) -> None:
    """Append ``data`` to the record ``path`` (``rewrite``: in place of what it holds), whole
    or not at all: a failed write (a full disk) is cut off again and raised. Never through a
    symbolic link: one put there (a run directory is often group-writable) fails the open
    with ELOOP, an OSError as a full disk's is, instead of writing into its target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if rewrite else os.O_APPEND)
    fd = os.open(path, flags, 0o666)  # 0o666: the umask decides
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def not_through_a_link(path: str, flags: int) -> int:
    """An ``opener`` for ``open``: as ``append_own``, the file itself, never a link's target."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def replace_link(path: Path, warn: Callable[[str], None]) -> None:
    """Remove ``path`` when it is a symbolic link (dmltrain makes none among its records),
    said once, so the record is written as a file of the run's own."""
    if path.is_symlink():
        warn(
            f"{path} was a link to {os.readlink(path)}, which dmltrain did not make: "
            "replaced by a file of this run's own (the link's target is untouched)"
        )
        path.unlink()


def why_not_written(path: Path, exc: OSError) -> str:
    """One line: no space (how much is free, measured once the partial file is gone), or
    the system's reason."""
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write {path}: {free_space(path.parent)}"
    return f"cannot write {path}: {exc.strerror or exc}"


def free_space(folder: Path) -> str:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "no space left on its file system"
    return f"no space left on its file system ({free / _MB:.1f} MB free)"


def status_record(status: int, saved: int) -> str:
    """What ``--status-file`` holds, as the batch scripts read it: the job's exit status,
    then how many checkpoints the job saved."""
    return f"{status}\n{saved}\n"


def write_status(path: Path, status: int, saved: int, main: bool) -> None:
    """``--status-file``: rank 0's (``main``) status replaces what is there; another rank's
    (a lost peer's, since rank 0 may be the one lost) is written only where none is, for
    rank 0's, written as it leaves, is the job's. ``NotWritten`` when it cannot be."""
    text = status_record(status, saved)
    if main:
        write_atomic(path, text)
        return
    try:
        with open(path, "x") as handle:
            handle.write(text)
    except FileExistsError:
        pass
    except OSError as exc:
        raise NotWritten(why_not_written(path, exc)) from None


def read_status_record(path: Path) -> tuple[int, int] | None:
    """``status_record``'s two numbers, or None where the file is missing or not one."""
    try:
        written = path.read_text().split()
        return int(written[0]), int(written[1]) if len(written) > 1 else 0
    except (OSError, ValueError, IndexError):
        return None

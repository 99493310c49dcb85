"""The records dmltrain writes beside its checkpoints (training log, config, outcome, status):
each written whole or not at all, and a failure to write said in one line.

A record goes to a temporary file in the same folder that is then renamed over the old one,
so a full disk or a crash leaves the previous version, never a truncated one.
"""

import contextlib
import errno
import os
import shutil
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

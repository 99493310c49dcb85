"""A node-local tier before the run directory: ``--local-checkpoint-dir DIR``.

Each rank writes its part of a checkpoint to ``DIR`` (node-local NVMe, ``$TMPDIR``): rank 0
the whole file of a full checkpoint, every rank its shards of a sharded one. The loop
waits for that local write alone. A background thread on each rank then drains its part
to ``RUN_DIR/checkpoints``; rank 0 publishes the checkpoint there once every part is in.
``latest`` moves only to a checkpoint complete on the shared file system, so a resume
always uses a durable one. A local copy is removed once drained: the local tier holds
only what still drains.

While a checkpoint drains, ``RUN_DIR/.draining-<name>`` says so, and from which host. A
job that ended before the drain did (a lost node) leaves it. The next job drains the
local copy of a full checkpoint if it is on the same node; else it says in one line that
this checkpoint was lost, and resumes from the newest durable one.

A drain that fails (a read-only or full shared folder) is said once and retried, with
growing pauses. A local folder that is full sends the checkpoint straight to the run
directory, said once.
"""

import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dmltrain.checkpoint.storage import (
    FORMAT_VERSION,
    FULL,
    PREFIX,
    SHARDED,
    CheckpointDir,
    WriteFailed,
    _first_failure,
    _fsync_dir,
    atomic_save,
    checkpoint_name,
    list_checkpoints,
    load_file,
    point,
)
from dmltrain.errors import UserError, first_line

MARKER = ".draining-"  # RUN_DIR/.draining-<checkpoint name>: a drain in flight
GATHERING = ".gathering"  # RUN_DIR/checkpoints/.<name>.<n>.gathering/: a sharded one's parts
DRAINED = ".drained-"  # in it, .drained-<rank>: that rank's part is in
RETRY_MOST_SECONDS = 60.0  # a failing drain is retried at most this far apart
SETTLE_SECONDS = 300.0  # as the job ends, a failing drain is retried this long
SETTLE_FAILED_SECONDS = 30.0  # ... and, after a failure, the other ranks' parts awaited


class GaveUp(Exception):
    """The job ends without the other ranks' parts of a sharded checkpoint."""


def local_folder(given: Path, run_dir: Path, rank: int = 0) -> Path:
    """This rank's folder in ``--local-checkpoint-dir``: the run directory's name and a
    digest of its path (runs sharing a node's folder keep apart), then the rank."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return given / f"{run_dir.name}-{digest}" / f"rank-{rank}"


class TieredDir(CheckpointDir):
    """The run directory's checkpoints (``directory``, the durable tier), written first to
    ``local`` (this rank's folder on its node) and drained in the background. ``warn``:
    this rank's warning line (a drain's failure, the local folder full)."""

    def __init__(
        self,
        directory: Path,
        local: Path,
        keep_last: int,
        warn: Callable[[str], None],
        asynchronous: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(directory, keep_last, asynchronous)
        self.local, self.warn = local, warn
        self.rank, self.world_size = rank, world_size
        # each save's local copy, name, whether best, number, and (sharded, rank 0) meta
        self._queue: queue.Queue[tuple[Path, str, bool, int, Any]] = queue.Queue()
        self._saves = 0  # a number for each save: a step saved twice is two local copies
        self._drainer: threading.Thread | None = None
        self._publishing = threading.Lock()  # the drainer's and a straight write's
        self._straight = False  # the local folder was full at the last save
        self._failing: str | None = None  # why the drain in flight failed, said once
        self._give_up = threading.Event()  # the job ends: wait no more for other ranks

    def where(self) -> str:
        return f"{self.directory} (through {self.local})"

    # ----- saving ---------------------------------------------------------------------
    def _staged(self, name: str) -> Path:
        """A new local path for this save; the first one clears what an earlier job left
        (a resume has drained what it could by then). A folder that cannot be made fails
        the write that follows, where every rank learns it."""
        self._saves += 1
        if self._saves == 1:
            shutil.rmtree(self.local, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.local.mkdir(parents=True, exist_ok=True)
        return self.local / f"{name}.{self._saves}"

    def _write(self, state: dict[str, Any], epoch: int, global_step: int, best: bool) -> Path:
        name = checkpoint_name(epoch, global_step)
        staged = self._staged(name)
        try:
            atomic_save({"format_version": FORMAT_VERSION, **state}, staged)
        except WriteFailed as exc:
            self._full(str(exc))
            return super()._write(state, epoch, global_step, best)
        self._straight = False
        self._enqueue(staged, name, best, None)
        return self.directory / name

    def save_sharded(
        self,
        shards: dict[str, Any],
        meta: dict[str, Any] | None,
        epoch: int,
        global_step: int,
        best: bool,
        barrier: Callable[[], None],
        asynchronous: bool = False,
        group: Any = None,
    ) -> str:
        """Collective: every rank writes its shards to its local folder (rank 0 the index
        and ``trainer.pt`` too) and drains them in the background. A local folder that
        fails on any rank (every rank learns it) sends this save straight through."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        name = checkpoint_name(epoch, global_step, SHARDED)
        staged = self._staged(name)
        try:  # its planning makes the folder
            dcp.save(
                shards,
                storage_writer=dcp.FileSystemWriter(str(staged), sync_files=False),
                planner=DefaultSavePlanner(enable_plan_caching=True),
            )
        except Exception as exc:  # torch.distributed.checkpoint's: every rank's alike
            shutil.rmtree(staged, ignore_errors=True)
            self._full(first_line(_first_failure(exc)))
            return super().save_sharded(
                shards, meta, epoch, global_step, best, barrier, asynchronous, group
            )
        self._straight = False
        self._enqueue(staged, name, best, meta)  # rank 0 writes meta where the parts gather
        return str(self.directory / name)

    def _full(self, why: str) -> None:
        if not self._straight and self.rank == 0:
            self.warn(
                f"{why}: checkpoints go straight to {self.directory} until the local "
                "checkpoint folder can take them"
            )
        self._straight = True

    def _enqueue(self, staged: Path, name: str, best: bool, meta: Any) -> None:
        self._queue.put((staged, name, best, self._saves, meta))
        if self._drainer is None:
            self._drainer = threading.Thread(target=self._drain_all, daemon=True)
            self._drainer.start()

    def _drain_all(self) -> None:
        while True:
            staged, name, best, number, meta = self._queue.get()
            try:
                self._drain(staged, name, best, number, meta)
            except GaveUp:
                pass  # the marker stays: the next job says what was lost
            finally:
                self._queue.task_done()

    def _drain(self, staged: Path, name: str, best: bool, number: int, meta: Any = None) -> None:
        """Copy this rank's part of checkpoint ``name`` to the run directory (and, on rank
        0, publish it), retrying until it is."""
        pause = 1.0
        while True:
            try:
                if staged.is_dir():
                    self._gather(staged, name, best, number, meta)
                else:
                    self._copy_and_publish(staged, name, best)
                break
            except OSError as exc:
                why = f"{exc.strerror or first_line(exc)}"
                if self._failing != why:
                    durable = list_checkpoints(self.directory)
                    last = f"the newest durable one is {durable[0]}" if durable else "none yet"
                    self.warn(
                        f"draining checkpoint {name} from {self.local} to {self.directory} "
                        f"failed ({why}); retrying; {last}"
                    )
                    self._failing = why
                if self._give_up.wait(pause):
                    raise GaveUp() from None
                pause = min(2 * pause, RETRY_MOST_SECONDS)
        if self._failing is not None:
            self.warn(f"checkpoint {name} drained to {self.directory}")
            self._failing = None
        if staged.is_dir():
            shutil.rmtree(staged, ignore_errors=True)
        else:
            staged.unlink(missing_ok=True)

    def _mark(self, name: str) -> Path:
        """RUN_DIR/.draining-<name>, written whole by rank 0 (a full folder fails the drain,
        which is retried): this host, for the line that says a checkpoint was lost. The next
        job looks for the local copy in its own local folder, never where a mark says."""
        marker = self.directory.parent / f"{MARKER}{name}"
        if self.rank == 0:
            tmp = marker.with_name(f".{marker.name}.tmp-{os.getpid()}")
            try:
                tmp.write_text(json.dumps({"host": socket.gethostname()}))
                os.replace(tmp, marker)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return marker

    def _copy_and_publish(self, staged: Path, name: str, best: bool) -> None:
        marker = self._mark(name)
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / name
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            _copy(staged, tmp)
            os.replace(tmp, target)
            _fsync_dir(self.directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._publishing:
            self._publish(target, best)
        marker.unlink(missing_ok=True)

    def _gather(self, staged: Path, name: str, best: bool, number: int, meta: Any) -> None:
        """A sharded checkpoint: this rank's files into the run directory's gathering
        folder for ``name`` (the save's ``number`` is every rank's alike), with a mark that
        they are in; rank 0 then waits for every rank's mark and publishes."""
        marker = self._mark(name)
        gathering = self.directory / f".{name}.{number}{GATHERING}"
        gathering.mkdir(parents=True, exist_ok=True)
        for part in sorted(staged.iterdir()):
            _copy(part, gathering / part.name)
        (gathering / f"{DRAINED}{self.rank}").touch()
        _fsync_dir(gathering)
        if self.rank != 0:
            return
        while len(list(gathering.glob(f"{DRAINED}*"))) < self.world_size:
            if self._give_up.wait(0.1):
                raise GaveUp()
        for mark in gathering.glob(f"{DRAINED}*"):
            mark.unlink()
        with self._publishing:  # trainer.pt (rank 0's meta) in, renamed into place
            self._publish_sharded(gathering, self.directory / name, meta, best)
        marker.unlink(missing_ok=True)

    def _publish(self, path: Path, best: bool, prune: bool = True) -> None:
        """As the run directory's, except that ``latest`` never moves back (a straight
        write may publish a newer one while an older one drains)."""
        newest = list_checkpoints(self.directory)
        if not newest or newest[0] == path:
            super()._publish(path, best, prune)
            return
        if best:
            point(self.directory / f"best{SHARDED if path.is_dir() else FULL}", path)
        if prune:
            self._prune()

    def settle(self, main: bool = True, failed: bool = False) -> None:
        """As the job ends: every part of this rank drained, or (the shared folder failing
        for ``SETTLE_SECONDS``; after a failure, other ranks' parts missing for
        ``SETTLE_FAILED_SECONDS``) a UserError saying what is left on this node."""
        deadline = time.monotonic() + (SETTLE_FAILED_SECONDS if failed else SETTLE_SECONDS)
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._queue.unfinished_tasks:
            self._give_up.set()
            raise UserError(
                f"{self._queue.unfinished_tasks} checkpoint(s) could not be drained to "
                f"{self.directory} ({self._failing or 'parts of other ranks missing'}); "
                f"they stay in {self.local} on {socket.gethostname()}: make room there and "
                "run the same command on this node, which drains them first"
            )

    # ----- resuming -------------------------------------------------------------------
    def _local_copy(self, name: str, warn: Callable[[str], None]) -> Path | None:
        """The newest local copy of full checkpoint ``name`` in this rank's own local
        folder, once it loads; None when there is none (or it does not load, said)."""
        if name.endswith(SHARDED):
            return None
        copies = sorted(
            (p for p in self.local.glob(f"{name}.*") if p.is_file() and not p.is_symlink()),
            key=lambda p: int(p.suffix[1:]) if p.suffix[1:].isdigit() else -1,
        )
        if not copies:
            return None
        try:
            load_file(copies[-1])
        except UserError as exc:
            warn(f"the local copy of checkpoint {name} does not load ({exc}); not drained")
            return None
        return copies[-1]

    def latest_valid(self, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
        """A drain an earlier job left unfinished is done now when its local copy is on
        this node (a full checkpoint); else that checkpoint is lost, said in one line. Then
        as the run directory's. A rollback within this job first lets its own drains
        finish."""
        if self._drainer is not None:
            self.settle()
        for marker in sorted(self.directory.parent.glob(f"{MARKER}*")):
            name = marker.name[len(MARKER) :]
            if not _NAME.match(name):  # not a mark of this run's
                warn(f"{marker} names no checkpoint ({name!r}); removed")
                marker.unlink(missing_ok=True)
                continue
            host = _left_by(marker)
            staged = self._local_copy(name, warn)
            if staged is not None:
                self._drain(staged, name, False, 0)
            elif not (self.directory / name).exists():
                durable = list_checkpoints(self.directory)
                went_on = f"the newest durable one, {durable[0].name}" if durable else "the start"
                warn(
                    f"checkpoint {name} was still draining from {host}'s local folder when "
                    f"the last job ended and is lost with that node; going on from {went_on}"
                    if not name.endswith(SHARDED)
                    else f"checkpoint {name} was still draining from the ranks' local folders "
                    f"when the last job ended ({_missing(self.directory, name)}) and is lost; "
                    f"going on from {went_on}"
                )
            marker.unlink(missing_ok=True)
        for gathering in self.directory.glob(f".*{GATHERING}"):
            shutil.rmtree(gathering, ignore_errors=True)
        return super().latest_valid(warn)


_NAME = re.compile(rf"^{PREFIX}\d+-\d+\{FULL}$|^{PREFIX}\d+-\d+\{SHARDED}$")


def _left_by(marker: Path) -> str:
    """The host a mark names; "a node" when it cannot be read (a mark is only a hint)."""
    try:
        host = json.loads(marker.read_text()).get("host")
    except (OSError, ValueError, AttributeError):
        return "a node"
    return host if isinstance(host, str) and host.isprintable() else "a node"


def _missing(directory: Path, name: str) -> str:
    """Which ranks' parts of sharded checkpoint ``name`` never reached ``directory``."""
    found: set[str] = set()
    for gathering in directory.glob(f".{name}.*{GATHERING}"):
        found.update(p.name[len(DRAINED) :] for p in gathering.glob(f"{DRAINED}*"))
    have = ", ".join(sorted(found, key=int)) or "none"
    return f"parts in from rank(s) {have}"


def _copy(source: Path, target: Path) -> None:
    with open(source, "rb") as read, open(target, "wb") as out:
        shutil.copyfileobj(read, out, 16 << 20)
        out.flush()
        os.fsync(out.fileno())

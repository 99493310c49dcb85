"""A node-local tier before the run directory: ``--local-checkpoint-dir DIR``.

Rank 0 writes each checkpoint to ``DIR`` (node-local NVMe, ``$TMPDIR``): the loop waits
for that write alone. One background thread then drains it to ``RUN_DIR/checkpoints``
(a temporary name, fsync, rename) and publishes it there: ``latest`` moves only to a
checkpoint that is complete on the shared file system, so a resume always uses a
durable one. The local copy is removed once drained: the local tier holds only what
still drains.

While a checkpoint drains, ``RUN_DIR/.draining-<name>`` says so and from which host. A
job that ended before the drain did (a lost node) leaves it; the next job drains the
local copy if it is on the same node, else says in one line that this checkpoint was
lost and resumes from the newest durable one.

A drain that fails (a read-only or full shared folder) is said once and retried, with
growing pauses. A local folder that is full makes the checkpoint go straight to the run
directory, said once.
"""

import hashlib
import json
import os
import queue
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
    CheckpointDir,
    WriteFailed,
    _fsync_dir,
    atomic_save,
    checkpoint_name,
    list_checkpoints,
    point,
)
from dmltrain.errors import first_line

MARKER = ".draining-"  # RUN_DIR/.draining-<checkpoint name>: a drain in flight
RETRY_MOST_SECONDS = 60.0  # a failing drain is retried at most this far apart
SETTLE_SECONDS = 300.0  # as the job ends, a failing drain is retried this long


def local_folder(given: Path, run_dir: Path) -> Path:
    """This run's folder in ``--local-checkpoint-dir``: the run directory's name and a
    digest of its path, so that runs sharing a node's folder keep apart."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return given / f"{run_dir.name}-{digest}"


class TieredDir(CheckpointDir):
    """The run directory's checkpoints (``directory``, the durable tier), written first to
    ``local`` (a folder of its own on this node) and drained in the background.
    ``warn``: rank 0's warning line (a drain's failure, the local folder full)."""

    def __init__(
        self,
        directory: Path,
        local: Path,
        keep_last: int,
        warn: Callable[[str], None],
        asynchronous: bool = False,
    ) -> None:
        super().__init__(directory, keep_last, asynchronous)
        self.local, self.warn = local, warn
        self._queue: queue.Queue[tuple[Path, str, bool]] = queue.Queue()
        self._saves = 0  # a number for each local file: a step saved twice is two files
        self._drainer: threading.Thread | None = None
        self._publishing = threading.Lock()  # the drainer's and a straight write's
        self._straight = False  # the local folder was full at the last save
        self._failing: str | None = None  # why the drain in flight failed, said once

    def where(self) -> str:
        return f"{self.directory} (through {self.local})"

    def shards_problem(self) -> str | None:
        return (
            "--local-checkpoint-dir takes full checkpoints (rank 0 writes one file): pass "
            "--checkpoint-format full, or drop --local-checkpoint-dir"
        )

    # ----- saving ---------------------------------------------------------------------
    def _write(self, state: dict[str, Any], epoch: int, global_step: int, best: bool) -> Path:
        name = checkpoint_name(epoch, global_step)
        self.local.mkdir(parents=True, exist_ok=True)
        self._saves += 1
        staged = self.local / f"{name}.{self._saves}"
        try:
            atomic_save({"format_version": FORMAT_VERSION, **state}, staged)
        except WriteFailed as exc:
            if not self._straight:
                self.warn(
                    f"{exc}: the local checkpoint folder is full, so checkpoints go straight "
                    f"to {self.directory} until it has room"
                )
            self._straight = True
            return super()._write(state, epoch, global_step, best)
        self._straight = False
        self._queue.put((staged, name, best))
        if self._drainer is None:
            self._drainer = threading.Thread(target=self._drain_all, daemon=True)
            self._drainer.start()
        return self.directory / name

    def _drain_all(self) -> None:
        while True:
            staged, name, best = self._queue.get()
            try:
                self._drain(staged, name, best)
            finally:
                self._queue.task_done()

    def _drain(self, staged: Path, name: str, best: bool) -> None:
        """Copy ``staged`` to the run directory as ``name`` and publish it, retrying until
        it is."""
        pause = 1.0
        while True:
            try:
                self._copy_and_publish(staged, name, best)
                break
            except OSError as exc:
                why = f"{exc.strerror or first_line(exc)}"
                if self._failing != why:
                    durable = list_checkpoints(self.directory)
                    last = (
                        f"the newest durable one is {durable[0]}"
                        if durable
                        else "none is durable yet"
                    )
                    self.warn(
                        f"draining checkpoint {name} from {self.local} to "
                        f"{self.directory} failed ({why}); retrying; {last}"
                    )
                    self._failing = why
                time.sleep(pause)
                pause = min(2 * pause, RETRY_MOST_SECONDS)
        if self._failing is not None:
            self.warn(f"checkpoint {name} drained to {self.directory}")
            self._failing = None
        staged.unlink(missing_ok=True)

    def _copy_and_publish(self, staged: Path, name: str, best: bool) -> None:
        marker = self.directory.parent / f"{MARKER}{name}"
        marker.write_text(json.dumps({"host": socket.gethostname(), "local": str(staged)}))
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / name
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(staged, "rb") as source, open(tmp, "wb") as out:
                shutil.copyfileobj(source, out, 16 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
            _fsync_dir(self.directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._publishing:
            self._publish(target, best)
        marker.unlink(missing_ok=True)

    def _publish(self, path: Path, best: bool, prune: bool = True) -> None:
        """As the run directory's, except that ``latest`` never moves back (a straight
        write may publish a newer one while an older one drains)."""
        newest = list_checkpoints(self.directory)
        if not newest or newest[0] == path:
            super()._publish(path, best, prune)
            return
        if best:
            point(self.directory / f"best{FULL}", path)
        if prune:
            self._prune()

    def settle(self) -> None:
        """As the job ends: every checkpoint drained, or (the shared folder failing for
        ``SETTLE_SECONDS``) the ones left said in a line; they stay in the local folder."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._queue.unfinished_tasks:
            self.warn(
                f"{self._queue.unfinished_tasks} checkpoint(s) could not be drained to "
                f"{self.directory} ({self._failing}); they stay in {self.local} on "
                f"{socket.gethostname()}, and the next job on this node drains them"
            )

    # ----- resuming -------------------------------------------------------------------
    def latest_valid(self, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
        """A drain an earlier job left unfinished is done now when its local copy is on
        this node; else that checkpoint is lost, said in one line. Then as the run
        directory's. A rollback within this job first lets its own drains finish."""
        if self._drainer is not None:
            self.settle()
        for marker in sorted(self.directory.parent.glob(f"{MARKER}*")):
            name = marker.name[len(MARKER) :]
            staged = Path(json.loads(marker.read_text() or "{}").get("local", self.local / name))
            if staged.is_file():
                self._drain(staged, name, best=False)
            elif not (self.directory / name).is_file():
                host = json.loads(marker.read_text() or "{}").get("host", "another node")
                durable = list_checkpoints(self.directory)
                went_on = f"the newest durable one, {durable[0].name}" if durable else "the start"
                warn(
                    f"checkpoint {name} was still draining from {host}'s local folder when "
                    f"the last job ended and is lost with that node; going on from {went_on}"
                )
            marker.unlink(missing_ok=True)
        return super().latest_valid(warn)

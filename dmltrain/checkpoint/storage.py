"""Checkpoints: atomic files, ``latest``/``best`` links, keep-last-K, safe loading.

Layout under the run directory::

    checkpoints/ckpt-000003-00000189.pt   # epoch (1-based, epochs begun), global step
    checkpoints/latest.pt -> ckpt-...pt   # always a complete checkpoint
    checkpoints/best.pt   -> ckpt-...pt   # best value of --best-metric so far

A file is written to a temporary name in the same directory, flushed and fsynced, renamed,
and the directory fsynced; only then do the links move and old files go. Files hold only
tensors and plain Python values, so ``torch.load(path, weights_only=True)`` reads them on
any machine, without dmltrain.

Sharded checkpoints (FSDP) are directories, ``ckpt-000003-00000189.dcp/`` with links
``latest.dcp``/``best.dcp``: every rank writes its shards with
``torch.distributed.checkpoint`` into a temporary directory, rank 0 adds ``trainer.pt``
(everything but model and optimizer) and renames the directory into place. ``consolidate``
turns one into a single ``.pt`` file of the same format as above.
"""

import errno
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from dmltrain.checkpoint.snapshot import snapshot
from dmltrain.errors import UserError, first_line

FORMAT_VERSION = 1
PREFIX = "ckpt-"
FULL, SHARDED = ".pt", ".dcp"  # a file; a directory written by torch.distributed.checkpoint
SHARDED_META = "trainer.pt"  # in a sharded checkpoint: everything but model and optimizer


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TooNew(UserError):
    """A checkpoint written by a newer dmltrain: not corrupt, and never skipped for an older
    one (the older one's run would go on and rotate the newer files away)."""


class WriteFailed(UserError):
    """A checkpoint could not be written (a full disk, a quota); the files already there,
    ``latest`` among them, are untouched."""


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` that never leaves a partial file under ``path``; ``WriteFailed``
    with one line saying why when it cannot write."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch reports a short write as RuntimeError
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)  # first: the free space is measured without it
        raise WriteFailed(_why_not_written(path, exc, written)) from None
    except BaseException:  # an interrupt mid-write
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _size(path: Path) -> int:
    """A checkpoint's bytes: a file's, or a sharded directory's files'."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _why_not_written(path: Path, exc: BaseException, written: int) -> str:
    """One line: no space (how much there is, how much a checkpoint takes) or the error;
    and the newest checkpoint that is complete."""
    older = [p for p in list_checkpoints(path.parent) if p.exists()]  # path: the one before
    last = f"the last good checkpoint is {older[0]}" if older else "no checkpoint was written yet"
    if older and older[0] == path:
        last = f"the checkpoint {path}, of the same step, stands"
    needed = _size(older[0]) if older else written
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    no_space = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    if no_space or (free is not None and free < needed + (1 << 20)):
        mb = 1 << 20
        return (
            f"no space left for checkpoint {path} ({(free or 0) / mb:.1f} MB free on its file "
            f"system, a checkpoint takes {'about' if older else 'over'} {needed / mb:.1f} MB); "
            f"{last}"
        )
    return f"cannot write checkpoint {path} ({first_line(exc)}); {last}"


def _first_failure(exc: BaseException) -> BaseException:
    """The first rank's own error inside torch.distributed.checkpoint's
    ``CheckpointException`` (whose text is every rank's traceback), else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc


def point(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target`` (same directory), atomically."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


def checkpoint_name(epoch: int, global_step: int, kind: str = FULL) -> str:
    return f"{PREFIX}{epoch:06d}-{global_step:08d}{kind}"


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (files and sharded directories), newest first."""
    if not directory.is_dir():
        return []
    found = [*directory.glob(f"{PREFIX}*{FULL}"), *directory.glob(f"{PREFIX}*{SHARDED}")]
    return sorted(found, key=lambda p: p.name.rsplit(".", 1)[0], reverse=True)


def is_sharded(path: Path) -> bool:
    return path.is_dir()


def load_file(path: Path) -> dict[str, Any]:
    """Load a checkpoint (weights only, memory-mapped: a tensor is read only when it is
    used; a resume's rank 0 hands it to the others, ``handout``); a clear UserError if it
    is unreadable.

    For a sharded checkpoint this is ``trainer.pt`` with ``model`` and ``optimizer`` set
    to None (``load_sharded`` reads them), the model's ``shapes`` and the checkpoint's
    ``index``, once the shards are checked to be complete (a stat() of every shard).
    """
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if is_sharded(path) and not (path / ".metadata").exists() and not path.name.endswith(SHARDED):
        raise UserError(
            f"{path} is a directory, not a checkpoint: pass one of its checkpoint files "
            "(RUN_DIR/checkpoints/latest.pt), or --run-dir RUN_DIR to go on with a run"
        )
    if is_sharded(path):
        index = read_index(path)
        shapes = sharded_shapes(path, index)  # raises if torn
        state = _load(path / SHARDED_META, path)
        state.update(model=None, optimizer=None, sharded=True, shapes=shapes, index=index)
    else:
        state = _load(path, path)
    return checked(state, path)


def checked(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state``, read from ``path``, once it is known to be a dmltrain checkpoint this
    dmltrain can read."""
    if "model" not in state:
        raise UserError(f"{path} is not a dmltrain checkpoint (no 'model' entry)")
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise TooNew(
            f"checkpoint {path} has format {state['format_version']}; this dmltrain reads "
            f"up to {FORMAT_VERSION}: upgrade dmltrain"
        )
    return state


def _load(file: Path, checkpoint: Path) -> dict[str, Any]:
    with open(file, "rb") as handle:  # torch.save writes a zip archive
        if handle.read(4) not in (b"PK\x03\x04", b""):  # empty: a truncated one
            raise UserError(f"{checkpoint} is not a checkpoint (not a file that torch.save wrote)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        if "Weights only load failed" in str(exc):  # a pickle with more than tensors
            raise UserError(f"{checkpoint} is not a checkpoint that dmltrain wrote") from None
        why = re.sub(r"\x1b\[[0-9;]*m", "", first_line(exc))  # no terminal colours
        raise UserError(f"checkpoint {checkpoint} is truncated or corrupt ({why})") from None
    if not isinstance(state, dict):
        raise UserError(f"{checkpoint} is not a dmltrain checkpoint")
    return state


def read_index(path: Path) -> Any:
    """A sharded checkpoint's index (DCP's ``.metadata``: every shard's place, O(ranks x
    tensors) bytes), read as data; a clear UserError when it is unreadable."""
    from dmltrain.checkpoint.dcp_reading import read_metadata

    return read_metadata(path)


def sharded_shapes(path: Path, metadata: Any, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Model parameter shapes of a sharded checkpoint (``metadata``: its index), after
    checking all its shards exist and are long enough (a cheap test for a torn or
    truncated save: a stat() a shard)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in needed.items():
        shard = path / name
        if not shard.is_file() or shard.stat().st_size < size:
            raise UserError(f"checkpoint {path} is incomplete or corrupt (shard {name})")
    return {
        key[len(prefix) :]: tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def load_latest_valid(directory: Path, warn: Any) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, or None when there is none; corrupt ones are
    reported and skipped. A directory whose checkpoints all fail to load, or whose newest
    loadable one is of a newer format (``TooNew``), is a ``UserError``: going on from step
    0 there would rotate those checkpoints away."""
    return first_that_loads(list_checkpoints(directory), load_file, str(directory), warn)


def first_that_loads(
    found: list[Any], read: Callable[[Any], dict[str, Any]], where: str, warn: Any
) -> tuple[Any, dict[str, Any]] | None:
    """The first of ``found`` (checkpoints, newest first) that ``read`` loads, with its
    state; ``load_latest_valid``'s rules, for any store (``where``: as a line names it)."""
    for location in found:
        try:
            return location, read(location)
        except TooNew:
            raise
        except UserError as exc:
            if location == found[-1]:
                raise UserError(
                    f"none of the {len(found)} checkpoint(s) in {where} loads (the oldest: "
                    f"{exc}); nothing was changed: move them away to start this run over, or "
                    "pass a new --run-dir"
                ) from None
            warn(f"{exc}; falling back to the previous checkpoint")
    return None


class CheckpointStore(Protocol):
    """Where a run's checkpoints are kept: the checkpointer reaches them through this alone.
    Locations are strings (a path here; a URI in a store of objects). ``CheckpointDir``,
    the files of a run directory, is the first.

    A write is published (becomes ``newest``, and ``latest``/``best``) only once it is
    complete; ``keep_last`` older ones are kept, never the best."""

    asynchronous: bool  # whether a save may write in the background

    def where(self) -> str:
        """The store, as a line names it."""
        ...

    def save(
        self, state: dict[str, Any], epoch: int, global_step: int, best: bool, wait: bool = False
    ) -> str:
        """Rank 0: a full checkpoint written and published; its location."""
        ...

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
        """Collective: every rank's shards; rank 0 (``meta``) publishes."""
        ...

    def wait(self) -> None:
        """A background write done; its failure raised (``WriteFailed``)."""
        ...

    def holds(self, epoch: int, global_step: int, sharded: bool) -> bool:
        """Whether this step's checkpoint is there, complete."""
        ...

    def newest(self) -> str | None: ...

    def latest_valid(self, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint that loads (corrupt ones said and skipped), or None."""
        ...

    def read(self, location: str) -> dict[str, Any]:
        """A checkpoint's state (``load_file``'s); a sharded one without its shards."""
        ...

    def read_shards(self, location: str, shards: dict[str, Any], index: Any) -> None:
        """A sharded checkpoint's shards, into ``shards`` in place."""
        ...

    def shards_problem(self) -> str | None:
        """Why sharded checkpoints (torch.distributed.checkpoint) cannot go here, or None."""
        ...

    def settle(self, main: bool = True, failed: bool = False) -> None:
        """Every rank, as the job ends (``main``: rank 0; ``failed``: the job failed, a
        peer may be gone): what is still in flight made durable (a drain from a node-local
        folder, the records copied to a remote store)."""
        ...


class CheckpointDir:
    """Writes checkpoints of one run (on rank 0; sharded ones on every rank) and keeps the
    newest ``keep_last``: the ``CheckpointStore`` of local (or shared) files.

    With ``asynchronous=True`` a save copies the state (the only part that blocks the
    loop) and writes it in a background thread; one write is in flight at a time, and a
    failed write is raised at the next ``save`` or ``wait``.
    """

    def __init__(self, directory: Path, keep_last: int, asynchronous: bool = False) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._staging: Any = None  # the last asynchronous save's copy, reused by the next

    def where(self) -> str:
        return str(self.directory)

    def shards_problem(self) -> str | None:
        return None

    def settle(self, main: bool = True, failed: bool = False) -> None:
        """Everything is in the run directory already."""

    def holds(self, epoch: int, global_step: int, sharded: bool) -> bool:
        path = self.directory / checkpoint_name(epoch, global_step, SHARDED if sharded else FULL)
        return path.exists() if sharded else path.is_file()

    def newest(self) -> str | None:
        found = list_checkpoints(self.directory)
        return str(found[0]) if found else None

    def latest_valid(self, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
        found = load_latest_valid(self.directory, warn)
        return None if found is None else (str(found[0]), found[1])

    def read(self, location: str) -> dict[str, Any]:
        from dmltrain.checkpoint import objects  # it builds on this module

        return objects.read(location, self.directory)

    def read_shards(self, location: str, shards: dict[str, Any], index: Any) -> None:
        load_sharded(Path(location), shards, index)

    def save(
        self, state: dict[str, Any], epoch: int, global_step: int, best: bool, wait: bool = False
    ) -> str:
        self.wait()
        path = str(self.directory / checkpoint_name(epoch, global_step))
        if not self.asynchronous or wait:
            self._write(state, epoch, global_step, best)
            return path
        copy = self._staging = snapshot(state, self._staging)
        self._in_background(self._write, copy, epoch, global_step, best)
        return path

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its failure."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            if isinstance(failure, WriteFailed):
                raise failure
            raise WriteFailed(
                f"writing a checkpoint in {self.directory} failed: {first_line(failure)}"
            )

    def _in_background(self, work: Callable[..., Any], *args: Any) -> None:
        """Run ``work`` in the one writer thread; its failure is raised at ``wait``."""

        def run() -> None:
            try:
                work(*args)
            except BaseException as exc:
                self._failure = exc

        self._writer = threading.Thread(target=run, daemon=True)  # a failed run leaves it
        self._writer.start()

    def _write(self, state: dict[str, Any], epoch: int, global_step: int, best: bool) -> Path:
        self._clean_stale()
        path = self.directory / checkpoint_name(epoch, global_step)
        atomic_save({"format_version": FORMAT_VERSION, **state}, path)
        self._publish(path, best)
        return path

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
        """Collective: every rank writes its ``shards`` (model and optimizer state dicts
        from ``get_state_dict``); rank 0, the one passing ``meta``, publishes the result.

        ``asynchronous``: every rank copies its shards and writes them in the background,
        over ``group`` (a CPU process group of every rank apart from the loop's; None with
        one process), and rank 0 publishes once all are written; ``wait`` on every rank
        ends it. The save's plan is cached (the same shards each time): rank 0 then merges
        no plans, which at 1,024 ranks is what a save costs."""
        path = self.directory / checkpoint_name(epoch, global_step, SHARDED)
        tmp = path.with_name(f".{path.name}.tmp-sharded")
        self.wait()  # every rank: its part of the write in flight
        if meta is not None:
            self._clean_stale(keep=tmp.name)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()  # the directory exists before any rank writes
        if not asynchronous:
            self._write_sharded(shards, tmp, path, meta, best, prune=False)
            barrier()
            if meta is not None:  # an old checkpoint's N+2 files: not while every rank waits
                self._in_background(self._prune)
            return str(path)
        # Copied as the .pt path copies (into the last save's copy): torch's stager deep-copies
        # every DTensor's Python structure at each save, several times the memory copy. The
        # writer thread then does what dcp.async_save would do in a thread of its own (a
        # second thread to start while the first plans keeps the loop waiting for the
        # interpreter's lock).
        copy = self._staging = snapshot(shards, self._staging)
        self._in_background(self._write_sharded, copy, tmp, path, meta, best, group)
        return str(path)

    def _write_sharded(
        self,
        shards: dict[str, Any],
        tmp: Path,
        path: Path,
        meta: dict[str, Any] | None,
        best: bool,
        group: Any = None,
        prune: bool = True,
    ) -> None:
        """Every rank's part of a sharded save; rank 0 (``meta``) publishes it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        try:
            dcp.save(
                shards,
                storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                planner=DefaultSavePlanner(enable_plan_caching=True),  # torch's cache, by class
                process_group=group,
            )
        except (Exception, CheckpointException) as exc:  # every rank's, gathered: all raise it
            if meta is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise WriteFailed(_why_not_written(path, _first_failure(exc), 0)) from None
        if meta is not None:  # dcp.save returns on rank 0 once every rank's shards are written
            self._publish_sharded(tmp, path, meta, best, prune)

    def _publish_sharded(
        self, tmp: Path, path: Path, meta: dict[str, Any], best: bool, prune: bool = True
    ) -> None:
        atomic_save({"format_version": FORMAT_VERSION, **meta}, tmp / SHARDED_META)
        _fsync_dir(tmp)
        if path.exists():  # the same step saved again (step and epoch checkpoints met)
            old = path.with_name(f".{path.name}.tmp-old")
            os.replace(path, old)
            shutil.rmtree(old)
        os.replace(tmp, path)
        _fsync_dir(self.directory)
        self._publish(path, best, prune)

    def _clean_stale(self, keep: str = "") -> None:
        """Temporary files and directories left by a writer killed mid-save."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".*.tmp-*"):
            if stale.name == keep or stale.name.endswith(f".tmp-{os.getpid()}"):
                continue
            _remove(stale)

    def _publish(self, path: Path, best: bool, prune: bool = True) -> None:
        """Move the links to a complete checkpoint, then prune."""
        kind = SHARDED if is_sharded(path) else FULL
        point(self.directory / f"latest{kind}", path)
        if best:
            point(self.directory / f"best{kind}", path)
        if prune:
            self._prune()

    def _prune(self) -> None:
        """Delete all but the newest ``keep_last`` (never the best) after a safe save."""
        if self.keep_last <= 0:
            return
        keep = {
            link.resolve()
            for link in (self.directory / f"best{FULL}", self.directory / f"best{SHARDED}")
            if link.exists()
        }
        for path in list_checkpoints(self.directory)[self.keep_last :]:
            if path.resolve() not in keep:
                _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def load_sharded(path: Path, shards: dict[str, Any], index: Any) -> None:
    """Fill ``shards`` (state dicts from ``get_state_dict``, keys ``model``/``optimizer``)
    in place from a sharded checkpoint whose ``index`` was read already (``load_file``);
    collective when a process group is up."""
    import torch.distributed.checkpoint as dcp

    from dmltrain.checkpoint.dcp_reading import LoadPlanner, Reader, said_in_one_line

    with said_in_one_line(path):
        dcp.load(shards, storage_reader=Reader(path, index), planner=LoadPlanner())


def consolidate(source: Path, target: Path, ema: bool = False) -> Path:
    """One ``.pt`` file (this module's format) from a sharded checkpoint directory; with
    ``ema``, its model is the averaged weights (``--ema-decay``), from either kind."""
    if not is_sharded(source) and not (ema and source.is_file()):
        raise UserError(f"{source} is not a sharded checkpoint directory (ckpt-*.dcp)")
    if target.exists() and target.is_dir():
        target = target / source.with_suffix(FULL).name
    state = read_whole(source, ema=ema)
    atomic_save(state, target)
    return target


def read_whole(source: Path, ema: bool = False, model_only: bool = False) -> dict[str, Any]:
    """A checkpoint of either kind as a full one holds it: a sharded one's shards read into
    one state, in this process alone; with ``ema``, its model is the averaged weights.
    ``model_only``: of a sharded one, the model's shards (or the average's) alone."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dmltrain.checkpoint.dcp_reading import Reader, WholeLoadPlanner, said_in_one_line

    state = load_file(source)
    if ema and "ema" not in state and not state.get("ema_sharded"):
        raise UserError(f"{source} holds no averaged weights (trained without --ema-decay)")
    index = state.pop("index", None)
    if state.pop("sharded", False):
        keys = ({"ema"} if ema else {"model"}) if model_only else None
        shards: dict[str, Any] = {}
        # as dcp_to_torch_save reads them, without its file: no collective (no_dist)
        planner = WholeLoadPlanner(keys=keys)
        with said_in_one_line(source):
            _load_state_dict(shards, Reader(source, index), planner=planner, no_dist=True)
        state.update(model=shards.get("model"), optimizer=shards.get("optimizer"))
        if state.pop("ema_sharded", False):  # a full checkpoint's place for it
            state["ema"] = shards["ema"]
    if ema:
        state["model"] = state["ema"]
    return state

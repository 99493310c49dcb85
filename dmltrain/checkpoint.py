"""Checkpoints: atomic files, ``latest``/``best`` links, keep-last-K, safe loading.

Layout under the run directory::

    checkpoints/ckpt-000003-00000189.pt   # epoch (1-based, epochs begun), global step
    checkpoints/latest.pt -> ckpt-...pt   # always a complete checkpoint
    checkpoints/best.pt   -> ckpt-...pt   # best value of --best-metric so far

A file is written to a temporary name in the same directory, flushed and fsynced, renamed,
and the directory fsynced; only then do the links move and old files go. Files hold only
tensors and plain Python values, so ``torch.load(path, weights_only=True)`` reads them on
any machine, without dmltrain.
"""

import os
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dmltrain.errors import UserError

FORMAT_VERSION = 1
PREFIX = "ckpt-"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` that never leaves a partial file under ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _point(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target`` (same directory), atomically."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


def checkpoint_name(epoch: int, global_step: int) -> str:
    return f"{PREFIX}{epoch:06d}-{global_step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoint files, newest first."""
    if not directory.is_dir():
        return []
    return sorted(directory.glob(f"{PREFIX}*.pt"), reverse=True)


def load_file(path: Path) -> dict[str, Any]:
    """Load a checkpoint (weights only); a clear UserError if it is unreadable."""
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first[:200]})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a dmltrain checkpoint (no 'model' entry)")
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(
            f"checkpoint {path} has format {state['format_version']}; this dmltrain reads "
            f"up to {FORMAT_VERSION}: upgrade dmltrain"
        )
    return state


def load_latest_valid(directory: Path, warn: Any) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; corrupt ones are reported and skipped."""
    for path in list_checkpoints(directory):
        try:
            return path, load_file(path)
        except UserError as exc:
            warn(f"{exc}; falling back to the previous checkpoint")
    return None


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors no longer share memory with the live model."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(value) for value in obj)
    return obj


class CheckpointDir:
    """Writes checkpoints of one run (on rank 0) and keeps the newest ``keep_last``.

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

    def save(
        self, state: dict[str, Any], epoch: int, global_step: int, best: bool, wait: bool = False
    ) -> Path:
        self.wait()
        path = self.directory / checkpoint_name(epoch, global_step)
        if not self.asynchronous or wait:
            self._write(state, epoch, global_step, best)
            return path
        copy = snapshot(state)
        self._writer = threading.Thread(
            target=self._write_in_background, args=(copy, epoch, global_step, best)
        )
        self._writer.start()
        return path

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its failure."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise UserError(f"writing a checkpoint in {self.directory} failed: {failure}")

    def _write_in_background(
        self, state: dict[str, Any], epoch: int, step: int, best: bool
    ) -> None:
        try:
            self._write(state, epoch, step, best)
        except BaseException as exc:
            self._failure = exc

    def _write(self, state: dict[str, Any], epoch: int, global_step: int, best: bool) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".*.tmp-*"):  # left by a writer killed mid-save
            if not stale.name.endswith(f".tmp-{os.getpid()}"):
                stale.unlink(missing_ok=True)
        path = self.directory / checkpoint_name(epoch, global_step)
        atomic_save({"format_version": FORMAT_VERSION, **state}, path)
        _point(self.directory / "latest.pt", path)
        if best:
            _point(self.directory / "best.pt", path)
        self._prune()
        return path

    def _prune(self) -> None:
        """Delete all but the newest ``keep_last`` (never the best) after a safe save."""
        if self.keep_last <= 0:
            return
        best = self.directory / "best.pt"
        keep = {best.resolve()} if best.exists() else set()
        for path in list_checkpoints(self.directory)[self.keep_last :]:
            if path.resolve() not in keep:
                path.unlink(missing_ok=True)


def check_model_fits(model: nn.Module, weights: dict[str, torch.Tensor], source: Path) -> None:
    """A UserError naming missing/unexpected keys and shape mismatches, if any."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [
        f"{k} {tuple(weights[k].shape)} in checkpoint vs {tuple(own[k].shape)} in model"
        for k in sorted(set(own) & set(weights))
        if tuple(own[k].shape) != tuple(weights[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {_few(shapes)}")
    if problems:
        raise UserError(f"checkpoint {source} does not fit this model: {'; '.join(problems)}")


def _few(items: list[str], n: int = 4) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


def strip_prefixes(weights: dict[str, Any]) -> dict[str, Any]:
    """Model keys without wrapper prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    out = {}
    for key, value in weights.items():
        for prefix in ("module.", "_orig_mod."):
            key = key.replace(prefix, "")
        out[key] = value
    return out


# ----- random number generator state (weights_only-safe) --------------------------------------
def rng_state() -> dict[str, Any]:
    np_state: tuple[Any, ...] = np.random.get_state()  # type: ignore[assignment]
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(value: Any) -> Any:
    """random.setstate needs tuples where a round trip may have produced lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value

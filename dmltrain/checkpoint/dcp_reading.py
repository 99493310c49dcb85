"""A sharded checkpoint's files read as data, never as code.

torch.distributed.checkpoint (DCP) keeps a checkpoint's index, ``.metadata``, as a plain
pickle, and reads each non-tensor item of its shards with ``torch.load(weights_only=False)``:
a crafted file in a shared run directory would run code as whoever resumes it. Here the
index goes through an unpickler that builds DCP's own metadata classes and nothing else
(Python's "Restricting Globals", as torch's ``weights_only`` does for ``.pt`` files), and
the shards' items through ``weights_only=True``.
"""

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from dmltrain.errors import UserError, first_line

# What DCP pickles into ``.metadata`` (torch 2.13's FileSystemWriter): its dataclasses,
# torch.Size, dtypes and layouts by name, and the checkpoint id's path.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a name looked up among torch's layouts
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class NotData(UserError):
    """A sharded checkpoint's file asks to build something other than DCP's metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise NotData(f"{module}.{name}")


def read_metadata(path: Path) -> Metadata:
    """The index of the sharded checkpoint ``path``; a UserError naming the file when it
    is unreadable or holds anything but DCP's metadata (nothing in it runs)."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except NotData as exc:
        raise UserError(
            f"{file} is not a checkpoint's index: it asks to run {exc} (refused; a "
            "checkpoint holds data only). Remove it, and check who can write there"
        ) from None
    except Exception as exc:
        raise UserError(f"checkpoint {path} is incomplete or corrupt ({first_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"{file} is not a checkpoint's index (it holds {type(metadata).__name__})")
    for info in metadata.storage_data.values():
        shard = str(getattr(info, "relative_path", ""))
        if not shard or Path(shard).name != shard or shard in (".", ".."):
            raise UserError(
                f"{file} names a shard outside its folder ({shard!r}): refused; a "
                "checkpoint's shards are files of its own folder"
            )
    return metadata


class Reader(FileSystemReader):
    """DCP's file reader with the index read as data; ``index``, when given, is one read
    already (every rank would read it again)."""

    def __init__(self, path: Path, index: Metadata | None = None) -> None:
        super().__init__(str(path))
        self.index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = self.index if self.index is not None else read_metadata(Path(self.path))
        if index.storage_meta is not None:
            index.storage_meta.load_id = self.load_id  # as FileSystemReader's own
        return index


def _load_bytes(planner: Any, read_item: ReadItem, value: Any) -> None:
    """DCP's ``load_bytes`` for a non-tensor item (an optimizer's hyperparameters, a step
    count), read with ``weights_only``: plain values and tensors only."""
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    try:
        loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"a shard's item {fqn!r} holds more than plain values and tensors: refused (a "
            "checkpoint holds data only). Remove the checkpoint, and check who can write there"
        ) from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], loaded)
    else:
        planner.state_dict[fqn] = loaded


class LoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _load_bytes(self, read_item, value)


class WholeLoadPlanner(_EmptyStateDictLoadPlanner):
    """Reads every item the checkpoint has (``keys``: of these top-level keys only)."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _load_bytes(self, read_item, value)


@contextlib.contextmanager
def said_in_one_line(path: Path) -> Iterator[None]:
    """DCP's failures while reading ``path`` as one UserError: DCP wraps each rank's
    exception in a CheckpointException (a BaseException, with every rank's traceback)."""
    try:
        yield
    except UserError:
        raise
    except CheckpointException as exc:
        errors = [failure[0] for failure in exc.failures.values()]
        ours = [error for error in errors if isinstance(error, UserError)]
        if ours:
            raise UserError(f"{path}: {ours[0]}") from None
        why = first_line(errors[0]) if errors else "a rank failed"
        raise UserError(f"cannot load {path}: {why}") from None
    except Exception as exc:
        raise UserError(f"cannot load {path}: {first_line(exc)}") from None

"""Samples of a zarr store read in windows along time, as climate models read their
(time, level, lat, lon) archives: a stream that shards itself and says where it is.

Sample ``t`` is ``(inputs, target)``: the variables at ``window`` consecutive time steps
from ``t``, and at ``lead`` steps after the last of them. The store is opened in the
process that reads it (a loader worker, or the training process with no workers), never
before: an open store's file handles must not cross a fork. ``dmltrain[zarr]``.
"""

import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dmltrain.errors import UserError


class ZarrWindows(IterableDataset):
    """``(inputs, target)`` float32 tensors from the arrays ``variables`` of the zarr group
    at ``path``, each of shape (time, ...) with the same shape: inputs ``(window,
    variables, ...)``, target ``(variables, ...)``.

    Rank ``rank`` of ``world_size`` takes every ``world_size``-th sample of each pass
    (the remainder left out, so every rank has as many); its loader workers deal those out
    in turn. With ``seed`` each pass is shuffled by (seed, pass); without, samples come in
    time order. A pass begins with ``set_epoch``. ``state_dict`` says where this worker is
    in its pass.
    """

    def __init__(
        self,
        path: str,
        variables: str | Sequence[str],
        window: int = 1,
        lead: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int | None = None,
    ) -> None:
        if window < 1 or lead < 1:
            raise UserError(f"ZarrWindows: window and lead must be >= 1 (got {window}, {lead})")
        self.path = str(path)
        self.variables = [variables] if isinstance(variables, str) else list(variables)
        self.window, self.lead = window, lead
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch = 0  # the pass, for the shuffle
        self.position = 0  # samples of this worker's share of the pass yielded
        steps = _open(self.path, self.variables, strict=False)[0].shape[0]  # metadata only
        self.samples = max(steps - window - lead + 1, 0)
        if self.samples < world_size:
            raise UserError(
                f"{self.path}: {steps} time steps make {self.samples} sample(s) of window "
                f"{window} and lead {lead}, fewer than the {world_size} processes"
            )
        self._arrays: list[Any] | None = None

    def __len__(self) -> int:
        """This rank's samples in a pass."""
        return self.samples // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Begin pass ``epoch`` (dmltrain's loop calls it before each pass). A pass read to
        its end stays there until then: a worker restored at its end yields nothing more."""
        self.epoch, self.position = epoch, 0

    def _mine(self) -> list[int]:
        """This worker's samples of the pass, in order."""
        order = list(range(self.samples))
        if self.seed is not None:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        ranks = order[self.rank : len(self) * self.world_size : self.world_size]
        return ranks[worker::workers]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._arrays is None:
            self._arrays = _open(self.path, self.variables)
        mine = self._mine()
        while self.position < len(mine):
            t = mine[self.position]
            self.position += 1
            yield self._sample(t)

    def _sample(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        arrays = self._arrays or []
        inputs = np.stack([a[t : t + self.window] for a in arrays], axis=1)
        target = np.stack([a[t + self.window + self.lead - 1] for a in arrays], axis=0)
        return torch.from_numpy(inputs.astype(np.float32)), torch.from_numpy(
            target.astype(np.float32)
        )

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}  # reopened where it is read


class ChunkGone(UserError):
    """A chunk the store held when it was opened is gone (deleted while the run read it)."""


# zarr reads a missing chunk as its fill value; these keys are metadata, not chunks
_METADATA = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


def _strict(store: Any, path: str) -> Any:
    """``store``, whose chunks present at opening must stay: zarr would read a chunk
    deleted since (a scratch purge) as its fill value, and train on zeros. A chunk absent
    at opening is one zarr left unwritten (all fill value) and reads as such."""
    from zarr.core.sync import sync
    from zarr.storage import WrapperStore

    async def keys() -> set[str]:
        return {key async for key in store.list() if not key.endswith(_METADATA)}

    present = sync(keys())

    class Strict(WrapperStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            found = await self._store.get(key, prototype, byte_range)
            if found is None and key in present:
                raise ChunkGone(
                    f"{path}: its chunk {key} is gone since the run opened the store (deleted "
                    "while the run read it: a scratch purge?); restore the store and run the "
                    "same command: the checkpoints are intact"
                )
            return found

    return Strict(store)


def _open(path: str, variables: list[str], strict: bool = True) -> list[Any]:
    """The arrays ``variables`` of the group at ``path``; ``strict``: read through
    ``_strict`` (which lists the store's chunks once: not for a look at the metadata)."""
    try:
        import zarr
    except ImportError:
        raise UserError("ZarrWindows needs zarr: pip install 'dmltrain[zarr]'") from None
    try:
        group = zarr.open_group(path, mode="r")
        if strict:
            group = zarr.open_group(store=_strict(group.store, path), mode="r")
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise UserError(f"{path} is not a zarr group that can be read: {exc}") from None
    missing = [v for v in variables if v not in group]
    if missing:
        raise UserError(f"{path} has no array {', '.join(missing)} (it has {', '.join(group)})")
    arrays = [group[v] for v in variables]
    groups = [v for v, a in zip(variables, arrays, strict=True) if not isinstance(a, zarr.Array)]
    if groups:
        raise UserError(f"{path}: {', '.join(groups)} is a group, not an array")
    shapes = {tuple(a.shape) for a in arrays}  # type: ignore[union-attr]
    if len(shapes) > 1:
        raise UserError(f"{path}: {', '.join(variables)} differ in shape ({sorted(shapes)})")
    return arrays

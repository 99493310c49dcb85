"""What a batch is to the loop: moving it to the device, its size, one step's output, and
the groups of micro-batches that make one optimizer step."""

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from dmltrain.errors import UserError

StepOutput = Tensor | tuple[Tensor, Mapping[str, Tensor | float]]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory.
    For the CPU the batch is passed on as it is (a DataLoader's batches are there already,
    and ``to`` costs a call per tensor and step)."""
    if device.type == "cpu":
        return batch
    return _to_device(batch, device)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, (Tensor, Mapping, list, tuple)):
            return batch_size_of(value)
    raise UserError("cannot tell the batch size: a batch must contain at least one tensor")


def split_step_output(output: StepOutput) -> tuple[Tensor, Mapping[str, Tensor | float]]:
    """``train_step``'s return value as (loss, metrics): a bare loss has no metrics."""
    if isinstance(output, tuple):
        return output[0], output[1]
    return output, {}


def chunks(batches: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive groups of ``size`` batches (the last may be shorter): one optimizer step."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group

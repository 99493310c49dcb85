"""What a batch is to the loop: moving it to the device, its size, one step's output, and
the groups of micro-batches that make one optimizer step."""

from collections.abc import Iterable, Iterator, Mapping, Sequence
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
        return batch.shape[0]
    # list and tuple first: the Mapping check is an ABC's, slower than a step can afford
    if isinstance(batch, (list, tuple)):
        values: Iterable[Any] = batch
    else:
        values = batch.values() if isinstance(batch, Mapping) else ()
    for value in values:
        if isinstance(value, Tensor):
            return value.shape[0]
        if isinstance(value, (list, tuple, Mapping)):
            return batch_size_of(value)
    raise UserError("cannot tell the batch size: a batch must contain at least one tensor")


def split_step_output(output: StepOutput) -> tuple[Tensor, Mapping[str, Tensor | float]]:
    """``train_step``'s return value as (loss, metrics): a bare loss has no metrics. The
    metrics are detached (they are kept for a while, see ``MetricAccumulator``)."""
    if isinstance(output, tuple):
        loss, metrics = output
        if not isinstance(metrics, Mapping):
            raise UserError(
                "train_step must return the loss or (loss, dict of metrics); the second "
                f"element is a {type(metrics).__name__}"
            )
        return loss, {k: v.detach() if isinstance(v, Tensor) else v for k, v in metrics.items()}
    return output, {}


def chunks(batches: Iterable[Any], size: int) -> Iterator[Sequence[Any]]:
    """Consecutive groups of ``size`` batches (the last may be shorter): one optimizer step."""
    if size == 1:
        return zip(batches)  # groups of one, made in C: no bytecode a step
    return _groups(batches, size)


def _groups(batches: Iterable[Any], size: int) -> Iterator[list[Any]]:
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group

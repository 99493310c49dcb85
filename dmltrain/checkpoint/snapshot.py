"""Copies of nested state (dicts, lists, tuples of tensors) that no longer share memory
with the live tensors: what an asynchronous checkpoint writes, what a metric state saves."""

from typing import Any

import torch


def snapshot(obj: Any, into: Any = None) -> Any:
    """A copy of ``obj`` whose tensors no longer share memory with the live model.

    Tensors are copied into the matching tensors of ``into`` (an earlier snapshot of the
    same structure) where shapes and dtypes agree: reusing that memory saves allocating
    and page-faulting the whole state again, most of the cost of a copy on the CPU.
    """
    if isinstance(obj, torch.Tensor) and type(obj).__name__ == "DTensor":  # FSDP's shards
        from torch.distributed.tensor import DTensor

        assert isinstance(obj, DTensor)
        # The local tensors themselves: to_local and from_local are autograd functions, dear
        # next to the copy of FSDP's many small shards; the earlier copy's wrapper is kept
        # when its local tensor was copied into and it describes the same shard.
        earlier = into if isinstance(into, DTensor) else None
        local = snapshot(obj._local_tensor, None if earlier is None else earlier._local_tensor)
        if (
            earlier is not None
            and local is earlier._local_tensor
            and earlier.shape == obj.shape
            and earlier.stride() == obj.stride()
            and earlier.placements == obj.placements
            and earlier.device_mesh == obj.device_mesh
        ):
            return earlier
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())  # fmt: skip
    if isinstance(obj, torch.Tensor):
        if (
            isinstance(into, torch.Tensor)
            and into.shape == obj.shape
            and into.dtype == obj.dtype
            and into.device.type == "cpu"
        ):
            return into.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = into if isinstance(into, dict) else {}
        return {key: snapshot(value, old.get(key)) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        old_items = list(into) if isinstance(into, (list, tuple)) else []
        old_items += [None] * (len(obj) - len(old_items))
        return type(obj)(snapshot(v, o) for v, o in zip(obj, old_items, strict=False))
    return obj

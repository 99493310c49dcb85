"""Where a model too large for one device puts its memory: activations recomputed in the
backward, FSDP's mesh (sharded over all ranks, or hybrid: sharded inside groups and
replicated across them), the sharded initialisation, and CPU offload.

The sharded initialisation: rank 0 alone runs ``create_model()`` for real, on the CPU, after
the same seed as a one-process run; every other rank builds it on the meta device (no
memory). Every rank shards the meta model, allocates its own shard and receives it from
rank 0, so the weights are bitwise those of a one-process run and no rank but 0 ever holds
the whole model (rank 0 on the CPU only, until its shards are sent).
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmltrain import compat
from dmltrain.config import MemoryConfig
from dmltrain.errors import UserError, first_line


def check(memory: MemoryConfig, strategy: str, world_size: int, device: str) -> None:
    """Refuse, in one line before any process starts, what cannot run with this strategy,
    number of processes and device."""
    size = memory.fsdp_shard_size
    if size and strategy != "fsdp":
        raise UserError(f"--fsdp-shard-size needs --strategy fsdp (the strategy is {strategy})")
    if size and (size > world_size or world_size % size):
        raise UserError(
            f"--fsdp-shard-size {size} must divide the number of processes ({world_size}): "
            "each group of that many ranks holds one copy of the model"
        )
    if memory.cpu_offload and strategy != "fsdp":
        raise UserError(f"--cpu-offload needs --strategy fsdp (the strategy is {strategy})")
    if memory.cpu_offload and not device.startswith("cuda"):
        raise UserError(
            "--cpu-offload moves the sharded state of GPUs to CPU memory; this run is on the "
            "CPU, where it is already: leave --cpu-offload out"
        )


def place(
    create: Callable[[], nn.Module],
    adapt: Callable[[nn.Module, bool], nn.Module],
    check_model: Callable[[nn.Module], None],
    checkpointed: Callable[[nn.Module], list[nn.Module]],
    wrap: Callable[[nn.Module], nn.Module],
    memory: MemoryConfig,
    strategy: str,
    rank: int,
    world_size: int,
    device: torch.device,
) -> nn.Module:
    """The experiment's model built (``create``), adapted (``adapt(model, real)``: a
    fine-tune's weights, adapters and frozen parts; ``real`` where it has values), checked,
    its activations checkpointed
    when asked, wrapped by the strategy (``wrap``) and on ``device``: under FSDP's sharded
    initialisation, built on rank 0 alone and sent out shard by shard (on more than one
    rank: one would hold the whole twice)."""
    sharded = memory.sharded_init and strategy == "fsdp" and world_size > 1
    model = build(create, meta=sharded and rank != 0)
    model = adapt(model, not (sharded and rank != 0))
    check_model(model)
    if sharded:
        check_plain_tensors(model)
    whole = None
    if sharded and rank == 0:
        model, whole = take_whole(model)
    elif not (sharded or memory.cpu_offload):  # offloaded: fully_shard moves a unit at a time
        model = model.to(device)
    if memory.activation_checkpointing:
        checkpoint_activations(checkpointed(model), "checkpointed_modules")
    model = wrap(model)
    if sharded:
        materialise(model, whole, device)
    return model


def build(create: Callable[[], nn.Module], meta: bool) -> nn.Module:
    """``create()``, on the meta device when ``meta``, with a one-line error where the
    experiment's code needs real tensors."""
    if not meta:
        return create()
    try:
        with torch.device("meta"):
            return create()
    except Exception as exc:
        raise UserError(
            "create_model failed on the meta device, where ranks other than 0 build the "
            f"model under FSDP's sharded initialisation ({first_line(exc)}): build it "
            "without reading tensor values (load weights in create_model on rank 0 only, or "
            "with --load-weights), or pass --no-sharded-init"
        ) from None


def check_plain_tensors(model: nn.Module) -> None:
    """Refuse a tensor kept as a plain attribute of a module: it is neither sent nor
    allocated, so the ranks that built the model on the meta device would have no values."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, Tensor):
                where = f"{name}.{attr}" if name else attr
                raise UserError(
                    f"create_model's model keeps a tensor in {where}, not as a parameter or "
                    "buffer: under FSDP's sharded initialisation the ranks other than 0 would "
                    f"have no values for it; register it (self.register_buffer({attr!r}, ..., "
                    "persistent=False)), or pass --no-sharded-init"
                )


def take_whole(model: nn.Module) -> tuple[nn.Module, dict[str, Tensor]]:
    """Rank 0's model moved to the meta device like the others', and its whole state (every
    parameter and buffer, kept on the CPU) to send out once the model is sharded."""
    whole = {**model.state_dict(), **dict(model.named_buffers())}
    return model.to("meta"), whole


def materialise(model: nn.Module, whole: dict[str, Tensor] | None, device: torch.device) -> None:
    """Allocate this rank's part of a sharded meta model and fill it from rank 0's
    ``whole`` state (``None`` on other ranks), one tensor at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    kept = set(model.state_dict())
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sent: dict[str, Any] = {} if whole is None else {k: v for k, v in whole.items() if k in kept}
    set_model_state_dict(model, sent, options=options)
    for name, buffer in model.named_buffers():  # those a state dict leaves out
        if name not in kept:
            if whole is not None:
                buffer.copy_(whole[name])
            dist.broadcast(buffer, src=0)


def checkpoint_activations(modules: list[nn.Module], owner: str) -> None:
    """Recompute each module's activations in the backward (non-reentrant, the RNG state
    kept, so dropout draws the same masks again; running statistics as the forward left
    them, so batch norms count each batch once)."""
    if not modules:
        raise UserError(
            f"--activation-checkpointing: {owner} named no modules; return the blocks to "
            "recompute (the layers of a transformer, say)"
        )
    for module in modules:
        norms = [m for m in module.modules() if getattr(m, "track_running_stats", False)]
        compat.checkpoint_module(module, _kept(norms) if norms else None)


def _kept(norms: list[nn.Module]) -> Callable[[], Any]:
    """A context that puts the buffers of ``norms`` back as they were when it ends (read
    when it starts: a sharded initialisation allocates them after this is made)."""

    @contextlib.contextmanager
    def keeping() -> Iterator[None]:
        tensors = [t for norm in norms for t in norm.buffers(recurse=False)]
        before = [t.clone() for t in tensors]
        try:
            yield
        finally:
            with torch.no_grad():
                compat.foreach_copy_(tensors, before)

    return keeping


def fsdp_mesh(memory: MemoryConfig, world_size: int, device: str) -> Any:
    """The device mesh FSDP shards over: ``None`` (all ranks, one dimension) or the 2D
    (replicate, shard) mesh of hybrid sharding."""
    size = memory.fsdp_shard_size
    if not size or size == world_size:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world_size // size, size)
    return init_device_mesh(torch.device(device).type, shape, mesh_dim_names=("replicate", "shard"))

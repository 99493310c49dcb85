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
import functools
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
    from torch.nn.utils.spectral_norm import SpectralNorm

    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, Tensor):
                where = f"{name}.{attr}" if name else attr
                hooks = module._forward_pre_hooks.values()
                if any(isinstance(h, SpectralNorm) and h.name == attr for h in hooks):
                    raise UserError(
                        f"{where} is normalised by torch.nn.utils.spectral_norm, which keeps "
                        "the weight as a plain tensor that FSDP's sharded initialisation "
                        "cannot send: use torch.nn.utils.parametrizations.spectral_norm, "
                        "or pass --no-sharded-init"
                    )
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
    kept, so dropout draws the same masks again). State a forward updates is kept as one
    forward leaves it: batch norms' running statistics are put back after the
    recomputation (each batch counted once), and spectral norm's power-iteration vectors
    before it (the recomputation starts where the forward did, so its weight is the
    forward's)."""
    if not modules:
        raise UserError(
            f"--activation-checkpointing: {owner} named no modules; return the blocks to "
            "recompute (the layers of a transformer, say)"
        )
    odd = [m for m in modules if not isinstance(m, nn.Module)]
    if isinstance(modules, (str, nn.Module)) or odd:
        shown = modules if isinstance(modules, (str, nn.Module)) else odd[0]
        raise UserError(
            f"--activation-checkpointing: {owner} returned {shown!r}; return a list of the "
            "model's modules themselves (e.g. list(model.blocks)), not their names"
        )
    for module in modules:
        norms = [m for m in module.modules() if getattr(m, "track_running_stats", False)]
        vectors = _power_iteration_vectors(module)
        compat.checkpoint_module(module, _contexts(norms, vectors) if norms or vectors else None)


def _power_iteration_vectors(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Spectral norm's ``u`` and ``v`` buffers under ``module`` (their module and name: a
    sharded initialisation allocates them later), of either of torch's APIs."""
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    found: list[tuple[nn.Module, str]] = []
    for m in module.modules():
        if isinstance(m, _SpectralNorm):
            found += [(m, "_u"), (m, "_v")]
        for hook in m._forward_pre_hooks.values():
            if isinstance(hook, SpectralNorm):
                found += [(m, hook.name + "_u"), (m, hook.name + "_v")]
    return found


def _contexts(norms: list[nn.Module], vectors: list[tuple[nn.Module, str]]) -> Callable[[], Any]:
    """For each forward, a context around it that keeps the power-iteration vectors as
    they were before it, and one around its recomputation that starts from them and puts
    the norms' statistics back when it ends."""

    def pair() -> tuple[Any, Any]:
        before: list[Tensor] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            before.extend(getattr(m, name).clone() for m, name in vectors)
            yield

        @contextlib.contextmanager
        def recomputation() -> Iterator[None]:
            stats = [t for norm in norms for t in norm.buffers(recurse=False)]
            kept = [t.clone() for t in stats]
            _copy([getattr(m, name) for m, name in vectors], before)
            try:
                yield
            finally:
                _copy(stats, kept)

        return forward(), recomputation()

    return pair


def _copy(tensors: list[Tensor], values: list[Tensor]) -> None:
    if tensors:  # torch's foreach ops refuse empty lists
        with torch.no_grad():
            compat.foreach_copy_(tensors, values)


def power_iteration_in_its_dtype(model: nn.Module) -> None:
    """Spectral norm (``parametrizations.spectral_norm``) computed in its vectors' dtype:
    FSDP's mixed precision gathers the weight in bf16 or fp16 but leaves the ``u`` and ``v``
    buffers in fp32, and torch's power iteration refuses mixed dtypes. The normalised
    weight goes back in the compute dtype."""
    from torch.nn.utils.parametrizations import _SpectralNorm

    for module in model.modules():
        if isinstance(module, _SpectralNorm):
            module.forward = functools.partial(_in_vectors_dtype, module, type(module).forward)  # type: ignore[method-assign]


def _in_vectors_dtype(module: nn.Module, forward: Callable[..., Tensor], weight: Tensor) -> Tensor:
    vectors = module.get_buffer("_u").dtype
    return forward(module, weight.to(vectors)).to(weight.dtype)


def fsdp_mesh(memory: MemoryConfig, world_size: int, device: str) -> Any:
    """The device mesh FSDP shards over: ``None`` (all ranks, one dimension) or the 2D
    (replicate, shard) mesh of hybrid sharding."""
    size = memory.fsdp_shard_size
    if not size or size == world_size:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world_size // size, size)
    return init_device_mesh(torch.device(device).type, shape, mesh_dim_names=("replicate", "shard"))

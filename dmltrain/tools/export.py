"""``dmltrain export RUN -o model.safetensors``: a run's final (or best) weights as one
safetensors file, read by any framework without dmltrain or pickle.

A sharded checkpoint is consolidated first. A LoRA run's checkpoint holds its adapters;
the frozen base beside it (``RUN_DIR/base.safetensors``) is added back. ``--merge-lora``
folds each adapter into its layer with PEFT's own ``merge``, so the file is the plain
model's: ``create_model()`` without ``--lora-targets`` loads it strictly.
"""

import argparse
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from dmltrain.checkpoint import pretrained, storage
from dmltrain.engine.finetuning import BASE
from dmltrain.errors import UserError
from dmltrain.runtime import finetune


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run directory, or one of its checkpoints")
    parser.add_argument(
        "-o", "--output", help="the safetensors file to write (default: RUN_DIR/model.safetensors)"
    )
    parser.add_argument(
        "--best", action="store_true", help="the run's best.pt instead of its latest checkpoint"
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="fold the LoRA adapters into their layers: the plain model's weights",
    )


def run(args: argparse.Namespace) -> int:
    checkpoint, run_dir = _checkpoint(Path(args.run), args.best)
    state = storage.read_whole(checkpoint, model_only=True)
    weights = dict(state["model"])
    base = run_dir / BASE
    if any(".lora_" in key for key in weights) and base.exists():
        weights = {**pretrained.load_safetensors(base), **weights}
    if args.merge_lora:
        train = state.get("config", {}).get("train", {})
        weights = merge_lora(weights, train.get("lora_rank", 8), train.get("lora_alpha", 16.0))
    target = Path(args.output) if args.output else run_dir / "model.safetensors"
    pretrained.save_safetensors(weights, target)
    print(f"dmltrain: wrote {target} ({len(weights)} tensors from {checkpoint})")
    return 0


def _checkpoint(given: Path, best: bool) -> tuple[Path, Path]:
    """The checkpoint to export and its run directory."""
    if not given.exists():
        raise UserError(f"dmltrain export: {given} does not exist")
    if (given / "checkpoints").is_dir():
        name = "best" if best else "latest"
        found = [given / "checkpoints" / f"{name}{suffix}" for suffix in (".pt", ".dcp")]
        found = [path for path in found if path.exists()]
        if not found:
            raise UserError(f"dmltrain export: {given} has no {name} checkpoint yet")
        return found[0], given
    if best:
        raise UserError("dmltrain export: --best picks a run directory's best.pt; give the run")
    run_dir = given.parent.parent if given.parent.name == "checkpoints" else given.parent
    return given, run_dir


def merge_lora(weights: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """``weights`` of a model with LoRA adapters as the plain model's: each adapted layer's
    weight merged with its adapter (``W + alpha / rank * B @ A``, by PEFT), the adapters
    and PEFT's ``base_layer`` names gone."""
    adapted = sorted({key.split(".lora_")[0] for key in weights if ".lora_" in key})
    if not adapted:
        raise UserError("dmltrain export --merge-lora: this run has no LoRA adapters")
    peft = finetune.peft_module()
    merged = {key: value for key, value in weights.items() if ".lora_" not in key}
    for prefix in adapted:
        own = {k[len(prefix) + 1 :]: v for k, v in weights.items() if k.startswith(prefix + ".")}
        holder = nn.Module()
        holder.add_module("layer", _stand_in(own, prefix))
        config = peft.LoraConfig(target_modules=["layer"], r=rank, lora_alpha=alpha)
        peft.inject_adapter_in_model(config, holder)
        holder.load_state_dict({f"layer.{k}": v for k, v in own.items()}, strict=True)
        layer: Any = holder.layer
        layer.merge()
        for name, tensor in layer.get_base_layer().state_dict().items():
            merged.pop(f"{prefix}.base_layer.{name}", None)
            merged[f"{prefix}.{name}"] = tensor
    return merged


def _stand_in(own: dict[str, Tensor], prefix: str) -> nn.Module:
    """A layer of the base layer's kind and shape, to merge its adapter into."""
    weight, bias = own.get("base_layer.weight"), own.get("base_layer.bias")
    if weight is None:
        raise UserError(f"dmltrain export --merge-lora: {prefix} has adapters but no base weight")
    layer: nn.Module
    if any("lora_embedding_" in key for key in own):
        layer = nn.Embedding(*weight.shape)
    elif weight.dim() == 2:
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    elif weight.dim() in (3, 4, 5):
        conv: Any = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}[weight.dim()]
        layer = conv(
            weight.shape[1], weight.shape[0], tuple(weight.shape[2:]), bias=bias is not None
        )
    else:
        raise UserError(f"dmltrain export --merge-lora: cannot merge the adapter of {prefix}")
    return layer.to(weight.dtype)

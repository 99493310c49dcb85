"""The model's and the optimizer's state in a checkpoint: keyed by parameter name, and
checked against the model before loading.

Names are those of the unwrapped model (``strategies.unwrap``): without the prefixes of
DDP's and torch.compile's wrappers, so a checkpoint of any strategy loads into a bare
model with ``load_state_dict(strict=True)``, and into every other strategy.
"""

from pathlib import Path
from typing import Any

import torch

from dmltrain.errors import UserError, first_line


def shapes_of(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in weights.items()}


def check_model_fits(
    own: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], source: Path | str
) -> None:
    """A UserError naming missing/unexpected keys and shape mismatches, if any (both
    arguments map parameter names to shapes: the model's and the checkpoint's)."""
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    shapes = [
        f"{k} {saved[k]} in checkpoint vs {own[k]} in model"
        for k in sorted(set(own) & set(saved))
        if own[k] != saved[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {few(shapes)}")
    if problems:
        raise UserError(f"checkpoint {source} does not fit this model: {'; '.join(problems)}")


def few(items: list[str], n: int = 4) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the optimizer's order."""
    names = {id(p): key for key, p in model.named_parameters()}
    try:
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    except KeyError:
        raise UserError("the optimizer holds parameters that are not the model's") from None


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` keyed by parameter name instead of position: the format
    ``torch.distributed.checkpoint`` writes for a full state dict, so checkpoints of every
    strategy load into every other. Without FSDP this needs neither that module (slow to
    import) nor copies of the tensors."""
    names = _parameter_names(model, optimizer)
    raw = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in raw["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in raw["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict, path: Path | str
) -> None:
    """The inverse of ``optimizer_state_by_name``."""
    index = {name: i for i, name in enumerate(_parameter_names(model, optimizer))}
    try:
        state = {index[name]: value for name, value in saved["state"].items()}
        groups = [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in saved["param_groups"]
        ]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, ValueError) as exc:
        raise UserError(
            f"the optimizer state in {path} does not fit this model and optimizer "
            f"({first_line(exc)}); use --load-weights without --load-optimizer"
        ) from None


def optimizers_state_by_name(model: torch.nn.Module, optimizers: tuple[Any, ...]) -> dict:
    """``optimizer_state_by_name`` of several optimizers as one, as torch.distributed.checkpoint
    writes them: the states by parameter name, the param groups one optimizer's after the
    other's."""
    if len(optimizers) == 1:
        return optimizer_state_by_name(model, optimizers[0])
    parts = [optimizer_state_by_name(model, optimizer) for optimizer in optimizers]
    return {
        "state": {k: v for part in parts for k, v in part["state"].items()},
        "param_groups": [group for part in parts for group in part["param_groups"]],
    }


def load_optimizers_state_by_name(
    model: torch.nn.Module, optimizers: tuple[Any, ...], saved: dict, path: Path | str
) -> None:
    """The inverse of ``optimizers_state_by_name``: each optimizer takes as many param
    groups as it has, in order, and the states of their parameters."""
    if len(optimizers) == 1:
        load_optimizer_state_by_name(model, optimizers[0], saved, path)
        return
    groups = list(saved["param_groups"])
    if len(groups) != sum(len(o.param_groups) for o in optimizers):
        raise UserError(
            f"the optimizer state in {path} has {len(groups)} param groups, but this run's "
            f"{len(optimizers)} optimizers have {sum(len(o.param_groups) for o in optimizers)}; "
            "use --load-weights without --load-optimizer"
        )
    for optimizer in optimizers:
        mine, groups = groups[: len(optimizer.param_groups)], groups[len(optimizer.param_groups) :]
        names = {name for group in mine for name in group["params"]}
        state = {k: v for k, v in saved["state"].items() if k in names}
        load_optimizer_state_by_name(model, optimizer, {"state": state, "param_groups": mine}, path)


def dcp_optimizers(optimizers: tuple[Any, ...]) -> Any:
    """The optimizer, or several, as torch.distributed.checkpoint takes them."""
    return optimizers[0] if len(optimizers) == 1 else optimizers


def dcp() -> Any:
    """torch.distributed.checkpoint.state_dict, imported when first needed (FSDP, sharded
    checkpoints): it is slow to import and large."""
    from torch.distributed.checkpoint import state_dict

    return state_dict

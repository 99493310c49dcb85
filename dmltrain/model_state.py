"""The model's and the optimizer's state in a checkpoint: keyed by parameter name, and
checked against the model before loading.

Names are those of the unwrapped model (``distributed.unwrap``): without the prefixes of
DDP's and torch.compile's wrappers, so a checkpoint of any strategy loads into a bare
model with ``load_state_dict(strict=True)``, and into every other strategy.
"""

from pathlib import Path

import torch

from dmltrain.errors import UserError, first_line


def shapes_of(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in weights.items()}


def check_model_fits(
    own: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], source: Path
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
    strategy load into every other. Without FSDP this needs neither that module (0.8 s and
    some 45 MiB to import) nor copies of the tensors."""
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
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict, path: Path
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

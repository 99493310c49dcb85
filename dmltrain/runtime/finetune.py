"""What of a model trains: frozen parameters (``--freeze``), LoRA adapters through PEFT
(``--lora-targets``), and learning rates by parameter group (``--lr-scale``).

Freezing sets ``requires_grad=False`` before the strategy wraps the model: DDP then leaves
those parameters out of its buckets, FSDP out of its reduce-scatters, and Horovod's
optimizer (built over the optimizer's parameters) out of its allreduces. The default
optimizers leave them out too, so nothing updates them: not even weight decay.
"""

import fnmatch
from typing import Any

from torch import nn

from dmltrain.config import FinetuneConfig
from dmltrain.errors import UserError, first_line


def matches(name: str, patterns: Any) -> bool:
    """Whether ``name`` matches one of ``patterns``: shell-style (``conv*``, ``encoder.*``),
    a module's name matching everything under it too."""
    return any(
        fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns
    )


def freeze(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """The parameters matching ``patterns`` frozen; their names. A pattern that matches no
    parameter is an error: a misspelt one would silently train everything."""
    names = [name for name, _ in model.named_parameters()]
    _each_matches("--freeze", patterns, names, "parameter", matches)
    frozen = []
    for name, parameter in model.named_parameters():
        if matches(name, patterns):
            parameter.requires_grad_(False)
            frozen.append(name)
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise UserError(
            f"--freeze {' '.join(patterns)} freezes every parameter of the model: nothing "
            "would train; freeze fewer"
        )
    return frozen


def peft_module() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError("--lora-targets needs PEFT: pip install 'dmltrain[finetune]'") from None
    return peft


def lora_config(finetune: FinetuneConfig, modules: list[str]) -> Any:
    return peft_module().LoraConfig(
        target_modules=modules,
        r=finetune.lora_rank,
        lora_alpha=finetune.lora_alpha,
        lora_dropout=finetune.lora_dropout,
    )


def add_lora(model: nn.Module, finetune: FinetuneConfig) -> nn.Module:
    """LoRA adapters on the modules ``--lora-targets`` names, in place (PEFT's
    ``inject_adapter_in_model``: the model keeps its class and its names, a wrapped layer's
    weight becoming ``NAME.base_layer.weight``); every other parameter frozen."""
    targets = finetune.lora_targets
    named = [name for name, _ in model.named_modules() if name]
    _each_matches("--lora-targets", targets, named, "module", _exactly)
    chosen = [name for name in named if _exactly(name, targets)]
    peft = peft_module()
    try:
        model = peft.inject_adapter_in_model(lora_config(finetune, chosen), model)
    except (ValueError, TypeError) as exc:
        why = first_line(exc)
        raise UserError(f"--lora-targets: PEFT cannot adapt {', '.join(chosen)} ({why})") from None
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    return model


def param_groups(model: nn.Module, lr: float, scales: tuple[str, ...]) -> list[dict[str, Any]]:
    """The parameters that train, as optimizer groups: one at ``lr``, and one for each
    ``--lr-scale PATTERN=FACTOR`` at ``lr * FACTOR`` (a parameter in the first whose pattern
    it matches). Groups that would be empty are left out; names follow ``model``'s."""
    rules = [(p, float(f)) for p, _, f in (s.rpartition("=") for s in scales)]
    groups: list[dict[str, Any]] = [{"params": [], "lr": lr}]
    groups += [{"params": [], "lr": lr * factor} for _, factor in rules]
    names = [name for name, _ in model.named_parameters()]
    _each_matches("--lr-scale", [p for p, _ in rules], names, "parameter", matches)
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        place = next((i + 1 for i, (p, _) in enumerate(rules) if matches(name, [p])), 0)
        groups[place]["params"].append(parameter)
    return [group for group in groups if group["params"]]


def _exactly(name: str, patterns: Any) -> bool:
    """Whether a module's own name matches one of ``patterns`` (not a module above it)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _each_matches(flag: str, patterns: Any, names: list[str], kind: str, match: Any) -> None:
    """Refuse a pattern that matches none of ``names``: a misspelt one would silently
    leave the model as it was."""
    for pattern in patterns:
        if not any(match(name, [pattern]) for name in names):
            raise UserError(
                f"{flag} {pattern!r} matches no {kind} of the model; its {kind}s are named "
                f"like {', '.join(names[:4])}"
            )

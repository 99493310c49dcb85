"""``dmltrain from-credit model.yml [-o my.yml]``: a CREDIT (NCAR's miles-credit) config's
training settings as a dmltrain ``--config`` file.

CREDIT nests its settings (``trainer:``, ``data:``, ``model:``, ``loss:``, ``pbs:``);
dmltrain's config is a flat file of flags. The trainer settings that have a dmltrain flag
are written as that flag; ``data: forecast_len`` becomes the bundled ``forecast``
experiment's ``rollout``. Every other key is named in a comment at the top of the file, so
nothing is dropped unseen: the model, data and loss sections belong to your experiment.
"""

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError

Rule = Callable[[Any, dict[str, Any]], dict[str, Any]]


def _same(flag: str) -> Rule:
    return lambda value, _: {flag: value}


def _strategy(mode: Any, _: dict[str, Any]) -> dict[str, Any]:
    strategies = {"fsdp": "fsdp", "fsdp2": "fsdp", "ddp": "ddp", "none": None, None: None}
    key = None if mode is None else str(mode).lower()
    if key not in strategies:
        raise UserError(f"trainer: mode: {mode!r} is none of none, ddp, fsdp, fsdp2")
    return {"strategy": strategies[key]} if strategies[key] else {}


def _amp(on: Any, trainer: dict[str, Any]) -> dict[str, Any]:
    """CREDIT's ``amp: True`` is autocast to fp16 with a GradScaler under DDP, and a bf16
    policy under FSDP2."""
    if not on:
        return {}
    fsdp = str(trainer.get("mode", "")).lower().startswith("fsdp")
    return {"precision": "bf16" if fsdp else "fp16"}


def _ema(decay: Any, trainer: dict[str, Any]) -> dict[str, Any]:
    return {"ema_decay": float(decay)} if trainer.get("use_ema") else {}


def _clip(norm: Any, _: dict[str, Any]) -> dict[str, Any]:
    # 'dynamic' clips to the norm the gradients have: no clip at all
    return {"grad_clip": float(norm)} if isinstance(norm, int | float) and norm > 0 else {}


TRAINER: dict[str, Rule] = {
    "epochs": _same("epochs"),
    "num_epoch": _same("epochs_per_job"),
    "train_batch_size": _same("batch_size"),
    "learning_rate": _same("lr"),
    "weight_decay": _same("weight_decay"),
    "grad_accum_every": _same("grad_accum"),
    "grad_max_norm": _clip,
    "thread_workers": _same("num_workers"),
    "stopping_patience": _same("early_stop_patience"),
    "activation_checkpoint": _same("activation_checkpointing"),
    "cpu_offload": _same("cpu_offload"),
    "compile": _same("compile"),
    "mode": _strategy,
    "amp": _amp,
    "ema_decay": _ema,
    "use_ema": lambda *_: {},  # read with ema_decay
    "use_tensorboard": lambda on, _: {"tracker": "tensorboard"} if on else {},
}


def convert(credit: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The dmltrain settings of a CREDIT config, and the keys it leaves to the experiment."""
    if not isinstance(credit, dict) or not isinstance(credit.get("trainer"), dict):
        raise UserError("not a CREDIT config: it has no 'trainer:' section")
    trainer = credit["trainer"]
    if "mode" not in trainer and isinstance(credit.get("parallelism"), dict):
        trainer = {**trainer, "mode": credit["parallelism"].get("data")}
    settings: dict[str, Any] = {}
    left = [f"trainer: {key}" for key in trainer if key not in TRAINER]
    for key, value in trainer.items():
        if key in TRAINER:
            settings.update(TRAINER[key](value, trainer))
    if "seed" in credit:
        settings["seed"] = credit["seed"]
    data: dict[str, Any] = credit["data"] if isinstance(credit.get("data"), dict) else {}
    if "forecast_len" in data:  # 0: one step
        settings["rollout"] = f"0:{int(data['forecast_len']) + 1}"
    left += [f"data: {key}" for key in data if key != "forecast_len"]
    left += [f"{key}:" for key in credit if key not in ("trainer", "data", "seed", "parallelism")]
    return settings, left


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a CREDIT config (model.yml)")
    parser.add_argument("-o", "--output", help="file to write (default: print it)")


def run(args: argparse.Namespace) -> int:
    import yaml

    path = Path(args.config)
    try:
        credit = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path} cannot be read as YAML: {exc}") from None
    settings, left = convert(credit)
    lines = [f"# dmltrain settings from {path.name} (dmltrain from-credit)."]
    if left:
        lines.append("# Not converted; your experiment's to read: " + ", ".join(left))
    text = "\n".join(lines) + "\n" + yaml.safe_dump(settings, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(
            f"dmltrain: wrote {args.output}; train with: dmltrain EXPERIMENT --config {args.output}"
        )
    else:
        print(text, end="")
    return 0

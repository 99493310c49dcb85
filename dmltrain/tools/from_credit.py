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


def _number(key: str, value: Any, kind: type = float) -> Any:
    """``value`` as a number of ``kind``; a UserError naming ``key`` where it is not one."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = kind(value)
        if kind is int and number != float(value):
            raise ValueError
        return number
    except (TypeError, ValueError):
        raise UserError(
            f"{key}: {value!r} is not a number{' (a whole one)' if kind is int else ''}; "
            "correct it in the CREDIT config"
        ) from None


def _ema(decay: Any, trainer: dict[str, Any]) -> dict[str, Any]:
    return {"ema_decay": _number("trainer: ema_decay", decay)} if trainer.get("use_ema") else {}


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
        settings["rollout"] = f"0:{_number('data: forecast_len', data['forecast_len'], int) + 1}"
    left += [f"data: {key}" for key in data if key != "forecast_len"]
    left += [f"{key}:" for key in credit if key not in ("trainer", "data", "seed", "parallelism")]
    return settings, left


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a CREDIT config (model.yml)")
    parser.add_argument("-o", "--output", help="file to write (default: print it)")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")


def run(args: argparse.Namespace) -> int:
    import yaml

    path = Path(args.config)
    output = Path(args.output) if args.output else None
    if output is not None:
        _check_output(path, output, args.force)
    try:
        credit = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc).splitlines()[0]
        raise UserError(f"{path} cannot be read as YAML: {why}") from None
    settings, left = convert(credit)
    lines = [f"# dmltrain settings from {path.name} (dmltrain from-credit)."]
    if left:
        lines.append("# Not converted; your experiment's to read: " + ", ".join(left))
    text = "\n".join(lines) + "\n" + yaml.safe_dump(settings, sort_keys=False)
    if output is not None:
        try:
            output.write_text(text)
        except OSError as exc:
            raise UserError(f"-o {output}: cannot write it ({exc.strerror})") from None
        print(
            f"dmltrain: wrote {args.output}; train with: dmltrain EXPERIMENT --config {args.output}"
        )
    else:
        print(text, end="")
    return 0


def _check_output(config: Path, output: Path, force: bool) -> None:
    """Refuse an ``-o`` that would replace the CREDIT config itself, a folder, or (without
    ``force``) any file, or that lies in a folder that does not exist."""
    if output.exists() and config.exists() and output.resolve() == config.resolve():
        raise UserError(f"-o {output} is the CREDIT config itself; write to another file")
    if output.is_dir():
        raise UserError(f"-o {output} is a folder; name a file, e.g. {output / 'dmltrain.yml'}")
    if output.exists() and not force:
        raise UserError(f"-o {output} exists; add --force to replace it, or name another file")
    if not output.parent.is_dir():
        raise UserError(f"-o {output}: the folder {output.parent} does not exist; create it")

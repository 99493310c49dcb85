"""The config's file formats: a YAML or JSON file of option values read into the
sections' types (``--config``), ``config.yaml`` as a run writes it, and the plain values
checkpoints and records hold.
"""

import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dmltrain.config import SECTIONS, TrainConfig
from dmltrain.errors import ConfigError, first_line


def _hints(cls: type) -> dict[str, Any]:
    if cls is TrainConfig:
        return {k: v for _, _, c in SECTIONS for k, v in typing.get_type_hints(c).items()}
    return typing.get_type_hints(cls)


_YAML_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Convert a value read from a config file to a field's type, or explain why not."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        reasons = []
        for option in options:  # the first type the value fits
            try:
                return coerce(value, option, key, source)
            except ConfigError as exc:
                reasons.append(str(exc).split(" must ", 1)[1].rsplit(" (got", 1)[0])
        raise ConfigError(f"{source}: '{key}' must {' or '.join(reasons)} (got {value!r})")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{source}: '{key}' must be one of {list(choices)} (got {value!r})")
        return value
    if annotation is float and isinstance(value, str) and _YAML_FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as text
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(annotation, True)
    if not ok:
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{source}: '{key}' must be of type {name} (got {value!r})")
    return float(value) if annotation is float else value


def load_config_file(path: str, classes: list[type]) -> dict[str, Any]:
    """Read a flat YAML/JSON mapping and check every key against the given dataclasses.
    ``FILE:NAME`` reads the mapping under NAME of a file of named configs (YAML anchors and
    ``<<:`` merges, as many training scripts keep theirs)."""
    file, name = Path(path), None
    head, _, tail = path.rpartition(":")
    if not file.is_file() and head and Path(head).is_file():
        file, name = Path(head), tail
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} cannot be parsed: {first_line(exc, None)}") from None
    named = sorted(str(k) for k, v in data.items() if isinstance(v, dict)) if isinstance(
        data, dict) else []  # fmt: skip
    if name is not None:
        if name not in named:
            has = f"it has {', '.join(named)}" if named else "it holds no named configs"
            raise ConfigError(f"config file {file} has no config named {name!r} ({has})")
        data = data[name]
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values")
    hints = {}
    for cls in classes:
        hints.update(_hints(cls))
    values = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in hints or key == "config":
            if name is None and named and isinstance(value, dict):
                raise ConfigError(
                    f"config file {path} holds named configs ({', '.join(named)}): choose one "
                    f"with --config {path}:NAME"
                )
            known = ", ".join(sorted(hints))
            raise ConfigError(f"config file {path}: unknown key '{raw_key}' (known keys: {known})")
        values[key] = coerce(value, hints[key], str(raw_key), f"config file {path}")
    return values


# What names one run rather than how it trains: config.yaml shows it as a comment, so that
# a copy of the file reused with --config starts a run of its own instead of resuming this.
RUN_ONLY = ("run_dir",)


def to_yaml(config: TrainConfig, options: Any = None, options_title: str = "options") -> str:
    """The resolved config as flat YAML, one commented part per section (and the
    experiment's options); ``--config`` loads it back, all but ``RUN_ONLY``."""
    groups: list[tuple[str, Any]] = [(title, getattr(config, attr)) for attr, title, _ in SECTIONS]
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        groups.append((options_title, options))
    parts = []
    for title, instance in groups:
        values = dataclasses.asdict(instance)
        if not values:
            continue
        own = {key: values.pop(key) for key in RUN_ONLY if key in values}
        text = f"# {title}\n" + (yaml.safe_dump(values, sort_keys=False) if values else "")
        for key, value in own.items():
            text += f"# {key}: {value}  (this run's own: not loaded back by --config)\n"
        parts.append(text)
    return "\n".join(parts)


def as_plain(config: TrainConfig, options: Any) -> dict[str, Any]:
    """The resolved config as plain values: training settings (flat) and experiment options
    (what checkpoints, diagnostics and the tracker record)."""
    plain = {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        plain = dataclasses.asdict(options)
    train = {
        k: v
        for attr, _, _ in SECTIONS
        for k, v in dataclasses.asdict(getattr(config, attr)).items()
    }
    return {"train": train, "options": plain}

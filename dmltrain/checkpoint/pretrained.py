"""Pretrained weights for ``--load-weights``: read from the files users have, mapped onto
the model's names, and a report of what loaded.

Formats, told apart by their contents: a dmltrain checkpoint (one file, or a sharded
directory), a ``state_dict`` saved with ``torch.save``, a ``.safetensors`` file, a folder
of safetensors shards with its ``*.safetensors.index.json`` (Hugging Face's layout), and a
Lightning ``.ckpt``. Every ``.pt``-like file is read with ``weights_only=True``: no code in
a downloaded file runs.

The mapping (``FinetuneConfig``): ``load_map`` renames key prefixes, ``load_skip`` leaves
keys out by pattern, and ``load_partial`` skips keys whose shapes differ or that one side
lacks. Without ``load_partial`` any mismatch is one error naming the keys.
"""

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmltrain.checkpoint import objects, storage
from dmltrain.config import FinetuneConfig
from dmltrain.errors import UserError, first_line
from dmltrain.runtime.finetune import matches
from dmltrain.runtime.model_state import few

FORMATS = (
    "a dmltrain checkpoint, a state_dict saved with torch.save, a .safetensors file, a "
    "folder of safetensors shards with its index, or a Lightning .ckpt"
)
# Classes Lightning pickles into a .ckpt beside its tensors, read as what they subclass:
# weights_only refuses any class it does not know.
_STAND_INS = {
    "lightning.fabric.utilities.data.AttributeDict": dict,
    "lightning_fabric.utilities.data.AttributeDict": dict,
    "pytorch_lightning.utilities.parsing.AttributeDict": dict,
}


def read(location: str, scratch: Path, ema: bool = False) -> tuple[Mapping[str, Tensor], str]:
    """The tensors of the weights at ``location`` by name, and what kind of file held them;
    one UserError for anything else. ``ema``: a dmltrain checkpoint's averaged weights."""
    if objects.is_uri(location):
        return _dmltrain(objects.read(location, scratch), location, ema)
    path = Path(location)
    if not path.exists():
        raise UserError(f"--load-weights {location} does not exist")
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if indexes:
            return _safetensors_shards(indexes[0]), "safetensors shards"
        if (path / ".metadata").exists():  # torch.distributed.checkpoint's
            state = storage.read_whole(path, ema, model_only=True)
            return _dmltrain(state, location, ema)
        single = sorted(path.glob("*.safetensors"))
        if len(single) == 1:
            return _safetensors(single[0]), "safetensors"
        raise UserError(f"--load-weights {location} is a folder that holds none of: {FORMATS}")
    _refuse_ema(ema, location, path.suffix == ".safetensors")
    if path.suffix == ".safetensors":
        return _safetensors(path), "safetensors"
    state = _torch_load(path)
    if "model" in state and "format_version" in state:
        return _dmltrain(storage.checked(state, path), location, ema)
    _refuse_ema(ema, location, True)
    if "pytorch-lightning_version" in state and isinstance(state.get("state_dict"), dict):
        return _tensors(state["state_dict"], location), "Lightning checkpoint"
    if state and all(isinstance(v, Tensor) for v in state.values()):
        return _tensors(state, location), "state_dict"
    for key in ("state_dict", "model", "model_state_dict"):
        inner = state.get(key)
        if isinstance(inner, dict) and inner and all(isinstance(v, Tensor) for v in inner.values()):
            return _tensors(inner, location), f"state_dict (under {key!r})"
    raise UserError(f"--load-weights {location} holds none of: {FORMATS}")


def _refuse_ema(ema: bool, location: str, foreign: bool) -> None:
    if ema and foreign:
        raise UserError(
            f"--ema: {location} is not a dmltrain checkpoint, so it holds no averaged "
            "weights; drop --ema"
        )


def averaged(state: dict[str, Any], location: str) -> dict[str, Tensor]:
    """A dmltrain checkpoint's averaged weights (``--ema-decay``), for ``--ema``."""
    if "ema" not in state and not state.get("ema_sharded"):
        raise UserError(
            f"--ema: {location} holds no averaged weights (trained without "
            "--ema-decay); drop --ema to load its weights"
        )
    if state.get("sharded"):
        raise UserError(
            f"--ema: {location} is sharded; make one file of its averaged weights "
            "first: dmltrain consolidate --ema"
        )
    return state["ema"]


def _dmltrain(state: dict[str, Any], location: str, ema: bool) -> tuple[dict[str, Tensor], str]:
    if ema:
        return _tensors(averaged(state, location), location), "dmltrain checkpoint (averaged)"
    if state.get("sharded"):  # a remote sharded one: objects.read gives its trainer.pt
        raise UserError(
            f"--load-weights {location} is a sharded checkpoint in object storage; "
            "copy it to a file system first"
        )
    return _tensors(state["model"], location), "dmltrain checkpoint"


def _tensors(state: dict[str, Any], location: str) -> dict[str, Tensor]:
    odd = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if odd:
        raise UserError(
            f"--load-weights {location}: the weights hold values that are not tensors "
            f"({', '.join(map(str, odd[:3]))}); it holds none of: {FORMATS}"
        )
    return dict(state)


def _torch_load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:  # torch.save writes a zip archive
        if handle.read(4) != b"PK\x03\x04":
            raise UserError(f"--load-weights {path} holds none of: {FORMATS}")
    unsafe: list[str] = []
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        stand_ins: list[Any] = [(_STAND_INS[n], n) for n in unsafe if n in _STAND_INS]
        with torch.serialization.safe_globals(stand_ins):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        if "Weights only load failed" in str(exc):
            others = sorted(set(unsafe) - set(_STAND_INS))
            raise UserError(
                f"--load-weights {path} holds Python objects as well as tensors "
                f"({', '.join(others[:3])}), which dmltrain does not unpickle: save its "
                "state_dict() with torch.save or safetensors"
            ) from None
        why = first_line(exc)
        raise UserError(f"--load-weights {path} is truncated or corrupt ({why})") from None
    if not isinstance(state, dict):
        raise UserError(f"--load-weights {path} holds none of: {FORMATS}")
    return state


class Lazy(Mapping[str, Tensor]):
    """The tensors of safetensors files, each read when it is asked for: a rank loads
    the file one tensor at a time, never holding a second copy of the whole model."""

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Any] = {}  # a tensor's name -> its file, open
        self.shapes: dict[str, tuple[int, ...]] = {}
        safe_open = _safetensors_module().safe_open
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle has no __iter__)
                    self.where[name] = handle
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except Exception as exc:
                why = first_line(exc)
                raise UserError(
                    f"--load-weights {path} is not a readable safetensors file ({why})"
                ) from None

    def __getitem__(self, name: str) -> Tensor:
        return self.where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def shapes(weights: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of ``weights``, without reading a lazy one."""
    if isinstance(weights, Lazy):
        return dict(weights.shapes)
    return {name: tuple(tensor.shape) for name, tensor in weights.items()}


def _safetensors(path: Path) -> Lazy:
    return Lazy([path])


def _safetensors_shards(index: Path) -> Lazy:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        why = first_line(exc)
        raise UserError(f"--load-weights: {index} is not a safetensors index ({why})") from None
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        raise UserError(f"--load-weights: {index} names shards that are missing: {few(missing)}")
    weights = Lazy([index.parent / name for name in files])
    absent = sorted(set(weight_map) - set(weights))
    if absent:
        raise UserError(f"--load-weights: {index} names tensors its shards lack: {few(absent)}")
    return weights


def _safetensors_module() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise UserError(
            "safetensors files need the safetensors package: pip install 'dmltrain[finetune]'"
        ) from None
    return safetensors.torch


@dataclasses.dataclass
class Report:
    """What a load did with each key: loaded, left out by --load-skip, skipped for a shape
    that differs, missing from the file, or in the file but not the model."""

    source: str
    kind: str
    loaded: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    shapes: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        parts = [f"loaded {len(self.loaded)}"]
        for label, names in (
            ("skipped", self.skipped),
            ("shape differs", self.shapes),
            ("missing", self.missing),
            ("unexpected", self.unexpected),
        ):
            if names:
                parts.append(f"{label} {len(names)} ({few(names, 3)})")
        return f"weights from {self.source} ({self.kind}): {'; '.join(parts)}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fit(
    theirs: dict[str, tuple[int, ...]],
    own: dict[str, tuple[int, ...]],
    finetune: FinetuneConfig,
    report: Report,
) -> dict[str, str]:
    """Which tensor of the file (its name and shape in ``theirs``) goes to which of a model
    whose state has the shapes ``own``: the model's name -> the file's, renamed by
    ``load_map`` and chosen by ``load_skip`` and ``load_partial``; ``report`` filled in. A
    UserError naming what does not fit, without ``load_partial``."""
    renames = [tuple(r.split("=", 1)) for r in finetune.load_map]
    chosen: dict[str, str] = {}
    for name, shape in theirs.items():
        new = name
        for old, to in renames:
            if new.startswith(old):
                new = to + new[len(old) :]
        if matches(name, finetune.load_skip) or matches(new, finetune.load_skip):
            report.skipped.append(name)
        elif new not in own:
            report.unexpected.append(new)
        elif shape != own[new]:
            report.shapes.append(f"{new} {shape} in file vs {own[new]} in model")
        else:
            chosen[new] = name
    report.loaded = sorted(chosen)
    report.missing = sorted(set(own) - set(chosen) - {_shape_name(s) for s in report.shapes})
    misfits = report.shapes or report.missing or report.unexpected
    if misfits and not finetune.load_partial:
        problems = [
            f"{label} {few(names)}"
            for label, names in (
                ("missing keys", report.missing),
                ("unexpected keys", report.unexpected),
                ("shape mismatch:", report.shapes),
            )
            if names
        ]
        raise UserError(
            f"--load-weights {report.source} does not fit this model: {'; '.join(problems)}; "
            "rename keys with --load-map OLD=NEW, leave some out with --load-skip PATTERN, "
            "or skip what does not fit with --load-partial"
        )
    return chosen


def load(model: Any, weights: Mapping[str, Tensor], chosen: dict[str, str]) -> None:
    """The ``chosen`` tensors of ``weights`` copied into ``model``, one at a time."""
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for new, old in chosen.items():
            state[new].copy_(weights[old])


def _shape_name(line: str) -> str:
    return line.split(" ", 1)[0]


def save_safetensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    """``tensors`` as one safetensors file at ``path``, written whole or not at all (each
    a contiguous copy of its own: safetensors refuses views that share memory)."""
    copies = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    data = _safetensors_module().save(copies)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None


def load_safetensors(path: Path) -> dict[str, Tensor]:
    return dict(_safetensors(path))

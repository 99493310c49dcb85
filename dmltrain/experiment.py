"""The experiment API: ``register_experiment`` describes a trainer class, its options and
the subcommand that runs them; ``discover_experiments`` finds the installed ones
(entry-point group ``dmltrain.experiments``) and ``experiment_file`` the one a file
registers. The command (``dmltrain.cli``) turns them into flags and runs them.
"""

import dataclasses
import importlib
import sys
import traceback
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmltrain import plugins
from dmltrain.config import TrainConfig, field_names
from dmltrain.errors import UserError
from dmltrain.trainer import BaseTrainer

# dmltrain's own subcommands (dmltrain.cli.TOOLS): no experiment may take their names
COMMANDS = (
    "consolidate",
    "export",
    "plot",
    "mlflow-sync",
    "submit",
    "sweep",
    "doctor",
    "from-credit",
)


@dataclass(frozen=True)
class Experiment:
    """A trainer class, its options dataclass and the subcommand that runs them."""

    name: str
    trainer_cls: type[BaseTrainer]
    config_cls: type | None = None
    help: str = ""
    # the experiment's own defaults of built-in settings (TrainConfig's, by flat name)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def register_experiment(
    name: str,
    trainer_cls: type[BaseTrainer],
    config_cls: type | None = None,
    help: str = "",
    defaults: Mapping[str, Any] | None = None,
) -> Experiment:
    """Describe an experiment for the CLI.

    ``defaults`` sets the experiment's own defaults of built-in settings by name
    (``{"lr": 20.0, "batch_size": 20}``): ``--help`` and ``--print-config`` show them, and
    a ``--config`` file and flags override them.

    Expose the result through the ``dmltrain.experiments`` entry-point group
    (``mnist = dmltrain_experiments.mnist:EXPERIMENT``) or pass it to ``main(experiments=[...])``.
    """
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"experiment name {name!r} must be letters, digits, '-' or '_'")
    if name in COMMANDS:
        raise ValueError(f"experiment name {name!r} is a dmltrain command; choose another")
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, BaseTrainer)):
        raise TypeError(f"{trainer_cls!r} is not a BaseTrainer subclass")
    if config_cls is not None:
        if not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"{config_cls!r} is not a dataclass")
        reserved = set(field_names(TrainConfig)) | {"config", "print_config"}
        clash = set(field_names(config_cls)) & reserved
        if clash:
            raise ValueError(f"options of {name!r} reuse built-in names: {sorted(clash)}")
        _check_option_types(name, config_cls)
    return Experiment(name, trainer_cls, config_cls, help, _checked_defaults(name, defaults))


def _checked_defaults(name: str, defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """``defaults`` as given, once each is known to be a built-in setting that takes its
    value (the sections' own checks run on it)."""
    given = dict(defaults or {})
    unknown = sorted(set(given) - set(field_names(TrainConfig)))
    if unknown:
        raise ValueError(
            f"defaults of {name!r} name no built-in setting: {unknown} (they are TrainConfig's "
            "flat names, e.g. lr, batch_size, seed, grad_clip, epochs, optimizer)"
        )
    try:
        TrainConfig(**given)
    except (UserError, TypeError, ValueError) as exc:
        raise ValueError(f"defaults of {name!r}: {exc}") from None
    return given


_SCALARS = (int, float, str, bool)


def _check_option_types(name: str, config_cls: type) -> None:
    """Each option's type is one a flag can give (docs/experiments.md): int, float, str,
    bool, a Literal of one of those, X | None, or a list or tuple of int, float or str."""
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # a name the annotations use that cannot be resolved: argparse says
        return
    for option, kind in hints.items():
        if option not in field_names(config_cls):
            continue
        plain = [a for a in typing.get_args(kind) if a is not type(None)]
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = plain[0] if len(plain) == 1 else kind
        sequence = sequence_of(kind)
        fits = (
            kind in _SCALARS
            or typing.get_origin(kind) is typing.Literal
            or (
                sequence is not None
                and sequence[0] in (int, float, str)
                and len(set(a for a in typing.get_args(kind) if a is not Ellipsis)) <= 1
            )
        )
        if not fits:
            shown = getattr(kind, "__name__", None) if not typing.get_args(kind) else None
            raise TypeError(
                f"option {option!r} of experiment {name!r} has type {shown or kind}, which a "
                "flag cannot give: use int, float, str, bool, a Literal, X | None, or a list or "
                "tuple of int, float or str (parse other values from a str in the trainer)"
            )


def discover_experiments() -> dict[str, Experiment]:
    """Experiments advertised by installed packages; a broken one is reported and skipped."""
    found = {}
    for entry in plugins.installed(plugins.EXPERIMENTS).values():
        try:
            experiment = entry.load()
        except Exception as exc:
            print(
                f"dmltrain: warning: experiment '{entry.name}' failed to load: {exc}",
                file=sys.stderr,
            )
            continue
        if isinstance(experiment, Experiment):
            found[experiment.name] = experiment
        else:
            print(
                f"dmltrain: warning: entry point '{entry.name}' is not an Experiment",
                file=sys.stderr,
            )
    return found


def experiment_file(path: Path) -> Experiment:
    """``dmltrain FILE.py ...``: the one experiment that ``FILE.py`` registers
    (``register_experiment``). The file is imported as a module of its own name, with its
    directory on ``sys.path``, so ``--nprocs`` workers and every rank import it the same way."""
    if not path.is_file():
        raise UserError(
            f"{path}: no such file (dmltrain FILE.py runs the experiment FILE.py registers)"
        )
    sys.path.insert(0, str(path.resolve().parent))
    try:
        module = importlib.import_module(path.stem)
    except SyntaxError as exc:
        raise UserError(f"{path}, line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        frames = [
            f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path.resolve())
        ]
        where = f", line {frames[-1].lineno}" if frames else ""
        raise UserError(f"importing {path} failed{where}: {type(exc).__name__}: {exc}") from None
    if Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
        raise UserError(
            f"{path} has the name of a module Python already has ({path.stem}), which is "
            "imported instead: rename the file"
        )
    found = [value for value in vars(module).values() if isinstance(value, Experiment)]
    if len(found) != 1:
        raise UserError(
            f"{path} registers {len(found)} experiments; dmltrain FILE.py needs exactly one "
            "(EXPERIMENT = register_experiment(...) at the top level)"
        )
    return found[0]


def sequence_of(kind: Any) -> tuple[Any, type, int | None] | None:
    """(item type, list or tuple, fixed length or None) of a list or tuple option's type
    (``list[int]``, ``tuple[int, int]``, ``tuple[float, ...]``); None for any other."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin not in (list, tuple):
        return None
    fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis
    return (args[0] if args else str), origin, (len(args) if fixed else None)

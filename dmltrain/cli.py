"""The ``dmltrain`` command: one subcommand per experiment, plus tools (``consolidate``).

Experiments come from the ``dmltrain.experiments`` entry-point group (how the bundled
``experiments`` package and outside packages add theirs) and from the ``experiments``
argument of ``main`` (how a script adds its own). This is the one module that uses
argparse-dataclass: flags are generated from the config dataclasses, one argument group
per concern.

Precedence: dataclass defaults < ``--config FILE`` < flags on the command line.
Bad input exits with code 2 and one line on stderr.
"""

import argparse
import dataclasses
import gc
import importlib.metadata
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import argparse_dataclass

from dmltrain import processes
from dmltrain.config import CONCERNS, TrainConfig, field_names, load_config_file
from dmltrain.errors import UserError, run_reporting_errors
from dmltrain.trainer import BaseTrainer

ENTRY_POINT_GROUP = "dmltrain.experiments"


def _consolidate(args: argparse.Namespace) -> int:
    from dmltrain.checkpoint import consolidate

    source = Path(args.checkpoint)
    target = Path(args.output) if args.output else source.with_suffix(".pt")
    written = consolidate(source, target)
    print(f"dmltrain: wrote {written} (load with torch.load(..., weights_only=True))")
    return 0


def _add_consolidate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (ckpt-*.dcp)")
    parser.add_argument(
        "-o", "--output", help="file to write (default: the directory's name with .pt)"
    )


def _plot(args: argparse.Namespace) -> int:
    from dmltrain.plot import plot_run

    written = plot_run(Path(args.run_dir), Path(args.output) if args.output else None)
    print(f"dmltrain: wrote {written}")
    return 0


def _add_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holding training_log.csv)")
    parser.add_argument(
        "-o", "--output", help="PNG file to write (default: RUN_DIR/training_curves.png)"
    )


def _submit(args: argparse.Namespace) -> int:
    from dmltrain import submit

    return submit.submit(args, args.flags, args.check_flags)


def _add_submit(parser: argparse.ArgumentParser) -> None:
    from dmltrain import submit

    submit.add_arguments(parser)


# Subcommands that are not experiments: name -> (help, add arguments, run).
TOOLS: dict[
    str,
    tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]],
] = {
    "consolidate": (
        "turn a sharded (FSDP) checkpoint into one .pt file",
        _add_consolidate,
        _consolidate,
    ),
    "plot": ("draw a run's loss and metric curves into a PNG", _add_plot, _plot),
    "submit": (
        "write a Slurm or PBS batch script for an experiment and submit it",
        _add_submit,
        _submit,
    ),
    "doctor": (
        "check this environment (GPUs, backends, Horovod, wandb, a real all-reduce)",
        lambda parser: _doctor().add_arguments(parser),
        lambda args: _doctor().run(args),
    ),
}


def _doctor() -> Any:
    from dmltrain import doctor

    return doctor


@dataclass(frozen=True)
class Experiment:
    """A trainer class, its options dataclass and the subcommand that runs them."""

    name: str
    trainer_cls: type[BaseTrainer]
    config_cls: type | None = None
    help: str = ""


def register_experiment(
    name: str, trainer_cls: type[BaseTrainer], config_cls: type | None = None, help: str = ""
) -> Experiment:
    """Describe an experiment for the CLI.

    Expose the result through the ``dmltrain.experiments`` entry-point group
    (``mnist = experiments.mnist:EXPERIMENT``) or pass it to ``main(experiments=[...])``.
    """
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"experiment name {name!r} must be letters, digits, '-' or '_'")
    if name in TOOLS:
        raise ValueError(f"experiment name {name!r} is a dmltrain command; choose another")
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, BaseTrainer)):
        raise TypeError(f"{trainer_cls!r} is not a BaseTrainer subclass")
    if config_cls is not None:
        if not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"{config_cls!r} is not a dataclass")
        clash = set(field_names(config_cls)) & (set(field_names(TrainConfig)) | {"config"})
        if clash:
            raise ValueError(f"options of {name!r} reuse built-in names: {sorted(clash)}")
    return Experiment(name, trainer_cls, config_cls, help)


def discover_experiments() -> dict[str, Experiment]:
    """Experiments advertised by installed packages; a broken one is reported and skipped."""
    found = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
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


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _flag_view(cls: type) -> type:
    """``cls`` with ``X | None`` fields as ``Optional[X]``, the form argparse-dataclass reads."""
    specs = []
    for f in dataclasses.fields(cls):
        kind = f.type
        if isinstance(kind, types.UnionType):
            inner = next(a for a in typing.get_args(kind) if a is not type(None))
            kind = typing.Optional[inner]  # noqa: UP045 (the spelling argparse-dataclass reads)
        default = {} if f.default is dataclasses.MISSING else {"default": f.default}
        if f.default_factory is not dataclasses.MISSING:
            default = {"default_factory": f.default_factory}
        specs.append((f.name, kind, dataclasses.field(metadata=f.metadata, **default)))
    return dataclasses.make_dataclass(cls.__name__, specs)


def _add_flags(parser: argparse.ArgumentParser, title: str, cls: type) -> None:
    group = parser.add_argument_group(title)
    argparse_dataclass._add_dataclass_options(_flag_view(cls), group)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for action in group._group_actions:
        default = defaults.get(action.dest)
        if action.nargs != 0 and default is not None:  # flags of bools explain themselves
            action.help = f"{action.help} (default: {default})"


def _given(values: dict[str, Any], cls: type) -> dict[str, Any]:
    """The fields of ``cls`` set by a flag or the config file (the rest keep their defaults)."""
    return {
        name: values[name]
        for name in field_names(cls)
        if values.get(name, dataclasses.MISSING) is not dataclasses.MISSING
    }


def build_parser(experiments: dict[str, Experiment]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dmltrain", description="Train an experiment on a laptop, a cluster or the cloud."
    )
    commands = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for experiment in sorted(experiments.values(), key=lambda e: e.name):
        sub = commands.add_parser(
            experiment.name,
            help=experiment.help,
            description=experiment.help,
        )
        sub.add_argument(
            "--config", metavar="FILE", help="YAML or JSON file of option values; flags override it"
        )
        for title, cls in CONCERNS:
            _add_flags(sub, title, cls)
        if experiment.config_cls is not None:
            _add_flags(sub, f"{experiment.name} options", experiment.config_cls)
    for name, (text, add_arguments, _) in TOOLS.items():
        add_arguments(commands.add_parser(name, help=text, description=text))
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def parse(
    argv: Sequence[str], experiments: dict[str, Experiment]
) -> tuple[Experiment, TrainConfig, Any]:
    """Command line (and config file) to (experiment, TrainConfig, experiment options)."""
    parser = build_parser(experiments)
    namespace = parser.parse_args(argv)
    experiment = experiments[namespace.experiment]
    classes = [TrainConfig] + ([experiment.config_cls] if experiment.config_cls else [])
    if namespace.config:
        _subparser(parser, experiment.name).set_defaults(
            **load_config_file(namespace.config, classes)
        )
        namespace = parser.parse_args(argv)
    values = vars(namespace)
    config = TrainConfig(**_given(values, TrainConfig))
    options = None
    if experiment.config_cls is not None:
        options = experiment.config_cls(**_given(values, experiment.config_cls))
    return experiment, config, options


def main(argv: Sequence[str] | None = None, experiments: Sequence[Experiment] = ()) -> int:
    """Entry point of the ``dmltrain`` command; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    known = discover_experiments()
    known.update({experiment.name: experiment for experiment in experiments})
    if argv and argv[0] in TOOLS:
        if argv[0] == "submit":  # the flags it does not know are the experiment's
            namespace, flags = build_parser(known).parse_known_args(argv)
            namespace.flags = flags
            namespace.check_flags = lambda flags: parse(flags, known)
        else:
            namespace = build_parser(known).parse_args(argv)
        codes = []
        status = run_reporting_errors(lambda: codes.append(TOOLS[argv[0]][2](namespace)), 0, 1)
        return status or (codes[0] if codes else 0)
    try:
        experiment, config, options = parse(argv, known)
        trainer = experiment.trainer_cls(config, options)
    except UserError as exc:
        print(f"dmltrain: error: {exc}", file=sys.stderr)
        return 2
    trainer.name = experiment.name
    status = run_reporting_errors(trainer.fit, trainer.dist.rank, trainer.dist.world_size)
    if config.status_file and trainer.dist.rank == 0:
        Path(config.status_file).write_text(f"{status}\n")
    if processes.started_by_launcher(trainer.dist):
        processes.leave(status)  # the same exit as --nprocs workers, for the same reason
    return status


def entry() -> int:
    """The ``dmltrain`` command and ``python -m dmltrain``: ``main`` in a process of its own.

    What is imported by now (torch alone: some 170,000 objects the collector tracks) lives
    as long as the process, yet every full collection walks all of it: 0.12 s on a 2-core
    machine, paid by ``--help`` in the entry-point scan and again at exit. ``gc.freeze``
    leaves it out of every later pass (as vLLM does after loading a model); objects made
    from here on are collected as usual. Only here, in a process that is the command's
    alone: a script or notebook calling ``main`` keeps its collector untouched.
    """
    gc.freeze()
    return main()

"""The ``dmltrain`` command: one subcommand per experiment, plus tools (``consolidate``).

Experiments come from the ``dmltrain.experiments`` entry-point group (how the bundled
``dmltrain_experiments`` package, the checkout's ``experiments/``, and outside packages add
theirs) and from the ``experiments``
argument of ``main`` (how a script adds its own). This is the one module that uses
argparse-dataclass: flags are generated from the config dataclasses, one argument group
per concern.

Precedence: dataclass defaults < the experiment's ``defaults`` (``register_experiment``) <
``--config FILE`` < flags on the command line.
Bad input exits with code 2 and one line on stderr.
"""

import argparse
import dataclasses
import gc
import os
import signal
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import argparse_dataclass

from dmltrain.config import SECTIONS, TrainConfig, field_names
from dmltrain.config.files import load_config_file, to_yaml
from dmltrain.errors import (
    EXIT_PEER_LOST,
    EXIT_REQUEUE,
    UserError,
    forget_interrupt,
    run_reporting_errors,
)
from dmltrain.experiment import (
    COMMANDS,
    Experiment,
    discover_experiments,
    experiment_file,
    sequence_of,
)
from dmltrain.records.files import NotWritten, write_status
from dmltrain.runtime import preemption, processes
from dmltrain.trainer import BaseTrainer


def _consolidate(args: argparse.Namespace) -> int:
    from dmltrain.checkpoint.storage import consolidate

    source = Path(args.checkpoint)
    default = source.with_name(source.stem + "-ema.pt") if args.ema else source.with_suffix(".pt")
    target = Path(args.output) if args.output else default
    written = consolidate(source, target, ema=args.ema)
    print(f"dmltrain: wrote {written} (load with torch.load(..., weights_only=True))")
    return 0


def _add_consolidate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a sharded checkpoint directory (ckpt-*.dcp), or a .pt with --ema"
    )
    parser.add_argument(
        "-o", "--output", help="file to write (default: the directory's name with .pt)"
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="the averaged weights (--ema-decay) as the file's model (default output: NAME-ema.pt)",
    )


def _records_of(run_dir: str) -> Path:
    """A run directory's records: a local folder; of a run in object storage, its records
    taken down from the store into its local folder (``objects.mirror``)."""
    from dmltrain.checkpoint import objects

    if not objects.is_uri(run_dir):
        return Path(objects.local(run_dir))
    folder = objects.mirror(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    problem = objects.unreachable(run_dir) or objects.fetch_records(run_dir, folder, every=True)
    if problem is not None:
        raise UserError(problem)
    return folder


def _mlflow_sync(args: argparse.Namespace) -> int:
    from dmltrain.features.mlflow_tracker import sync

    sync(_records_of(args.run_dir), args.to, print)
    return 0


def _add_mlflow_sync(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory of --tracker mlflow (RUN_DIR/mlflow)")
    parser.add_argument(
        "--to",
        help="the tracking store: a server's URL, sqlite:///FILE or a directory (default: "
        "the one the run logged to)",
    )


def _plot(args: argparse.Namespace) -> int:
    from dmltrain.tools.plot import plot_run

    written = plot_run(_records_of(args.run_dir), Path(args.output) if args.output else None)
    print(f"dmltrain: wrote {', '.join(map(str, written))}")
    return 0


def _add_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", help="a run directory (holding training_log.csv), or a sweep's (all trials)"
    )
    parser.add_argument(
        "-o",
        "--output",
        help="PNG file to write (default: RUN_DIR/training_curves.png, a sweep's sweep_curves.png)",
    )


def _submit(args: argparse.Namespace) -> int:
    from dmltrain.tools import submit

    return submit.submit(args, args.flags, args.check_flags)


def _add_submit(parser: argparse.ArgumentParser) -> None:
    from dmltrain.tools import submit

    submit.add_arguments(parser)


def _sweep(args: argparse.Namespace) -> int:
    from dmltrain.tools import sweep_submit

    return sweep_submit.run(args, args.flags, args.check_flags, args.options_of)


def _add_sweep(parser: argparse.ArgumentParser) -> None:
    from dmltrain.tools import sweep_submit

    sweep_submit.add_arguments(parser)


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
    "export": (
        "write a run's final or best weights as one safetensors file (LoRA merged)",
        lambda parser: _export().add_arguments(parser),
        lambda args: _export().run(args),
    ),
    "plot": ("draw a run's loss and metric curves into a PNG", _add_plot, _plot),
    "mlflow-sync": (
        "send what a --tracker mlflow run logged offline to an MLflow tracking store",
        _add_mlflow_sync,
        _mlflow_sync,
    ),
    "submit": (
        "write a Slurm or PBS batch script for an experiment and submit it",
        _add_submit,
        _submit,
    ),
    "sweep": (
        "run the trials of a hyperparameter search as a Slurm job array or here (--local)",
        _add_sweep,
        _sweep,
    ),
    "doctor": (
        "check this environment (GPUs, backends, Horovod, wandb, a real all-reduce)",
        lambda parser: _doctor().add_arguments(parser),
        lambda args: _doctor().run(args),
    ),
    "from-credit": (
        "turn a CREDIT config's training settings (model.yml) into a dmltrain --config file",
        lambda parser: _from_credit().add_arguments(parser),
        lambda args: _from_credit().run(args),
    ),
}


def _export() -> Any:
    from dmltrain.tools import export

    return export


def _from_credit() -> Any:
    from dmltrain.tools import from_credit

    return from_credit


def _doctor() -> Any:
    from dmltrain.tools import doctor

    return doctor


assert tuple(TOOLS) == COMMANDS, "dmltrain.experiment.COMMANDS names every tool"


def _to_launch(
    given: str, known: dict[str, Experiment], installed: dict[str, Experiment]
) -> tuple[str, str]:
    """``dmltrain submit|sweep EXPERIMENT``: (its name, how a batch job or a trial names it
    on its command line). An installed experiment goes by its name; one from a file
    (``FILE.py``, or the script that called ``main``) by that file's absolute path, which
    ``dmltrain FILE.py`` runs on any node. A file's experiment joins ``known``."""
    if given.endswith(".py"):
        from_file = experiment_file(Path(given))
        known[from_file.name] = from_file
        return from_file.name, str(Path(given).resolve())
    experiment = known.get(given)
    if experiment is None or installed.get(given) is experiment:
        return given, given  # installed, or not an experiment: the subcommand says which
    holders = [sys.modules.get("__main__"), sys.modules.get(experiment.trainer_cls.__module__)]
    for module in holders:
        registered = (
            [v for v in vars(module).values() if isinstance(v, Experiment)] if module else []
        )
        path = getattr(module, "__file__", None)
        if experiment not in registered or not path:
            continue
        if len(registered) != 1:
            raise UserError(
                f"{path} registers {len(registered)} experiments; its jobs run 'dmltrain "
                f"{Path(path).name}', which needs exactly one: put {given!r} in a file of its own"
            )
        return given, str(Path(path).resolve())
    raise UserError(
        f"experiment {given!r} is neither installed (an entry point) nor registered in a "
        "file, so a job could not start it: put it in FILE.py and run dmltrain FILE.py"
    )


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Sequence(argparse.Action):
    """A list or tuple option's values, as words or separated by commas (``--size 16 32``,
    ``--size 16,32``); a tuple of fixed length takes that many."""

    def __init__(
        self, *names: Any, item: Any = str, sequence: type = list, length: Any = None, **kw: Any
    ) -> None:
        kw["nargs"] = "+"
        super().__init__(*names, **kw)
        self.item, self.sequence, self.length = item, sequence, length

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        words = [word for value in values for word in value.split(",") if word]
        try:
            items = [self.item(word) for word in words]
        except ValueError:
            parser.error(f"argument {option}: {' '.join(words)} are not {self.item.__name__}s")
        if self.length is not None and len(items) != self.length:
            parser.error(f"argument {option}: takes {self.length} values, got {len(items)}")
        setattr(namespace, self.dest, self.sequence(items))


class _Flags(argparse_dataclass.ArgumentParser):
    """The flags argparse-dataclass makes of a dataclass's fields, under one title in
    --help; a parent parser (``parents=``) of each experiment's subcommand.

    Three things it cannot express are done as it adds each flag: a ``bool`` becomes a
    ``--x/--no-x`` pair (it makes only one of them, named for the opposite of the default),
    ``X | None`` parses as ``X`` (it reads only ``Optional[X]``), and help ends with the
    default."""

    def __init__(self, cls: type, title: str, defaults: Mapping[str, Any] | None = None) -> None:
        self._field_defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        self._field_defaults.update(
            (k, v) for k, v in (defaults or {}).items() if k in self._field_defaults
        )
        self._section_title = title
        self._section_group: Any = None  # the titled group, made at the first flag
        super().__init__(cls, add_help=False)

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        if self._section_group is None:  # argparse-dataclass calls add_argument on the parser
            self._section_group = self.add_argument_group(self._section_title)
        dest = kwargs.get("dest") or names[0].lstrip("-").replace("-", "_")
        flag = "--" + dest.replace("_", "-")
        if kwargs.get("action") in ("store_true", "store_false") and names[0].endswith(flag[2:]):
            names, kwargs["dest"] = (flag,), dest
            kwargs.update(action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        if isinstance(kwargs.get("type"), types.UnionType):
            kwargs["type"] = next(a for a in typing.get_args(kwargs["type"]) if a is not type(None))
        sequence = sequence_of(kwargs.get("type"))
        if sequence is not None and "nargs" not in kwargs:
            item, kind, length = sequence
            kwargs.pop("type")
            kwargs.update(action=_Sequence, item=item, sequence=kind, length=length)
        default = self._field_defaults.get(dest)
        if default is not None and default is not dataclasses.MISSING:
            shown = str(default).lower() if isinstance(default, bool) else default
            kwargs["help"] = f"{kwargs.get('help') or ''} (default: {shown})".lstrip()
        return self._section_group.add_argument(*names, **kwargs)


def _experiment_flags(experiment: Experiment) -> list[Any]:  # argparse.ArgumentParser
    """The flags of an experiment's subcommand, as parent parsers: ``--config``, each
    section's, then the experiment's options."""
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument(
        "--config", metavar="FILE", help="YAML or JSON file of option values; flags override it"
    )
    config.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved options (as config.yaml holds them) and exit",
    )
    flags = [config] + [_Flags(cls, title, experiment.defaults) for _, title, cls in SECTIONS]
    if experiment.config_cls is not None:
        flags.append(_Flags(experiment.config_cls, f"{experiment.name} options"))
    return flags


def _given(values: dict[str, Any], cls: type) -> dict[str, Any]:
    """The fields of ``cls`` set by a flag or the config file (the rest keep their defaults);
    a file's list for a tuple option becomes a tuple."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    given = {
        name: values[name]
        for name in field_names(cls)
        if values.get(name, dataclasses.MISSING) is not dataclasses.MISSING
    }
    for name, value in given.items():
        if isinstance(value, list) and typing.get_origin(hints.get(name)) is tuple:
            given[name] = tuple(value)
    return given


def build_parser(experiments: dict[str, Experiment]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dmltrain", description="Train an experiment on a laptop, a cluster or the cloud."
    )
    commands = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for experiment in sorted(experiments.values(), key=lambda e: e.name):
        command = commands.add_parser(
            experiment.name,
            help=experiment.help,
            description=experiment.help,
            parents=_experiment_flags(experiment),
        )
        command.set_defaults(**experiment.defaults)
    for name, (text, add_arguments, _) in TOOLS.items():
        add_arguments(commands.add_parser(name, help=text, description=text))
    return parser


def parse(
    argv: Sequence[str], experiments: dict[str, Experiment]
) -> tuple[Experiment, TrainConfig, Any]:
    """Command line (and config file) to (experiment, TrainConfig, experiment options)."""
    parser = build_parser(experiments)
    namespace = parser.parse_args(argv)
    experiment = experiments[namespace.experiment]
    classes = [TrainConfig] + ([experiment.config_cls] if experiment.config_cls else [])
    if namespace.config:  # the file's values become the defaults; flags still override them
        parser = _Parser(prog=f"dmltrain {experiment.name}", parents=_experiment_flags(experiment))
        parser.set_defaults(**experiment.defaults)
        parser.set_defaults(**load_config_file(namespace.config, classes))
        namespace = parser.parse_args(argv[1:])
    values = vars(namespace)
    config = TrainConfig(**_given(values, TrainConfig))
    options = None
    if experiment.config_cls is not None:
        options = experiment.config_cls(**_given(values, experiment.config_cls))
    return experiment, config, options


def _option_names(experiments: dict[str, Experiment], name: str) -> set[str]:
    """Every setting ``dmltrain NAME`` takes (TrainConfig's and the experiment's options)."""
    if name not in experiments:
        raise UserError(
            f"unknown experiment {name!r}; choose from {', '.join(sorted(experiments))}"
        )
    cls = experiments[name].config_cls
    return set(field_names(TrainConfig)) | (set(field_names(cls)) if cls else set())


def _check_status_file(path: str | None) -> None:
    """At start, not at the end of a run (where a requeue would be lost): the file's folder
    must exist and be writable."""
    if not path:
        return
    folder = Path(path).parent
    if not folder.is_dir():
        raise UserError(f"--status-file {path}: the folder {folder} does not exist; create it")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--status-file {path}: the folder {folder} is not writable")


def _write_status(path: Path, status: int, trainer: BaseTrainer) -> bool:
    """Rank 0's exit status, and how many checkpoints this job saved (the batch scripts
    requeue a job that loses nodes only while it makes progress), or another rank's lost
    peer (``write_status``). Whether the file holds the job's status now."""
    try:
        write_status(path, status, trainer.checkpoints_saved, trainer.dist.rank == 0)
    except NotWritten as exc:
        print(
            f"dmltrain: error: --status-file: {exc}; the exit status is {status}", file=sys.stderr
        )
        return False
    return True


def _print_config_asked(argv: Sequence[str]) -> bool:
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--print-config", action="store_true")
    return bool(probe.parse_known_args(argv)[0].print_config)


def main(argv: Sequence[str] | None = None, experiments: Sequence[Experiment] = ()) -> int:
    """Entry point of the ``dmltrain`` command; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if experiments and (not argv or argv[0].startswith("-")):  # python FILE.py [flags]
        if len(experiments) > 1:
            names = ", ".join(experiment.name for experiment in experiments)
            print(
                f"dmltrain: error: this file registers {len(experiments)} experiments ({names}):"
                f" name one first, e.g. {experiments[0].name} {' '.join(argv)}".rstrip(),
                file=sys.stderr,
            )
            return 2
        argv = [experiments[0].name, *argv]
    if argv and argv[0].endswith(".py"):  # dmltrain FILE.py: the experiment it registers
        try:
            from_file = experiment_file(Path(argv[0]))
        except UserError as exc:
            print(f"dmltrain: error: {exc}", file=sys.stderr)
            return 2
        experiments = [*experiments, from_file]
        argv = [from_file.name, *argv[1:]]
    installed = discover_experiments()
    known = {**installed, **{experiment.name: experiment for experiment in experiments}}
    if argv and argv[0] in TOOLS:
        if argv[0] in ("submit", "sweep"):  # the flags it does not know are the experiment's
            namespace, flags = build_parser(known).parse_known_args(argv)
            try:
                namespace.experiment, namespace.launch_as = _to_launch(
                    namespace.experiment, known, installed
                )
            except UserError as exc:
                print(f"dmltrain: error: {exc}", file=sys.stderr)
                return 2
            namespace.flags = flags
            namespace.check_flags = lambda flags: parse(flags, known)
            namespace.options_of = lambda name: _option_names(known, name)
        else:
            namespace = build_parser(known).parse_args(argv)
        codes = []
        status = run_reporting_errors(lambda: codes.append(TOOLS[argv[0]][2](namespace)), 0, 1)
        return status or (codes[0] if codes else 0)
    try:
        experiment, config, options = parse(argv, known)
        if _print_config_asked(argv):
            print(to_yaml(config, options, f"{experiment.name} options"), end="")
            return 0
        _check_status_file(config.status_file)
        trainer = experiment.trainer_cls(config, options)
    except UserError as exc:
        print(f"dmltrain: error: {exc}", file=sys.stderr)
        return 2
    trainer.name = experiment.name
    dist = trainer.dist  # a --nprocs parent is no rank: its lines name none
    status = run_reporting_errors(
        trainer.fit, dist.rank, 1 if dist.starts_workers else dist.world_size
    )
    held = True  # whether the status file holds the job's status (rank 0 writes it)
    # A lost peer's status is this rank's to write only where rank 0 may be the one lost:
    # where rank 0's store still answered, rank 0 writes it (it may still be saving).
    lost = status == EXIT_PEER_LOST and not trainer.strategy.rank0_alive
    if config.status_file and (trainer.dist.rank == 0 or lost):
        held = _write_status(Path(config.status_file), status, trainer)
    if processes.started_by_launcher(trainer.dist):
        if status == EXIT_REQUEUE and config.status_file and held:
            # The batch script reads the job's status from the file; the launcher would
            # report a stop planned to go on as a task's failure ("srun: error: ...
            # Exited with exit code 3", torchrun's ChildFailedError, mpirun's abort).
            status = 0
        processes.leave(status)  # the same exit as --nprocs workers, for the same reason
    return status


def entry() -> int:
    """The ``dmltrain`` command and ``python -m dmltrain``: ``main`` in a process of its own.

    What is imported by now (torch above all) lives as long as the process, yet every full
    collection would walk all of it; ``gc.freeze`` leaves it out of later passes (as vLLM
    does after loading a model). Only here, in a process that is the command's alone: a
    script or notebook calling ``main`` keeps its collector untouched.
    """
    gc.freeze()
    try:
        status = main()
    except KeyboardInterrupt:  # before the run catches signals (it stops at a step then)
        forget_interrupt()
        print("dmltrain: interrupted", file=sys.stderr, flush=True)
        status = 130
    # The outcome is decided and said: a scheduler's signal now, while the interpreter
    # ends (which puts back the default handlers, that would end it by the signal), must
    # not turn a finished run into a failed job.
    for name in preemption.StartupSignals.NAMES:
        signal.signal(signal.Signals[name], signal.SIG_IGN)
    return status

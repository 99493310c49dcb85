"""Write docs/reference.md from the code: every flag (the config dataclasses: name, type,
default, help, section), every subcommand and its flags, the exit statuses, the
environment variables of the batch scripts and the run directory's files.

    python docs/make_reference.py            # write it
    python docs/make_reference.py --check    # exit 1 when the committed page differs
"""

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from dmltrain import cli  # noqa: E402
from dmltrain.config import SECTIONS  # noqa: E402
from dmltrain.errors import EXIT_STATUSES  # noqa: E402
from dmltrain.records.rundir import FILES  # noqa: E402

PAGE = HERE / "reference.md"

# The variables the batch scripts (slurm/, environment/) read; tests/test_docs.py holds
# this list equal to the names the scripts use.
ENVIRONMENT = {
    "DMLTRAIN_ENV": ("every batch script, create_env.sh", "the environment to train in: a venv "
                     "directory or a conda env name (dmltrain submit writes the one it ran in)"),
    "DMLTRAIN_ARGS": ("the PBS scripts", "the experiment and its flags, split on spaces: qsub "
                      "passes no arguments to a script"),
    "DMLTRAIN_RUN_DIR": ("the PBS scripts", "the run directory a resubmitted job goes on with"),
    "DMLTRAIN_SCRIPT": ("every batch script", "the file to submit again (sbatch and qsub run a "
                        "copy of it); dmltrain submit sets it"),
    "DMLTRAIN_REQUEUE": ("the Slurm scripts", "0: do not requeue after a checkpoint (chain.sh "
                         "sets it: the next job of the chain goes on)"),
    "DMLTRAIN_MAX_LOST_REQUEUES": ("the Slurm scripts", "how many times in a row a job that "
                                   "lost a node is requeued with no checkpoint saved (3)"),
    "DMLTRAIN_RESUBMIT": ("the PBS scripts", "0: after a checkpoint, print how to go on "
                          "instead of submitting the next job"),
    "DMLTRAIN_NPROC_PER_NODE": ("torchrun.sh, casper.sh", "training processes per node "
                                "(default: the node's GPUs)"),
    "DMLTRAIN_RDZV_PORT": ("torchrun.sh", "the rendezvous port (29400)"),
    "DMLTRAIN_SRUN_WAIT": ("run.sh", "seconds srun waits for the other tasks once one has "
                           "ended (330; keep it above --dist-timeout + 20)"),
    "DMLTRAIN_LOST_GRACE": ("run.sh, torchrun.sh, horovod.sh", "seconds the step is given "
                            "to end once a survivor of a lost rank wrote status 5 (10); then "
                            "it is ended and the job requeued"),
    "DMLTRAIN_SRUN_MPI": ("horovod.sh", "srun's --mpi plugin (pmix; see srun --mpi=list)"),
    "DMLTRAIN_SBATCH": ("chain.sh", "sbatch options for every job of the chain, split on "
                        "spaces"),
    "DMLTRAIN_TORCH": ("create_env.sh", "the torch requirement to install (torch==2.13.0)"),
    "DMLTRAIN_WHEEL_CACHE": ("create_env.sh", "where built Horovod wheels are kept "
                             "(~/.cache/dmltrain/wheels)"),
}  # fmt: skip


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type(field: dataclasses.Field, hints: dict[str, typing.Any]) -> str:
    hint = hints[field.name]
    if typing.get_origin(hint) is typing.Literal:
        return " / ".join(str(a) for a in typing.get_args(hint))
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if args else hint
    return getattr(hint, "__name__", str(hint))


def option_rows(cls: type) -> list[str]:
    """A row for each field of an options dataclass: flag, type, default, help."""
    hints = typing.get_type_hints(cls, include_extras=False)
    lines = []
    for field in dataclasses.fields(cls):
        name = "--" + field.name.replace("_", "-")
        kind = _type(field, hints)
        if kind == "bool":
            name += f", --no-{field.name.replace('_', '-')}"
        default = field.default if field.default is not dataclasses.MISSING else ""
        shown = str(default).lower() if isinstance(default, bool) else default
        shown = "" if shown is None else shown
        help_text = field.metadata.get("help", "").replace("%%", "%")
        lines.append(f"| `{name}` | {kind} | {_cell(shown)} | {_cell(help_text)} |")
    return lines


def bundled() -> list[str]:
    """The options of each experiment that comes with dmltrain (dmltrain_experiments)."""
    lines = [
        "## The bundled experiments' options",
        "",
        "Besides the flags above, each bundled experiment takes its own.",
        "",
    ]
    found = cli.discover_experiments()
    for name in ("mnist", "mnist-gan", "forecast"):
        experiment = found[name]
        said = experiment.help[0].upper() + experiment.help[1:] + "."
        lines += [f"### dmltrain {name}", "", said, "", "| flag | type | default | what it does |",
                  "|---|---|---|---|", *option_rows(experiment.config_cls), ""]  # fmt: skip
    return lines


def flags() -> list[str]:
    lines = [
        "## Flags",
        "",
        "Every experiment takes these (`dmltrain EXPERIMENT --help` lists them with the "
        "experiment's own options), as flags or as the keys of a `--config` file (the names "
        "with `_`). A yes/no option is a pair: `--x` and `--no-x`.",
        "",
        "| flag | type | default | what it does |",
        "|---|---|---|---|",
        "| `--config FILE` | path | | a YAML or JSON file of option values; flags override it |",
        "| `--print-config` | | | print the resolved options and exit |",
    ]
    for _, title, cls in SECTIONS:
        lines.append(f"| **{title}** | | | |")
        lines += option_rows(cls)
    return lines


def subcommands() -> list[str]:
    lines = ["## Subcommands", ""]
    lines += ["Besides the experiments (`dmltrain mnist`, `dmltrain FILE.py`):", ""]
    parser = cli.build_parser({})
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, (text, _, _) in cli.TOOLS.items():
        lines += [f"### dmltrain {name}", "", text[0].upper() + text[1:] + ".", ""]
        rows = []
        for action in commands.choices[name]._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            what = (action.option_strings and ", ".join(action.option_strings)) or action.dest
            rows.append(f"| `{what}` | {_cell(action.help or '')} |")
        if rows:
            lines += ["| argument | what it does |", "|---|---|", *rows, ""]
    return lines


def exit_statuses() -> list[str]:
    lines = ["## Exit statuses", "", "| status | meaning | the batch scripts |", "|---|---|---|"]
    lines += [f"| {code} | {_cell(what)} | {_cell(does)} |" for code, (what, does) in
              EXIT_STATUSES.items()]  # fmt: skip
    return lines


def environment() -> list[str]:
    lines = [
        "## Environment variables",
        "",
        "The batch scripts' settings (dmltrain itself reads the launchers' variables: "
        "`RANK`, `SLURM_*`, `OMPI_COMM_WORLD_*`, `PMI_*`, `HOROVOD_*`, `MASTER_ADDR`, "
        "`MASTER_PORT`; and `OMP_NUM_THREADS`, `CUDA_VISIBLE_DEVICES`, `GLOO_SOCKET_IFNAME`, "
        "`WANDB_*`, `MLFLOW_*`).",
        "",
        "| variable | read by | what it does |",
        "|---|---|---|",
    ]
    lines += [f"| `{name}` | {who} | {_cell(what)} |" for name, (who, what) in ENVIRONMENT.items()]
    return lines


def run_directory() -> list[str]:
    lines = ["## The run directory", "", "| entry | what it holds |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(what)} |" for name, what in FILES.items()]
    return lines


def page() -> str:
    parts = [
        "# Reference",
        "",
        "Written by `python docs/make_reference.py` from the code; a test holds it equal.",
        "",
        *flags(),
        "",
        *bundled(),
        *subcommands(),
        *exit_statuses(),
        "",
        *environment(),
        "",
        *run_directory(),
    ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python docs/make_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

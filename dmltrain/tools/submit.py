"""``dmltrain submit {slurm,pbs} EXPERIMENT [flags]``: write a batch script, then submit it.

The script is a copy of one of the repository's batch scripts (``slurm/*.sh``,
``slurm/pbs/*.sh``) with the resources asked for written into its ``#SBATCH``/``#PBS``
lines and the training command filled in. It goes into the run directory, so the run
directory holds what started it and ``sbatch``/``qsub`` of the same file starts it again
(it resumes the run's latest checkpoint). ``--dry-run`` writes and prints it only.

``--chain N`` submits it N times, each job starting when the one before ended well
(Slurm ``--dependency=afterok``, PBS ``-W depend=afterok``). A job that stops for its time
limit saves a checkpoint and ends well, so the chain goes on; a job that fails ends it.
"""

import argparse
import datetime
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dmltrain.config import time_limit_seconds
from dmltrain.errors import UserError

SCRIPTS = {
    "slurm": {"run": "run.sh", "torchrun": "torchrun.sh", "horovod": "horovod.sh"},
    "pbs": {"derecho": "pbs/derecho.sh", "casper": "pbs/casper.sh"},
}
# PBS's default CPUs a training process: the process and its DataLoader workers (Slurm's
# scripts leave it to Slurm's default, 1, which every node can give).
CPUS_PER_TASK = 4
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("system", choices=sorted(SCRIPTS), help="the batch system")
    parser.add_argument("experiment", help="the experiment to run; its flags follow it")
    add_resources(parser.add_argument_group("resources (the other flags go to the experiment)"))
    parser.add_argument(
        "--chain",
        type=int,
        default=1,
        metavar="N",
        help="submit N jobs, each starting when the one before ended well, all in one run "
        "(for runs longer than a job may last; default 1)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="write and print the script; do not submit"
    )


def add_resources(resources: Any) -> None:
    """The flags of a job's resources (an argparse parser or group)."""
    resources.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    resources.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node; one process each"
    )
    resources.add_argument(
        "--tasks-per-node",
        type=int,
        default=0,
        help="training processes per node (default: --gpus-per-node, or 1)",
    )
    resources.add_argument(
        "--cpus-per-task",
        type=int,
        help="CPU cores per training process, for it and its loader workers (default: "
        f"Slurm's, 1; {CPUS_PER_TASK} on PBS)",
    )
    resources.add_argument(
        "--whole-node",
        action="store_true",
        help="the nodes to this job alone (Slurm --exclusive; PBS place=excl, with the "
        "cores the PBS script's header gives a node unless --cpus-per-task)",
    )
    resources.add_argument("--time", default="01:00:00", help="time limit, [D-]HH:MM:SS")
    resources.add_argument("--partition", "--queue", dest="queue", help="partition or queue")
    resources.add_argument("--account", help="account or project to charge")
    resources.add_argument("--job-name", help="job name (default: dmltrain-EXPERIMENT)")
    resources.add_argument(
        "--script",
        help="which script: run (srun, default), torchrun or horovod for slurm; "
        "derecho (mpiexec, default) or casper (torchrun) for pbs",
    )
    resources.add_argument(
        "--env", help="conda env or venv to activate in the job (default: this one, if any)"
    )


def scripts_dir() -> Path:
    """``slurm/`` of this checkout, else the copy installed under ``<prefix>/share``."""
    for candidate in (
        Path(__file__).resolve().parents[2] / "slurm",  # dmltrain/tools/submit.py
        Path(sys.prefix) / "share" / "dmltrain" / "slurm",
    ):
        if (candidate / "run.sh").is_file():
            return candidate
    raise UserError("the batch script templates are missing: reinstall dmltrain")


def current_env() -> str | None:
    """This Python's venv or conda env, for the job to activate; None for a system Python."""
    prefix = Path(sys.prefix)
    if sys.prefix != sys.base_prefix or (prefix / "conda-meta").is_dir():
        return str(prefix)
    return None


def is_env(path: Path) -> bool:
    """Whether ``path`` is a venv or a conda env that the batch scripts can activate."""
    return (path / "bin" / "activate").is_file() or (path / "conda-meta").is_dir()


def set_directives(text: str, lines_by_key: dict[str, str]) -> str:
    """Replace the directive line that starts with each key (``#SBATCH --nodes=``,
    ``#PBS -l walltime=``) by its new line; add the ones not there after the last."""
    lines = text.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith(("#SBATCH ", "#PBS ")))
    for key, line in lines_by_key.items():
        found = [i for i, old in enumerate(lines) if old.startswith(key)]
        if found:
            lines[found[0]] = line
        else:
            last += 1
            lines.insert(last, line)
    return "\n".join(lines) + "\n"


def _directives(prefix: str, values: dict[str, str], sep: str) -> dict[str, str]:
    return {f"{prefix} {key}{sep}": f"{prefix} {key}{sep}{value}" for key, value in values.items()}


def _slurm_directives(
    args: argparse.Namespace, script: str, run_dir: Path, template: str
) -> dict[str, str]:
    tasks = args.tasks_per_node or args.gpus_per_node or 1
    values = {
        "--job-name": args.job_name or f"dmltrain-{args.experiment}",
        "--nodes": str(args.nodes),
        "--ntasks-per-node": "1" if script == "torchrun" else str(tasks),
        "--time": args.time,
        "--output": str(run_dir / "slurm-%j.out"),
    }
    if args.cpus_per_task:
        per_task = args.cpus_per_task * (tasks if script == "torchrun" else 1)
        values["--cpus-per-task"] = str(per_task)
    if args.gpus_per_node:
        values["--gpus-per-node"] = str(args.gpus_per_node)
    if args.queue:
        values["--partition"] = args.queue
    if args.account:
        values["--account"] = args.account
    exclusive = {"#SBATCH --exclusive": "#SBATCH --exclusive"} if args.whole_node else {}
    return _directives("#SBATCH", values, "=") | exclusive


def _pbs_directives(
    args: argparse.Namespace, script: str, run_dir: Path, template: str
) -> dict[str, str]:
    if script == "casper" and args.nodes != 1:
        raise UserError("--script casper runs on one node; use --script derecho for --nodes > 1")
    tasks = args.tasks_per_node or args.gpus_per_node or 1
    ncpus = (args.cpus_per_task or CPUS_PER_TASK) * tasks
    whole = re.search(r"^#PBS -l select=\d+:ncpus=(\d+)", template, re.M)
    if args.whole_node and not args.cpus_per_task and whole:
        ncpus = int(whole.group(1))  # the node the script was written for
    select = f"{args.nodes}:ncpus={ncpus}"
    if args.gpus_per_node:
        select += f":ngpus={args.gpus_per_node}"
    select += f":mpiprocs={tasks}"
    seconds = time_limit_seconds(args.time)
    walltime = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    values = {
        "-N": (args.job_name or f"dmltrain-{args.experiment}")[:15],  # PBS: 15 characters
        "-o": str(run_dir / "pbs.out"),
    }
    if args.queue:
        values["-q"] = args.queue
    if args.account:
        values["-A"] = args.account
    resources = {"-l select": select, "-l walltime": walltime}
    if args.whole_node:
        resources["-l place"] = "scatter:excl"
    return _directives("#PBS", values, " ") | _directives("#PBS", resources, "=")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_printable(args: argparse.Namespace, flags: Sequence[str]) -> None:
    """Refuse a newline or other control character in any value bound for the script: in a
    ``#SBATCH``/``#PBS`` line it would start a line of shell code."""
    named = {f"--{key.replace('_', '-')}": value for key, value in vars(args).items()}
    named["--partition"] = named.pop("--queue", None)
    values = [(name, value) for name, value in named.items() if isinstance(value, str)]
    for name, value in [*values, *(("a flag", flag) for flag in flags)]:
        if _CONTROL.search(value):
            raise UserError(
                f"{name} {value!r} holds a newline or another control character; give it "
                "on one line of printable characters"
            )


def render(args: argparse.Namespace, flags: Sequence[str], run_dir: Path, target: Path) -> str:
    """The batch script for ``args`` with the training command ``flags`` filled in."""
    check_printable(args, flags)
    choices = SCRIPTS[args.system]
    script = args.script or next(iter(choices))
    if script not in choices:
        raise UserError(
            f"--script {script} is not a {args.system} script; choose from {', '.join(choices)}"
        )
    if not _TIME.match(args.time):
        raise UserError(f"--time {args.time!r}: write [D-]HH:MM:SS, e.g. 02:00:00 or 1-00:00:00")
    for name in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task"):
        value = getattr(args, name)
        if value is not None and value < (0 if name in ("gpus_per_node", "tasks_per_node") else 1):
            raise UserError(f"--{name.replace('_', '-')} must not be {value}")
    text = (scripts_dir() / choices[script]).read_text()
    directives = _slurm_directives if args.system == "slurm" else _pbs_directives
    text = set_directives(text, directives(args, script, run_dir, text))
    command = [args.launch_as, *flags, "--run-dir", str(run_dir)]
    env = args.env if args.env is not None else current_env()
    named = args.env and "/" not in args.env and re.fullmatch(r"[A-Za-z0-9_.+-]+", args.env)
    if args.env and not named and not is_env(Path(args.env)):
        raise UserError(
            f"--env {args.env}: no environment there (no bin/activate, no conda-meta) and no "
            "conda env's name; give a venv's directory, a conda env's directory or a conda "
            "env's name"
        )
    filled = [
        f"# Written by dmltrain submit on {datetime.datetime.now():%Y-%m-%d %H:%M}; submit this "
        "file again to go on with the run.",
        f"[ $# -gt 0 ] || set -- {shlex.join(command)}",
        f"export DMLTRAIN_SCRIPT={shlex.quote(str(target))}",
    ]
    if env:
        filled.append(f"export DMLTRAIN_ENV={shlex.quote(env)}")
    tasks = args.tasks_per_node or args.gpus_per_node or 1
    if script in ("torchrun", "casper"):
        filled.append(f"export DMLTRAIN_NPROC_PER_NODE={tasks}")
    lines = text.splitlines()
    at = lines.index("set -uo pipefail")
    return "\n".join(lines[:at] + filled + lines[at:]) + "\n"


# What sbatch --test-only says of a job that no node of the partition can ever run.
_NEVER = ("node configuration is not available", "partitionconfig", "more processors than")


def check_fits(script: Path, partition: str | None, sure: bool = False) -> None:
    """Whether Slurm could ever start the job (``sbatch --test-only``): one that asks more
    CPUs, GPUs or nodes than the partition has would wait forever as ``PartitionConfig``.
    Unless ``sure``, only Slurm's word that it never could refuses it (a login node whose
    controller does not answer lets a --dry-run write its script)."""
    test = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
    )
    said = (test.stderr + test.stdout).lower()
    if test.returncode == 0 or not (sure or any(never in said for never in _NEVER)):
        return
    why = test.stderr.strip().splitlines()[-1:] or [test.stdout.strip()]
    where = ["-p", partition] if partition else []
    nodes = subprocess.run(
        ["sinfo", "-h", *where, "-o", "%P %D node(s) of %c CPUs, GPUs %G"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = nodes.stdout.replace("GPUs (null)", "no GPUs").splitlines()[:3]
    have = "; ".join(lines) or "sinfo says nothing"
    raise UserError(
        f"Slurm could never start this job ({why[0]}): it asks more than the partition "
        f"has ({have}); lower --tasks-per-node, --cpus-per-task or --gpus-per-node, or "
        f"choose another --queue (the script is {script}, not submitted)"
    )


def submit(
    args: argparse.Namespace, flags: Sequence[str], check_flags: Callable[[list[str]], object]
) -> int:
    """Write the script into the run directory; submit it unless ``--dry-run``."""
    check_flags([args.experiment, *flags])  # bad flags fail here, not in the queue
    if args.chain < 1:
        raise UserError(f"--chain {args.chain}: give the number of jobs, 1 or more")
    given = [f for f in flags if f == "--run-dir" or f.startswith("--run-dir=")]
    if given:
        raise UserError("dmltrain submit chooses the run directory; leave out --run-dir")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (Path("runs") / f"{args.experiment}-{stamp}").resolve()
    target = run_dir / f"submit-{args.system}.sh"
    text = render(args, flags, run_dir, target)
    tool = "sbatch" if args.system == "slurm" else "qsub"
    if not args.dry_run and shutil.which(tool) is None:
        raise UserError(
            f"{tool} not found: run this on a {args.system} login node, or add --dry-run"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(target.stat().st_mode | stat.S_IXUSR)  # the umask decides the rest
    if args.system == "slurm" and shutil.which("sbatch") is not None:
        check_fits(target, args.queue, sure=not args.dry_run)  # a --dry-run's too
    if args.dry_run:
        print(text, end="")
        print(f"dmltrain: wrote {target}; submit it with: {tool} {target}")
        return 0
    jobs: list[str] = []
    for _ in range(args.chain):
        jobs.append(_submit_one(args.system, target, jobs[-1] if jobs else None, args.chain > 1))
    what = (
        f"job {jobs[0]}" if len(jobs) == 1 else f"a chain of {len(jobs)} jobs ({', '.join(jobs)})"
    )
    print(f"dmltrain: submitted {what}: {target}; run directory {run_dir}")
    return 0


def _submit_one(system: str, target: Path, after: str | None, chain: bool) -> str:
    """Submit ``target``; after job ``after`` ended well if given. In a chain the job does
    not requeue or resubmit itself: the next job of the chain goes on."""
    if system == "slurm":
        command = ["sbatch", "--parsable"]
        if chain:
            command += ["--export=ALL,DMLTRAIN_REQUEUE=0", "--kill-on-invalid-dep=yes"]
        if after:
            command.append(f"--dependency=afterok:{after}")
    else:
        command = ["qsub"] + (["-v", "DMLTRAIN_RESUBMIT=0"] if chain else [])
        if after:
            command += ["-W", f"depend=afterok:{after}"]
    done = subprocess.run([*command, str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"{command[0]} refused the job: {done.stderr.strip() or done.stdout}")
    return done.stdout.strip().split(";")[0]

"""The ``dmltrain sweep`` command: expand and check the trials (``dmltrain.tools.sweep``), then
submit them as a Slurm job array or run them on this machine (``--local``);
``dmltrain sweep status DIR`` tells where each trial stands.

An array task runs ``slurm/run.sh`` with the trial's command line read from
``trial-<task>/args``: the batch script's preemption handling (requeue this task, resume
its checkpoint) applies to each trial as to any run.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dmltrain.checkpoint.storage import list_checkpoints
from dmltrain.errors import EXIT_PEER_LOST, EXIT_REQUEUE, UserError
from dmltrain.features.search import PRUNERS
from dmltrain.records import rundir
from dmltrain.records.files import (
    not_through_a_link,
    read_status_record,
    status_record,
    write_atomic,
)
from dmltrain.runtime.launch import child_env, cpu_set, physical_cores, split_gpus
from dmltrain.tools import search, submit
from dmltrain.tools.sweep import Sweep, best, check_trials, expand, given, load_space


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "experiment",
        help="the experiment (its flags follow, the same for every trial), or "
        "'status DIR [--best-metric M] [--best-mode min|max]' for a sweep's table",
    )
    sweep = parser.add_argument_group("the sweep (the other flags go to every trial)")
    sweep.add_argument("--space", help="the options to vary (YAML): lists, {values}, {low, high}")
    sweep.add_argument(
        "--trials",
        type=int,
        default=1,
        help="draws of the random options ({values}, {low, high}) per grid point (default 1); "
        "with --search, the number of trials",
    )
    sweep.add_argument("--space-seed", type=int, default=0, help="seed of those draws")
    sweep.add_argument(
        "--search",
        choices=search.SAMPLERS,
        help="ask an Optuna study for each trial's options (pip install 'dmltrain[search]')",
    )
    sweep.add_argument(
        "--pruner",
        choices=PRUNERS,
        help="with --search: what stops a trial early at a validation (default median)",
    )
    sweep.add_argument(
        "--storage",
        help="with --search: the study's storage, a database URL or journal file (default: "
        "the sweep's study.journal)",
    )
    sweep.add_argument(
        "--retry-failed",
        type=int,
        default=0,
        help="with --search: times a failed trial is run again (default 0)",
    )
    sweep.add_argument(
        "--name", help="the sweep's directory runs/NAME (default: EXPERIMENT-sweep-TIME)"
    )
    sweep.add_argument("--local", action="store_true", help="run the trials on this machine")
    sweep.add_argument(
        "--system",
        choices=["slurm", "pbs"],
        default="slurm",
        help="submit a Slurm job array (default) or a PBS array job (qsub -J)",
    )
    sweep.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="with --local: trials at once (their CPU threads split; default 1)",
    )
    sweep.add_argument(
        "--max-parallel",
        type=int,
        default=0,
        help="array tasks running at once (sbatch --array=...%%K; default: no limit)",
    )
    sweep.add_argument(
        "--trials-per-task",
        type=int,
        default=1,
        help="trials side by side in one array task (one process each; the task's GPUs, "
        "else its CPU threads, split among them; default 1)",
    )
    sweep.add_argument(
        "--in-turn",
        action="store_true",
        help="with --trials-per-task: the task's trials one after another, each with all of "
        "its GPUs and threads (a search's later trials learn from its earlier ones)",
    )
    sweep.add_argument("--dry-run", action="store_true", help="write the script; do not submit")
    submit.add_resources(parser.add_argument_group("each array task's resources"))


def run(
    args: argparse.Namespace,
    flags: Sequence[str],
    check_flags: Callable[[list[str]], Any],
    options_of: Callable[[str], set[str]],
) -> int:
    """``dmltrain sweep``: ``flags`` are the experiment's; ``options_of(experiment)`` its
    option names; ``check_flags`` parses a command line as ``dmltrain`` would."""
    if args.experiment == "status":
        return status_command(list(flags))
    if args.experiment == "task":  # inside an array task of --trials-per-task T
        return task_command(list(flags), args.in_turn)
    if args.experiment == "ask":  # inside an array task of a search
        return ask_command(list(flags))
    fixed = list(flags)
    if given(fixed, "--run-dir"):
        raise UserError("dmltrain sweep chooses each trial's run directory; leave out --run-dir")
    if not args.space:
        raise UserError("dmltrain sweep EXPERIMENT --space sweep.yaml: give the options to vary")
    for name in ("trials", "parallel", "trials_per_task"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.in_turn and args.trials_per_task == 1:
        raise UserError("--in-turn runs a task's trials one after another: add --trials-per-task T")
    if args.trials_per_task > 1 and args.system == "pbs":
        raise UserError("--trials-per-task is for Slurm arrays; on PBS leave it out")
    if args.trials_per_task > 1 and (args.nodes != 1 or args.tasks_per_node > 1 or args.script):
        raise UserError(
            "--trials-per-task runs its trials as processes of one task on one node: "
            "leave out --nodes, --tasks-per-node and --script"
        )
    space = load_space(Path(args.space), options_of(args.experiment))
    _, config, _ = check_flags([args.experiment, *fixed])  # the fixed flags' own error first
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    sweep = Sweep(Path("runs") / (args.name or f"{args.experiment}-sweep-{stamp}"))
    made = next((p for p in reversed(sweep.directory.parents) if not p.exists()), None)
    if made is None and not sweep.directory.exists():
        made = sweep.directory
    held = rundir.hold(sweep.directory) if args.local else None
    if args.local and held is None:  # a second --local of the same sweep: its trials run
        raise UserError(
            f"sweep {sweep.directory} is being run here by another dmltrain sweep --local; "
            "wait for it to end (dmltrain sweep status shows its trials), or give another --name"
        )
    try:
        return _sweep(sweep, args, fixed, space, config, check_flags)
    except UserError:
        empty = sweep.directory.is_dir() and not any(sweep.directory.iterdir())
        if made is not None and empty:  # refused before anything was written: none left
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        if held is not None:
            held.release()


def _sweep(
    sweep: Sweep,
    args: argparse.Namespace,
    fixed: list[str],
    space: dict[str, Any],
    config: Any,
    check_flags: Callable[[list[str]], Any],
) -> int:
    """The sweep (or search) made or checked, then its trials run or submitted."""
    if args.search:
        left = _create_search(sweep, args, fixed, space, config, check_flags)
    else:
        for name in ("pruner", "storage"):
            if getattr(args, name) is not None:
                raise UserError(f"--{name} is for a search: add --search tpe (or random, ...)")
        trials = expand(space, args.trials, args.space_seed)
        check_trials(trials, fixed, args.experiment, check_flags)
        sweep.create(args.launch_as, fixed, trials)
        left = sweep.left()
    print(
        f"dmltrain sweep: {sweep.count()} trial(s) in {sweep.directory} ({sweep.directory}/"
        f"trials.csv); {len(left)} not done"
    )
    if not left:
        print("dmltrain sweep: every trial is done; nothing to run")
        return 0
    if args.local:
        return run_local(sweep, left, args.parallel)
    if args.system == "pbs":
        return submit_pbs_array(sweep, left, args)
    return submit_array(sweep, left, args)


def _create_search(
    sweep: Sweep,
    args: argparse.Namespace,
    fixed: list[str],
    space: dict[str, Any],
    config: Any,
    check_flags: Callable[[list[str]], object],
) -> list[int]:
    """The search's sweep and study, checked before anything runs; the trials not done."""
    settings = search.Search(
        args.search,
        args.pruner or "median",
        args.trials,
        args.space_seed,
        config.checkpoint.best_metric,
        config.checkpoint.best_mode,
        args.retry_failed,
        args.storage,
    )
    search.check(settings, space)
    check_trials(search.corners(space), fixed, args.experiment, check_flags)
    asked = {"space": space, "search": dataclasses.asdict(settings)}
    sweep.create(args.launch_as, fixed, [], asked)
    search.create_study(sweep, settings, {"experiment": args.launch_as, "fixed": fixed, **asked})
    return [i for i in range(settings.trials) if not search.finished(sweep, i)]


def run_local(sweep: Sweep, left: list[int], parallel: int) -> int:
    """Each trial in its own process, ``parallel`` at once, each run again while it exits
    with status 3 (stopped to go on); output in ``trial-<i>/output.log``. A search's trial
    is asked for first, and run again while ``--retry-failed`` allows."""
    threads = max(1, physical_cores(cpu_set()) // parallel)
    searching = sweep.searching()

    def one(i: int) -> int:
        if not searching:
            code = _run_here(sweep, i, threads if parallel > 1 else None)
            print(f"dmltrain sweep: trial {i}: {sweep.outcome(i)} (exit status {code})", flush=True)
            return code
        code, newest = 0, None
        while (ended := search.ready(sweep, i)) is None:
            code = _run_here(sweep, i, threads if parallel > 1 else None)
            checkpoints = list_checkpoints(sweep.trial_dir(i) / "checkpoints")
            # killed, or a peer lost, after a checkpoint newer than the last such stop's:
            # it goes on from there, as a requeued array task would
            stopped = code < 0 or code == EXIT_PEER_LOST
            going_on = stopped and bool(checkpoints) and checkpoints[0] != newest
            if code != 0 and not going_on:
                search.fail_running(sweep, i)  # killed: nothing else tells the study
            elif going_on:
                newest = checkpoints[0] if checkpoints else None
                print(f"dmltrain sweep: trial {i} stopped (exit status {code}); it goes on "
                      "from its checkpoint", flush=True)  # fmt: skip
        print(f"dmltrain sweep: trial {i}: {ended} (exit status {code})", flush=True)
        return 0 if ended in search.FINISHED else code or 1

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        codes = list(pool.map(one, left))
    if searching:
        search.write_table(sweep)
    else:
        sweep.write_table()
    failed = [i for i, code in zip(left, codes, strict=True) if code != 0]
    if failed:
        print(
            f"dmltrain sweep: trial(s) {', '.join(map(str, failed))} failed: see their output.log",
            file=sys.stderr,
        )
        return 1
    return 0


def _run_here(sweep: Sweep, i: int, threads: int | None) -> int:
    """Trial ``i`` in a process of its own until it ends or stops to go on."""
    args = sweep.args(i)
    if threads is not None and not given(args, "--threads"):
        args = [*args, "--threads", str(threads)]
    with open(sweep.trial_dir(i) / "output.log", "a", opener=not_through_a_link) as log:
        while True:
            code = subprocess.run(
                [sys.executable, "-m", "dmltrain", *args], stdout=log, stderr=subprocess.STDOUT
            ).returncode
            if code != EXIT_REQUEUE:
                return code


def submit_array(sweep: Sweep, left: list[int], args: argparse.Namespace) -> int:
    """The trials not done as one Slurm job array of ``slurm/run.sh`` tasks: a task per
    trial, or per ``--trials-per-task`` trials (task k: trials kT to kT+T-1)."""
    per_task, directory = args.trials_per_task, sweep.directory.resolve()
    output = f"{directory}/trial-%a/slurm-%A_%a.out"
    body = [  # the task's trial, or its trials started by `dmltrain sweep task`
        "trial=${SLURM_ARRAY_TASK_ID:?submit this script as a job array (sbatch --array)}",
        'mapfile -t trial_args < "$sweep/trial-$trial/args"',
        '[ $# -gt 0 ] || set -- "${trial_args[@]}" --run-dir "$sweep/trial-$trial"',
    ]
    if sweep.searching():  # the task's trial asked of the study first; a retry moves its folder
        output = f"{directory}/slurm-%A_%a.out"
        body[1:] = _asked("trial")
    if per_task > 1:
        output = f"{directory}/task-%a-slurm-%A.out"
        turn = " --in-turn" if args.in_turn else ""
        body[1:] = [f'[ $# -gt 0 ] || set -- sweep task "$sweep" "$trial" {per_task}{turn}']
        left = sorted({i // per_task for i in left})
    directive = {"#SBATCH --output=": f"#SBATCH --output={output}"}
    target = _write_script(sweep, args, "slurm", directive, body)
    array = ",".join(map(str, left)) + (f"%{args.max_parallel}" if args.max_parallel else "")
    what = f"job array ({'tasks' if per_task > 1 else 'trials'} {array})"
    return _send(sweep, ["sbatch", "--parsable", f"--array={array}", str(target)], what, args)


def _asked(trial: str, indent: str = "") -> list[str]:
    """A search's array task: its trial's command line, asked of ``dmltrain sweep ask``
    (nothing: the trial is done, and the task ends)."""
    return [
        f"{indent}if [ $# -eq 0 ]; then",
        f'{indent}    asked=$(dmltrain sweep ask "$sweep" "${trial}") || exit $?',
        f'{indent}    [ -n "$asked" ] || exit 0',
        f'{indent}    mapfile -t trial_args <<< "$asked"',
        f'{indent}    set -- "${{trial_args[@]}}"',
        f"{indent}fi",
    ]


def _write_script(
    sweep: Sweep, args: argparse.Namespace, system: str, output: dict[str, str], body: list[str]
) -> Path:
    """``sweep-<system>.sh``: the batch script ``dmltrain submit`` would write, its output
    directive set to ``output``, each task's command line found by ``body``."""
    directory = sweep.directory.resolve()
    target = directory / f"sweep-{system}.sh"
    script = args.script or ("run" if system == "slurm" else "derecho")
    name = args.job_name or f"sweep-{directory.name}"
    job = argparse.Namespace(**{**vars(args), "system": system, "script": script, "job_name": name})
    if args.trials_per_task > 1:
        job.tasks_per_node = 1  # one process starts the task's trials
    lines = submit.set_directives(submit.render(job, [], directory, target), output).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("[ $# -gt 0 ] || set -- "))
    lines[at - 1 : at + 1] = [
        f"# Written by dmltrain sweep on {datetime.datetime.now():%Y-%m-%d %H:%M}: each task of "
        "the array runs its trial(s); run the same dmltrain sweep command to go on.",
        f"sweep={shlex.quote(str(directory))}",
        *body,
    ]
    target.write_text("\n".join(lines) + "\n")
    target.chmod(target.stat().st_mode | stat.S_IXUSR)  # the umask decides the rest
    return target


def _send(sweep: Sweep, command: list[str], what: str, args: argparse.Namespace) -> int:
    """Submit the array (``command``), or with ``--dry-run`` say how."""
    tool = command[0]
    if args.dry_run:
        shown = shlex.join([c for c in command if c != "--parsable"])
        print(f"dmltrain sweep: wrote {command[-1]}; submit it with: {shown}")
        return 0
    if shutil.which(tool) is None:
        raise UserError(f"{tool} not found: run this on a {args.system} login node, or add --local")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"{tool} refused the array: {done.stderr.strip() or done.stdout}")
    job = done.stdout.strip().splitlines()[0].split(";")[0]
    sweep.add_job(job)
    print(
        f"dmltrain sweep: submitted {what.replace('(', f'{job} (', 1)}; "
        f"dmltrain sweep status {sweep.directory}"
    )
    return 0


def task_command(argv: list[str], in_turn: bool = False) -> int:
    """``dmltrain sweep task DIR K T [--in-turn]``: array task K's trials (KT to KT+T-1)
    not done, side by side, each in its own process with its share of the GPUs (else of
    the CPU threads); with ``--in-turn``, one after another with all of them (a search
    asks each trial's options as it starts it, so the later ones learn from the earlier).
    A signal to this process (Slurm's USR1 before the time limit, scancel) is passed on to
    every trial running. Exit status 3 when a trial stopped to go on (the batch script
    requeues the task; its done trials are not run again), else the first failure's."""
    try:
        directory, task, per_task = Path(argv[0]), int(argv[1]), int(argv[2])
    except (IndexError, ValueError):
        raise UserError(
            "dmltrain sweep task DIR K T runs array task K's T trials of the sweep in DIR "
            "(the batch script dmltrain sweep wrote runs it): give all three"
        ) from None
    # what the batch script adds (--no-requeue); its --status-file is the task's to write
    extra, status_file = _without_status_file(argv[3:])
    sweep = Sweep(directory)
    searching = sweep.searching()

    def ready(i: int) -> bool:
        return search.ready(sweep, i) is None if searching else sweep.outcome(i) != "done"

    received: list[signal.Signals] = []
    caught = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    for number in caught:
        signal.signal(number, lambda signum, _frame: received.append(signal.Signals(signum)))
    slots = range(task * per_task, min((task + 1) * per_task, sweep.count()))
    trials, ended = [], []
    if in_turn:
        for i in slots:
            if not ready(i):
                continue
            trials.append(i)
            ended += _run_trials(sweep, task, [i], extra, status_file, received)
            if ended[-1][0] in (EXIT_REQUEUE, EXIT_PEER_LOST):
                break  # the task requeues; the next job goes on from this trial
    else:
        trials = [i for i in slots if ready(i)]
        ended = _run_trials(sweep, task, trials, extra, status_file, received)
    if not trials:
        return 0
    codes = [code for code, _ in ended]
    print(f"dmltrain sweep: task {task}: trials {trials} ended with {codes}", flush=True)
    for trial, code in zip(trials, codes, strict=True):
        if searching and code not in (0, EXIT_REQUEUE, EXIT_PEER_LOST):
            search.fail_running(sweep, trial)  # killed: nothing else tells the study
    status = next((code for code in codes if code), 0)
    if any(code in (EXIT_REQUEUE, EXIT_PEER_LOST) for code in codes):
        status = EXIT_REQUEUE
    if status_file is None:
        return status
    write_atomic(status_file, status_record(status, sum(saved for _, saved in ended)))
    # the batch script reads it there; srun would report a 3 as a failed task
    return 0 if status == EXIT_REQUEUE else status


def _run_trials(
    sweep: Sweep,
    task: int,
    trials: list[int],
    extra: list[str],
    status_file: Path | None,
    received: list[signal.Signals],
) -> list[tuple[int, int]]:
    """``trials`` side by side, the GPUs (else the CPU threads) split among them, until
    all end; each one's status and checkpoints saved (``_trial_status``)."""
    if not trials:
        return []
    try:
        devices = split_gpus(len(trials))
    except ValueError as exc:
        raise UserError(f"--trials-per-task {len(trials)}: {exc}") from None
    threads = max(1, physical_cores(cpu_set()) // len(trials))
    children = []
    for trial, gpus in zip(trials, devices, strict=True):
        args = [*sweep.args(trial), *extra]
        if status_file is not None:
            args += ["--status-file", f"{status_file}.trial-{trial}"]
        if not gpus and not given(args, "--threads"):
            args += ["--threads", str(threads)]
        print(f"dmltrain sweep: task {task} starts trial {trial}", flush=True)
        children.append(
            subprocess.Popen([sys.executable, "-m", "dmltrain", *args], env=child_env(gpus))
        )
    while any(child.poll() is None for child in children):
        while received:  # passed on from here, not from the handler
            number = received.pop(0)
            for child in children:
                if child.poll() is None:
                    child.send_signal(number)
        time.sleep(0.2)
    return [
        _trial_status(child.returncode, status_file, trial)
        for child, trial in zip(children, trials, strict=True)
    ]


def ask_command(argv: list[str]) -> int:
    """``dmltrain sweep ask DIR K``: ready trial K of the search in DIR (``search.ready``)
    and print its command line, a word a line; print nothing when the trial is done."""
    try:
        directory, slot = Path(argv[0]), int(argv[1])
    except (IndexError, ValueError):
        raise UserError(
            "dmltrain sweep ask DIR K readies trial K of the search in DIR (the batch script "
            "dmltrain sweep wrote runs it): give both"
        ) from None
    sweep = Sweep(directory)
    if not sweep.searching():
        raise UserError(f"{directory} is a sweep, not a search: its trials need no asking")
    ended = search.ready(sweep, slot)
    if ended is not None:
        print(f"dmltrain sweep: trial {slot} is {ended}: nothing to run", file=sys.stderr)
        return 0
    print("\n".join(sweep.args(slot)))
    return 0


def _without_status_file(extra: list[str]) -> tuple[list[str], Path | None]:
    if "--status-file" not in extra[:-1]:
        return extra, None
    at = extra.index("--status-file")
    return [*extra[:at], *extra[at + 2 :]], Path(extra[at + 1])


def _trial_status(code: int, status_file: Path | None, trial: int) -> tuple[int, int]:
    """A trial's status (what its rank 0 wrote to its status file, else its exit status)
    and how many checkpoints it saved."""
    if status_file is None:
        return code, 0
    path = Path(f"{status_file}.trial-{trial}")
    written = read_status_record(path)
    if written is not None:
        with contextlib.suppress(OSError):
            path.unlink()
    return written or (code, 0)


class _StatusParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog} DIR [--best-metric M] [--best-mode min|max]: {message}")


def status_command(argv: list[str]) -> int:
    """``dmltrain sweep status DIR [--best-metric M] [--best-mode min|max]``."""
    parser = _StatusParser(prog="dmltrain sweep status")
    parser.add_argument("directory")
    parser.add_argument("--best-metric", default="val_loss", help="the metric of the best trial")
    parser.add_argument("--best-mode", choices=["min", "max"], default="min")
    args = parser.parse_args(argv)
    sweep = Sweep(Path(args.directory))
    if sweep.searching():
        return search_status(sweep)
    return status(sweep, args.best_metric, args.best_mode)


def search_status(sweep: Sweep) -> int:
    """A search's table (and trials.csv): each trial's options, state in the study (a
    queued or running array task shown as such), value and steps; then the counts, the
    best trial and what pruning saved."""
    rows, lines, damaged = search.summary(sweep)
    queued = scheduler_states(sweep.load()["jobs"])
    for row in rows:
        if row["state"] in ("pending", "paused") and row["trial"] in queued:
            row["state"] = queued[row["trial"]]
    search.write_table(sweep, rows)
    _print_table(rows)
    for line in lines:
        print(line)
    if damaged:
        print(
            f"dmltrain sweep: error: {damaged}; the rows above show what the trials' own "
            "records say (exit status 2)",
            file=sys.stderr,
        )
        return 2
    return 0


def submit_pbs_array(sweep: Sweep, left: list[int], args: argparse.Namespace) -> int:
    """The trials from the first to the last not done as one PBS array job (``qsub -J``:
    a range; a subjob whose trial is done ends at once). A stopped trial resubmits itself
    as a plain job (the PBS scripts' resubmission), which resumes its run directory."""
    directory = sweep.directory.resolve()
    body = [
        'if [ $# -eq 0 ] && [ -z "${DMLTRAIN_ARGS:-}" ]; then  # a subjob: its trial',
        "    trial=${PBS_ARRAY_INDEX:?submit this script as an array job (qsub -J)}",
        '    if grep -qs \'"status": "done"\' "$sweep/trial-$trial/outcome.json"; then',
        '        echo "dmltrain: trial $trial is done"',
        "        exit 0",
        "    fi",
        '    mapfile -t trial_args < "$sweep/trial-$trial/args"',
        '    set -- "${trial_args[@]}" --run-dir "$sweep/trial-$trial"',
        "fi",
    ]
    if sweep.searching():
        body[2:8] = _asked("trial", "    ")
    output = {"#PBS -o ": f"#PBS -o {directory}/pbs-^array_index^.out"}
    target = _write_script(sweep, args, "pbs", output, body)
    array = f"{left[0]}-{left[-1]}" + (f"%{args.max_parallel}" if args.max_parallel else "")
    return _send(sweep, ["qsub", "-J", array, str(target)], f"array job (trials {array})", args)


def scheduler_states(jobs: list[str]) -> dict[int, str]:
    """Each array task's state in Slurm's queue (pending, running) by trial; {} without
    squeue or jobs."""
    jobs = [job for job in jobs if "[" not in job]  # Slurm's (PBS array ids hold "[]")
    if not jobs or shutil.which("squeue") is None:
        return {}
    done = subprocess.run(
        ["squeue", "-h", "-r", "-j", ",".join(jobs), "-o", "%i %T"], capture_output=True, text=True
    )
    states = {}
    for line in done.stdout.splitlines():
        task, _, state = line.partition(" ")
        index = task.rpartition("_")[2]
        if index.isdigit():
            states[int(index)] = "running" if state == "RUNNING" else state.lower()
    return states


def status(sweep: Sweep, metric: str, mode: str) -> int:
    """The trials' table (and trials.csv), then the best trial."""
    rows = sweep.rows(metric, mode, scheduler_states(sweep.load()["jobs"]))
    sweep.write_table(rows)
    _print_table(rows)
    top = best(rows, metric, mode)
    if top is None:
        print(f"dmltrain sweep: no trial has validated {metric} yet")
    else:
        print(
            f"dmltrain sweep: best trial {top['trial']} ({metric} {top[metric]:.6g}): "
            f"{sweep.trial_dir(top['trial'])}"
        )
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as aligned columns, a failure's last line after its row."""
    names: list[str] = []
    for row in rows:
        names += [name for name in row if name not in names and name != "last"]
    shown = [[_cell(row.get(k)) for k in names] for row in rows]
    widths = [max(len(n), *(len(r[j]) for r in shown)) for j, n in enumerate(names)]
    print("  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)).rstrip())
    for row, cells in zip(rows, shown, strict=True):
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        print(line + (f"  ({row['last']})" if row.get("last") else ""))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if isinstance(value, float) else str(value)

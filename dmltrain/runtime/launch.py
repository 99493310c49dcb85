"""Who am I in this job? The only module that reads environment variables.

One small detector per launcher turns the environment into a frozen ``DistInfo``.
With ``--launcher auto`` they are tried in this order, first match wins:

1. ``torchrun``  - ``TORCHELASTIC_RUN_ID`` or ``RANK``+``WORLD_SIZE``+``LOCAL_RANK``
   (first, so ``torchrun`` inside an ``srun`` step is torchrun, not Slurm);
2. ``horovod``   - ``HOROVOD_RANK`` (``horovodrun`` with its Gloo controller; under
   ``horovodrun --mpi`` the MPI detector matches and ``--strategy horovod`` is needed);
3. ``slurm``     - ``SLURM_PROCID`` inside an ``srun`` step (``SLURM_STEP_ID`` set and no
   ``SLURM_PTY_PORT``): an ``sbatch`` shell without ``srun``, ``salloc`` and
   ``srun --pty bash`` are single-process unless ``--launcher slurm`` says otherwise;
4. ``mpi``       - OpenMPI (``OMPI_COMM_WORLD_*``), MPICH/Cray PALS (``PMI_RANK``,
   ``PMI_SIZE``, ``PALS_LOCAL_RANKID`` or ``MPI_LOCALRANKID``);
5. ``spawn``     - ``--nprocs N`` with N > 1 and none of the above: this process starts N
   local workers itself;
6. ``single``    - one process.

Under ``srun`` or ``mpirun``, ``--nprocs N`` makes each of the T tasks start N / T workers
(``srun -N 1 -n 1 python train.py --nprocs 2``, as some centres' guides write it): worker
i of task t is rank t x N/T + i, and the local ranks count across the node's tasks.
"""

import os
import re
import secrets
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace

import torch

from dmltrain.errors import UserError

Env = Mapping[str, str]
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job, decided once at start."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "single"
    device: str = "cpu"
    job_id: str | None = None
    spawned: bool = False  # a worker that a --nprocs parent started
    # --nprocs: the workers this process starts (ranks rank .. rank + workers - 1)
    workers: int = 1
    # torchrun's agent holds the rendezvous store at master_port (it said so): rank 0 joins
    # it instead of making one, under this attempt's prefix (its restart count)
    agent_store_attempt: int | None = None

    @property
    def starts_workers(self) -> bool:
        """Whether this process is a ``--nprocs`` parent: it starts the ranks and waits."""
        return (self.launcher == "spawn" or self.workers > 1) and not self.spawned

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# Variables worth recording at start (diagnostics.json), by prefix or exact name.
RELEVANT = (
    "SLURM_",
    "PBS_",
    "PALS_",
    "PMI_",
    "OMPI_COMM_WORLD_",
    "HOROVOD_",
    "TORCHELASTIC_",
    "MASTER_",
    "NCCL_",
    "CUDA_VISIBLE_DEVICES",
    "WANDB_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMP_NUM_THREADS",
)
SECRET = re.compile(r"KEY|TOKEN|PASSWORD|SECRET|CREDENTIAL", re.IGNORECASE)


@dataclass(frozen=True)
class RunEnvironment:
    """What else a run takes from the environment, read once at start."""

    wandb_mode: str | None = None  # WANDB_MODE, which --wandb-mode auto follows
    wandb_key_set: bool = False  # WANDB_API_KEY is set (its value is never kept)
    wandb_host: str = "https://api.wandb.ai"  # WANDB_BASE_URL
    variables: tuple[tuple[str, str], ...] = ()  # relevant variables, secrets redacted
    omp_num_threads: int | None = None  # OMP_NUM_THREADS as the user set it
    cpus_per_task: int | None = None  # SLURM_CPUS_PER_TASK
    cpus: tuple[int, ...] = ()  # the CPUs this process may run on (cpu_set)
    cores: int = 1  # physical cores among them
    socket_interface: str | None = None  # GLOO_SOCKET_IFNAME: the interface Gloo uses


def run_environment(env: Env | None = None, parent: Env | None = None) -> RunEnvironment:
    """``parent``: the environment this process's parent started with (read from /proc
    when None), to tell torchrun's own OMP_NUM_THREADS from the user's."""
    env = os.environ if env is None else env
    variables = tuple(
        (name, "<redacted>" if SECRET.search(name) else value)
        for name, value in sorted(env.items())
        if name.startswith(RELEVANT)
    )
    return RunEnvironment(
        wandb_mode=env.get("WANDB_MODE") or None,
        wandb_key_set=bool(env.get("WANDB_API_KEY")),
        wandb_host=env.get("WANDB_BASE_URL") or RunEnvironment.wandb_host,
        variables=variables,
        omp_num_threads=_users_omp_threads(env, parent),
        cpus_per_task=_positive(env.get("SLURM_CPUS_PER_TASK")),
        cpus=(cpus := cpu_set()),
        cores=physical_cores(cpus),
        socket_interface=env.get("GLOO_SOCKET_IFNAME") or None,
    )


def _positive(value: str | None) -> int | None:
    try:
        number = int(value or "")
    except ValueError:
        return None
    return number if number > 0 else None


def _users_omp_threads(env: Env, parent: Env | None) -> int | None:
    """OMP_NUM_THREADS, unless torchrun set it: torchrun gives its workers 1 when its own
    environment has none, which is no choice of the user's."""
    threads = _positive(env.get("OMP_NUM_THREADS"))
    if threads is None or not ("TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env):
        return threads
    if parent is None:
        try:
            with open(f"/proc/{os.getppid()}/environ", "rb") as handle:
                pairs = handle.read().decode(errors="replace").split("\0")
        except OSError:
            return threads  # cannot tell: take it as the user's
        parent = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    return threads if "OMP_NUM_THREADS" in parent else None


def physical_cores(cpus: tuple[int, ...]) -> int:
    """Physical cores among ``cpus`` (hyperthreads of one core counted once)."""
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with (
                open(f"{topology}/physical_package_id") as package,
                open(f"{topology}/core_id") as core,
            ):
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def cpu_set() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity: Slurm, MPI and taskset bind it)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_gpus(parts: int, env: Env | None = None) -> list[dict[str, str]]:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES``, else all of torch's), dealt
    out to ``parts`` child processes: each one's ``CUDA_VISIBLE_DEVICES``; ``[{}] * parts``
    without GPUs. Raises ValueError when there are fewer GPUs than parts."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        gpus = [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        return [{} for _ in range(parts)]
    if len(gpus) < parts:
        raise ValueError(f"{len(gpus)} GPU(s) for {parts} processes: give each at least one")
    each = len(gpus) // parts
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * each : (i + 1) * each])} for i in range(parts)
    ]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``extra`` set: for a child process it starts."""
    return {**os.environ, **extra}


def quiet_native_warnings() -> None:
    """Workers started from here (read as they import torch) log torch's C++ errors only,
    unless the user set TORCH_CPP_LOG_LEVEL: a lost peer's socket warnings come with C++
    stack frames, and each rank says what was lost in its own line."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def default_device(local_rank: int = 0) -> str:
    """One process per GPU: local rank N uses cuda:N among the GPUs this process sees,
    counted round (a task that sees only its own GPU, as ``srun --gpus-per-task 1`` gives
    it, uses that one: cuda:0); the CPU when CUDA is absent. Ranks that would share a GPU
    under NCCL are refused at the rendezvous (``preflight``)."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{local_rank % max(torch.cuda.device_count(), 1)}"


def job_id(env: Env | None = None) -> str | None:
    """The batch system's id for this job (Slurm array tasks as ``<array id>_<task id>``)."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    for key in ("SLURM_JOB_ID", "PBS_JOBID", "TORCHELASTIC_RUN_ID"):
        if env.get(key) and env[key] != "none":
            return env[key].split(".")[0]
    return None


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: ``node[01-02,07],gpu1`` -> node01 node02 node07 gpu1."""
    hosts: list[str] = []
    for term in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", term):
            items = [text]
            if ranges:
                items = []
                for part in ranges.split(","):
                    low, _, high = part.partition("-")
                    width = len(low)
                    for n in range(int(low), int(high or low) + 1):
                        items.append(text + str(n).zfill(width))
            expanded = [head + item for head in expanded for item in items]
        hosts += [host for host in expanded if host]
    return hosts


def _tasks_per_node(tasks_per_node: str) -> list[int]:
    """Slurm's ``2(x3),1`` form: how many tasks run on each node."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise UserError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _port(env: Env, job: str | None) -> int:
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    if job:  # two jobs sharing a node get different ports
        digits = re.sub(r"\D", "", job)[-6:] or "0"
        return 15000 + int(digits) % 20000
    return DEFAULT_PORT


def _info(
    env: Env,
    launcher: str,
    rank: int,
    world: int,
    local_rank: int,
    local_world: int,
    node_rank: int,
    addr: str,
) -> DistInfo:
    job = job_id(env)
    return DistInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=addr,
        master_port=_port(env, job),
        launcher=launcher,
        device=default_device(local_rank),
        job_id=job,
    )


def _int(env: Env, *keys: str) -> int | None:
    for key in keys:
        if env.get(key, "") != "":
            return int(env[key])
    return None


def from_torchrun(env: Env) -> DistInfo | None:
    if not ("TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= set(env)):
        return None
    rank, world = _int(env, "RANK") or 0, _int(env, "WORLD_SIZE") or 1
    local_world = _int(env, "LOCAL_WORLD_SIZE") or world
    node = _int(env, "GROUP_RANK", "NODE_RANK")
    info = _info(
        env,
        "torchrun",
        rank,
        world,
        _int(env, "LOCAL_RANK") or 0,
        local_world,
        rank // local_world if node is None else node,
        env.get("MASTER_ADDR", "127.0.0.1"),
    )
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = _int(env, "TORCHELASTIC_RESTART_COUNT") or 0
        info = replace(info, agent_store_attempt=attempt)
    return info


def from_horovod(env: Env) -> DistInfo | None:
    if "HOROVOD_RANK" not in env:
        return None
    rank, world = _int(env, "HOROVOD_RANK") or 0, _int(env, "HOROVOD_SIZE") or 1
    local_world = _int(env, "HOROVOD_LOCAL_SIZE") or world
    return _info(
        env,
        "horovod",
        rank,
        world,
        _int(env, "HOROVOD_LOCAL_RANK") or 0,
        local_world,
        _int(env, "HOROVOD_CROSS_RANK") or 0,
        env.get("MASTER_ADDR", "127.0.0.1"),
    )


def from_slurm(env: Env, require_step: bool = True) -> DistInfo | None:
    if "SLURM_PROCID" not in env:
        return None
    if require_step and ("SLURM_STEP_ID" not in env or "SLURM_PTY_PORT" in env):
        return None  # an sbatch shell, salloc or an interactive srun --pty session
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1
    node = _int(env, "SLURM_NODEID") or 0
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    counts = _tasks_per_node(per_node)
    if sum(counts) != world:  # the ranks would wait for ranks that never start (Lightning #20391)
        raise UserError(
            f"on {hostname()}: Slurm says {world} task(s) in all but {per_node} per node, "
            f"{sum(counts)} in all: start the ranks with srun inside the allocation, and do "
            "not set SLURM_NTASKS or the tasks per node by hand"
        )
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    addr = env.get("MASTER_ADDR") or expand_hostlist(nodes)[0]
    return _info(
        env,
        "slurm",
        _int(env, "SLURM_PROCID") or 0,
        world,
        _int(env, "SLURM_LOCALID") or 0,
        counts[min(node, len(counts) - 1)],
        node,
        addr,
    )


def from_mpi(env: Env) -> DistInfo | None:
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is None or world is None:
        return None
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if local_rank is None:
        local_rank, local_world = rank, world  # no per-node information: assume one node
    local_world = local_world or world
    addr = env.get("MASTER_ADDR")
    if addr is None and env.get("PBS_NODEFILE") and os.path.isfile(env["PBS_NODEFILE"]):
        with open(env["PBS_NODEFILE"]) as handle:
            addr = handle.readline().strip() or None
    if addr is None:
        if local_world != world:
            raise UserError("MPI launch across nodes: export MASTER_ADDR=<first node's address>")
        addr = "127.0.0.1"
    return _info(env, "mpi", rank, world, local_rank, local_world, rank // local_world, addr)


DETECTORS: dict[str, Callable[[Env], DistInfo | None]] = {
    "torchrun": from_torchrun,
    "horovod": from_horovod,
    "slurm": from_slurm,
    "mpi": from_mpi,
}
_NEEDS = {
    "torchrun": "RANK, WORLD_SIZE and LOCAL_RANK (start it with torchrun)",
    "horovod": "HOROVOD_RANK (start it with horovodrun)",
    "slurm": "SLURM_PROCID (start it with srun inside an allocation)",
    "mpi": "OMPI_COMM_WORLD_RANK or PMI_RANK (start it with mpirun or mpiexec)",
}


def detect(launcher: str = "auto", nprocs: int = 1, env: Env | None = None) -> DistInfo:
    """The ``DistInfo`` of this process for ``--launcher`` and ``--nprocs``.

    For ``spawn`` this is the parent's view (rank 0 of ``nprocs``); ``spawned`` gives each
    worker its own.
    """
    env = os.environ if env is None else env
    if launcher in DETECTORS:
        detector = DETECTORS[launcher]
        info = from_slurm(env, require_step=False) if launcher == "slurm" else detector(env)
        if info is None:
            raise UserError(f"--launcher {launcher} needs {_NEEDS[launcher]}")
    elif launcher == "auto":
        info = next((i for d in DETECTORS.values() if (i := d(env)) is not None), None)
    else:
        info = None
    if info is not None:
        return info if nprocs <= 1 else _tasks_start_workers(info, nprocs)
    if launcher == "spawn" or (launcher == "auto" and nprocs > 1):
        return replace(
            single_process(env),
            launcher="spawn",
            world_size=nprocs,
            local_world_size=nprocs,
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else free_port(),
            workers=nprocs,
        )
    return single_process(env)


def _tasks_start_workers(task: DistInfo, nprocs: int) -> DistInfo:
    """``--nprocs N`` under srun or mpirun with T tasks: this task's view as the parent of
    N / T workers (its first worker's rank; the job's world of N)."""
    if task.launcher not in ("slurm", "mpi"):
        raise UserError(
            f"--nprocs starts workers itself; under {task.launcher} drop it and let "
            "the launcher start the processes"
        )
    tasks = task.world_size
    if nprocs % tasks:
        raise UserError(
            f"--nprocs {nprocs} with {tasks} {task.launcher} tasks: each task starts "
            f"--nprocs / tasks workers, so give a multiple of {tasks}"
        )
    per = nprocs // tasks
    if per == 1:
        return task
    return replace(
        task,
        rank=task.rank * per,
        local_rank=task.local_rank * per,
        world_size=nprocs,
        local_world_size=task.local_world_size * per,
        workers=per,
    )


def single_process(env: Env | None = None) -> DistInfo:
    """A plain ``python`` run: one process, rank 0, the first GPU or the CPU."""
    return DistInfo(device=default_device(0), job_id=job_id(env))


def spawned(parent: DistInfo, index: int) -> DistInfo:
    """The ``DistInfo`` of worker ``index`` (0-based) that ``parent`` started."""
    local_rank = parent.local_rank + index
    return replace(
        parent,
        rank=parent.rank + index,
        local_rank=local_rank,
        device=default_device(local_rank),
        spawned=True,
        workers=1,
    )


def enable_flight_recorder(env: MutableMapping[str, str] | None = None) -> None:
    """Keep NCCL's record of the last collectives (PyTorch's flight recorder), which the
    hang watchdog dumps; before the process group starts. A setting of the user's stays."""
    env = os.environ if env is None else env
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"


def lazy_gloo_connections(env: MutableMapping[str, str] | None = None) -> None:
    """Gloo groups connect to a peer when a collective first needs it, not to all N-1 at
    creation: an all-reduce touches a few peers, so a rank holds a few sockets, not one
    a rank of the job (past a soft ``ulimit -n`` of 1,024 at 1,024 ranks). Before the
    groups are made; a setting of the user's stays."""
    env = os.environ if env is None else env
    env.setdefault("TORCH_GLOO_LAZY_INIT", "1")


def free_port() -> int:
    """A TCP port that is free now (bound briefly, then released), below the range the
    system gives outgoing connections: a connection made before the rendezvous binds it
    (Gloo makes many) cannot take it meanwhile. A random pick (not the ``random``
    module's: that is the run's seeded state), the OS's where none is free."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(50):
        port = 20000 + secrets.randbelow(max(1, low - 20000))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def hostname() -> str:
    return socket.gethostname()


# MLflow's settings where the user has not made them. Its HTTP defaults (7 retries of up
# to 120 s each, the wait doubling between them) would hold training for many minutes at
# each call to a store that has gone; the tracker's journal keeps what a failed call held.
# And no "View run at URL" lines on the job's output.
MLFLOW_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def mlflow_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    for key, value in MLFLOW_DEFAULTS.items():
        env.setdefault(key, value)

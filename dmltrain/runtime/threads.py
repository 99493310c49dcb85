"""How many intra-op CPU threads each process uses: its share of the cores it may run on.

torch starts one thread per core of the machine in every process, whatever the launcher
started next to it: two processes on two cores then run four threads, which is slower,
and since some CPU kernels (convolutions) add up in a thread-dependent order, the same
command ended with other bits under ``--nprocs`` than under torchrun (which sets
``OMP_NUM_THREADS=1``). The rule, the same under every launcher:

1. ``--threads N``;
2. else ``OMP_NUM_THREADS`` as the user set it (not the 1 torchrun sets on its own);
3. else the physical cores this process may run on (its CPU affinity, which Slurm, MPI
   and taskset narrow), divided among the processes of its host whose CPUs overlap its
   own, at most ``SLURM_CPUS_PER_TASK``, less one for each DataLoader worker; at least 1.

The DataLoader workers (``--num-workers auto``, the default) come from the same share:
on a GPU, where the device computes and the CPUs load, all of it less one CPU for the
process itself; on CPU, where the same cores compute, a quarter of it (none below 4
CPUs: in-memory data such as MNIST loads faster in the process); at most 8 either way.
"""

from dataclasses import dataclass
from typing import Any

from dmltrain.config import MAX_AUTO_WORKERS


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str  # for the startup summary and diagnostics.json
    workers: int  # DataLoader worker processes
    share: int  # the CPUs this process has, for itself and its workers


def auto_workers(cpus: int, cuda: bool) -> int:
    """``--num-workers auto`` for a process with ``cpus`` CPUs of its own."""
    return min(MAX_AUTO_WORKERS, cpus - 1 if cuda else cpus // 4) if cpus > 1 else 0


def choose(
    flag: int, workers: int | str, ranks: list[dict[str, Any]], rank: int, cuda: bool = False
) -> ThreadChoice:
    """The choice for ``rank``, from every rank's entry of the startup gather (``host``,
    ``cpus``, ``cores``, ``omp_num_threads``, ``cpus_per_task``); ``workers`` is
    ``--num-workers`` (a number or "auto"), ``cuda`` whether the processes train on GPUs."""
    me = ranks[rank]
    mine = set(me["cpus"])
    sharing = sum(1 for r in ranks if r["host"] == me["host"] and mine & set(r["cpus"]))
    share = me["cores"] // max(sharing, 1)
    why = f"{me['cores']} core(s) shared by {sharing} process(es)"
    if me["cpus_per_task"] and me["cpus_per_task"] < share:
        share, why = me["cpus_per_task"], f"SLURM_CPUS_PER_TASK={me['cpus_per_task']}"
    loaders = auto_workers(share, cuda) if workers == "auto" else int(workers)
    if flag:
        return ThreadChoice(flag, "--threads", loaders, share)
    if me["omp_num_threads"]:
        return ThreadChoice(me["omp_num_threads"], "OMP_NUM_THREADS", loaders, share)
    threads = max(1, share - loaders)
    if loaders:
        why += f", {loaders} loader worker(s)"
    return ThreadChoice(threads, why, loaders, share)


def assign(flag: int, workers: int | str, ranks: list[dict[str, Any]], cuda: bool = False) -> None:
    """Every rank's choice into its entry of ``ranks`` (``threads``, ``threads_why``,
    ``workers``, ``cpu_share``)."""
    for rank, entry in enumerate(ranks):
        choice = choose(flag, workers, ranks, rank, cuda)
        entry.update(threads=choice.threads, threads_why=choice.why, workers=choice.workers,
                     cpu_share=choice.share)  # fmt: skip


def starved(ranks: list[dict[str, Any]]) -> str | None:
    """A warning when GPU processes have fewer than 2 CPUs each (one for the process, one
    or more for its loader workers), else None."""
    low = [r for r in ranks if str(r.get("device", "")).startswith("cuda") and r["cpu_share"] < 2]
    if not low:
        return None
    hosts = sorted({r["host"] for r in low})
    return (
        f"{len(low)} GPU process(es) on {', '.join(hosts[:3])}{' ...' if len(hosts) > 3 else ''} "
        f"have {min(r['cpu_share'] for r in low)} CPU each: their data loading competes "
        "with the training step; ask more CPUs a process (Slurm: --cpus-per-task; PBS: "
        "ncpus in select, dmltrain submit pbs --cpus-per-task)"
    )

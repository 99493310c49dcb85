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
"""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str  # for the startup summary and diagnostics.json


def choose(flag: int, workers: int, ranks: list[dict[str, Any]], rank: int) -> ThreadChoice:
    """The choice for ``rank``, from every rank's entry of the startup gather (``host``,
    ``cpus``, ``cores``, ``omp_num_threads``, ``cpus_per_task``)."""
    me = ranks[rank]
    if flag:
        return ThreadChoice(flag, "--threads")
    if me["omp_num_threads"]:
        return ThreadChoice(me["omp_num_threads"], "OMP_NUM_THREADS")
    mine = set(me["cpus"])
    sharing = sum(1 for r in ranks if r["host"] == me["host"] and mine & set(r["cpus"]))
    share = me["cores"] // max(sharing, 1)
    why = f"{me['cores']} core(s) shared by {sharing} process(es)"
    if me["cpus_per_task"] and me["cpus_per_task"] < share:
        share, why = me["cpus_per_task"], f"SLURM_CPUS_PER_TASK={me['cpus_per_task']}"
    threads = max(1, share - workers)
    if workers:
        why += f", {workers} loader worker(s)"
    return ThreadChoice(threads, why)


def assign(flag: int, workers: int, ranks: list[dict[str, Any]]) -> None:
    """Every rank's choice into its entry of ``ranks`` (``threads``, ``threads_why``)."""
    for rank, entry in enumerate(ranks):
        choice = choose(flag, workers, ranks, rank)
        entry.update(threads=choice.threads, threads_why=choice.why)

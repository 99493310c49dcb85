"""The collectives dmltrain adds to training, timed at 2, 4 and 8 Gloo processes here.

    python -m benchmarks.collectives [--ranks 2,4,8] [--reps 300]

- ``agreement``: the preemption/checkpoint agreement (``Strategy.max_over_ranks``): an
  all-reduce MAX of 3 int32, every ``--preempt-check-seconds`` of training;
- ``nan_check``: ``NanChecker.agree``: an all-reduce SUM of a world x 3 float table, every
  step with ``--check-nans``;
- ``epoch_metrics``: the epoch's metric sums (``MetricAccumulator.compute``): an
  all-reduce SUM of 8 floats, once an epoch.

Prints one JSON line: the median seconds of each, per process count. Loopback on a small
machine, oversubscribed beyond its cores: the numbers are this machine's, the growth with
the number of ranks is what a cost model is fitted to (benchmarks/findings.md).
"""

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmltrain.launch import free_port


def _collectives(world: int) -> dict[str, tuple[torch.Tensor, dist.ReduceOp]]:
    return {
        "agreement": (torch.zeros(3, dtype=torch.int32), dist.ReduceOp.MAX),
        "nan_check": (torch.zeros(world, 3), dist.ReduceOp.SUM),
        "epoch_metrics": (torch.zeros(8), dist.ReduceOp.SUM),
    }


def _worker(rank: int, world: int, port: int, reps: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    medians = {}
    for name, (tensor, op) in _collectives(world).items():
        times = []
        for i in range(reps + 20):  # 20 of warm-up
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor, op=op)
            if i >= 20:
                times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times)
    # The slowest rank's median: a collective ends for all when it ends for the last.
    gathered: list = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        out[world] = {name: max(g[name] for g in gathered) for name in medians}
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args(argv)
    results: dict = {}
    with mp.Manager() as manager:
        out = manager.dict()
        for world in (int(n) for n in args.ranks.split(",")):
            mp.start_processes(_worker, args=(world, free_port(), args.reps, out), nprocs=world,
                               start_method="spawn")  # fmt: skip
            results[world] = dict(out[world])
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()

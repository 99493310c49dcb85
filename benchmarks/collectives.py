"""The collectives dmltrain adds to training: timed at a few Gloo processes here, and
extrapolated to 64, 256 and 1,024 ranks with the algorithm's cost model.

    python -m benchmarks.collectives            # 2, 4 and 8 processes, 300 repetitions
    python -m benchmarks.collectives --quick    # 2 processes, 30 repetitions (smoke test)

- ``agreement``: the preemption/checkpoint agreement (``preemption.agree`` through
  ``Strategy.max_over_ranks``): 5 integers to a maximum, about every
  ``--preempt-check-seconds`` of training, as Gloo's all-reduce (a ring: the design
  before) and as ``dmltrain.runtime.control``'s pairwise exchanges (now), side by side;
- ``nan_check``: ``NanChecker.agree``: an all-reduce SUM of a world x 3 float table, every
  step with ``--check-nans``;
- ``epoch_metrics``: the epoch's metric sums (``MetricAccumulator.compute``): an
  all-reduce SUM of 8 floats, once an epoch.

Each is the slowest rank's median. Then each process count trains for a few seconds of
2 ms steps (sleeps, so the ranks do not compete for the cores, and a barrier for the
gradients' all-reduce) with the real
``preemption.agree`` at a 0.5 s interval, once with the interval fixed (the design before)
and once scaled to the agreement's measured cost (now), and reports the share of the
time spent in the agreement. Loopback on a small machine, oversubscribed beyond its
cores: the numbers are this machine's; the model is the algorithm's (a ring all-reduce
takes 2(N-1) latency steps, the pairwise exchanges ``control.rounds(N)``), with 5-20 us a
hop assumed for InfiniBand/Slingshot, and for the exchanges, made from Python, this
machine's time for one round at 2 processes on top of each hop.
"""

import argparse
import datetime
import functools
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmltrain.runtime import control, preemption
from dmltrain.runtime.launch import free_port

INTERVAL = 0.5  # --preempt-check-seconds' default
HOPS_US = (5, 20)  # seconds a hop, assumed: InfiniBand / Slingshot small messages
MODEL_RANKS = (64, 256, 1024)
WARMUP = 50  # steps


def _collectives(world: int) -> dict[str, tuple[torch.Tensor, dist.ReduceOp]]:
    return {
        "agreement": (torch.zeros(5, dtype=torch.int64), dist.ReduceOp.MAX),
        "nan_check": (torch.zeros(world, 3), dist.ReduceOp.SUM),
        "epoch_metrics": (torch.zeros(8), dist.ReduceOp.SUM),
    }


def _ring_max(values: list[int]) -> list[int]:  # DDPStrategy.max_over_ranks before
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _pairwise_max(values: list[int]) -> list[int]:  # DDPStrategy.max_over_ranks now
    rank, world = dist.get_rank(), dist.get_world_size()
    return control.over_ranks(
        values, [control.MAX] * len(values), rank, world, datetime.timedelta(seconds=120)
    )


def _schedule_share(share: float, seconds: float, max_over_ranks) -> float:
    """Train ``seconds`` of 2 ms steps with the real agreement (after a warm-up); the
    share of the time spent in it."""
    schedule = preemption.AgreementSchedule(INTERVAL, share=share)
    watcher = preemption.PreemptionWatcher([])
    spent, start = 0.0, 0.0
    for step in range(WARMUP + int(seconds / 0.002)):  # every rank the same boundaries
        if step == WARMUP:  # the first two agreements learn the cost
            spent, start = 0.0, time.perf_counter()
        time.sleep(0.002)
        dist.barrier()  # the gradients' all-reduce: the ranks leave each step together
        began = time.perf_counter()
        preemption.agree(schedule, watcher, max_over_ranks, lambda: False)
        spent += time.perf_counter() - began
    return spent / (time.perf_counter() - start)


def _median_seconds(call, reps: int) -> float:
    """The median time of ``call`` over ``reps`` calls, after 20 of warm-up, the ranks
    leaving a barrier together before each."""
    times = []
    for i in range(reps + 20):
        dist.barrier()
        start = time.perf_counter()
        call()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, reps: int, seconds: float, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    medians = {
        name: _median_seconds(functools.partial(dist.all_reduce, tensor, op=op), reps)
        for name, (tensor, op) in _collectives(world).items()
    }
    medians["agreement pairwise"] = _median_seconds(lambda: _pairwise_max([0] * 5), reps)
    # share 1: never spaced out
    medians["share fixed"] = _schedule_share(1.0, seconds, _ring_max)
    medians["share scaled"] = _schedule_share(0.01, seconds, _ring_max)
    medians["share scaled pairwise"] = _schedule_share(0.01, seconds, _pairwise_max)
    # The slowest rank's: a collective ends for all when it ends for the last.
    gathered: list = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        out[world] = {name: max(g[name] for g in gathered) for name in medians}
    dist.destroy_process_group()


def model(ranks: int, hop_us: float, round_us: float = 0.0) -> dict[str, float]:
    """A ring all-reduce of a few bytes: 2(N-1) hops; the pairwise exchanges:
    ``control.rounds(N)`` rounds, each a hop and ``round_us`` of software. Their share of
    training at the fixed interval (the ring), and at the interval ``AgreementSchedule``
    scales to each."""
    cost = 2 * (ranks - 1) * hop_us * 1e-6
    pairwise = control.rounds(ranks) * (hop_us + round_us) * 1e-6
    scaled, now = preemption.AgreementSchedule(INTERVAL), preemption.AgreementSchedule(INTERVAL)
    scaled.agreed(1, cost)
    now.agreed(1, pairwise)
    return {
        "cost_ms": cost * 1e3,
        "fixed_share": cost / INTERVAL,
        "scaled_interval": scaled.interval(),
        "scaled_share": cost / scaled.interval(),
        "pairwise_ms": pairwise * 1e3,
        "pairwise_interval": now.interval(),
        "pairwise_share": pairwise / now.interval(),
    }


def markdown(measured: dict[int, dict[str, float]]) -> str:
    worlds = sorted(measured)
    lines = [
        "collectives: Gloo on loopback, the slowest rank's median (ms); `share`: time in the "
        f"agreement over {INTERVAL} s-interval training of 2 ms steps: the ring at a fixed "
        "interval and at one scaled to its measured cost (before), the pairwise exchanges at "
        "one scaled to theirs (now)",
        "| collective | " + " | ".join(f"{w} processes" for w in worlds) + " |",
        "|---|" + "---|" * len(worlds),
    ]
    names = {
        "agreement": "agreement, ring all-reduce (before)",
        "agreement pairwise": "agreement, pairwise exchanges (now)",
        "nan_check": "nan_check",
        "epoch_metrics": "epoch_metrics",
    }
    for name, label in names.items():
        row = " | ".join(f"{measured[w][name] * 1e3:.2f}" for w in worlds)
        lines.append(f"| {label} | {row} |")
    shares = {
        "share fixed": "agreement share: ring, fixed interval",
        "share scaled": "agreement share: ring, scaled interval",
        "share scaled pairwise": "agreement share: pairwise, scaled interval (now)",
    }
    for name, label in shares.items():
        row = " | ".join(f"{measured[w][name]:.2%}" for w in worlds)
        lines.append(f"| {label} | {row} |")
    round_us = measured[worlds[0]]["agreement pairwise"] * 1e6 / control.rounds(worlds[0])
    lines += [
        "",
        "The agreement at scale, on paper: the ring all-reduce (2(N-1) hops; a hop 5 or 20 us) "
        f"at the fixed {INTERVAL} s interval and at the interval `AgreementSchedule` scales to "
        "its measured cost (at most 10 s: a signal is acted on within it); the pairwise "
        f"exchanges (`control.rounds(N)` rounds, each a hop and {round_us:.0f} us, this "
        f"machine's round at {worlds[0]} processes) at the interval scaled to them",
        "| ranks | hop | ring | share, fixed | scaled interval | share, scaled | pairwise | "
        "interval | share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ranks in MODEL_RANKS:
        for hop in HOPS_US:
            m = model(ranks, hop, round_us)
            lines.append(
                f"| {ranks:,} | {hop} us | {m['cost_ms']:.1f} ms | {m['fixed_share']:.2%} | "
                f"{m['scaled_interval']:.2f} s | {m['scaled_share']:.2%} | "
                f"{m['pairwise_ms']:.2f} ms | {m['pairwise_interval']:.2f} s | "
                f"{m['pairwise_share']:.2%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 processes, 30 repetitions")
    parser.add_argument("--ranks", help="comma-separated process counts (default 2,4,8)")
    parser.add_argument("--reps", type=int)
    args = parser.parse_args(argv)
    ranks = args.ranks or ("2" if args.quick else "2,4,8")
    reps = args.reps or (30 if args.quick else 300)
    seconds = 1.5 if args.quick else 6.0
    measured: dict[int, dict[str, float]] = {}
    with mp.Manager() as manager:
        out = manager.dict()
        for world in (int(n) for n in ranks.split(",")):
            mp.start_processes(_worker, args=(world, free_port(), reps, seconds, out),
                               nprocs=world, start_method="spawn")  # fmt: skip
            measured[world] = dict(out[world])
    first = measured[min(measured)]
    round_us = first["agreement pairwise"] * 1e6 / control.rounds(min(measured))
    worst = model(MODEL_RANKS[-1], HOPS_US[-1], round_us)
    report = {
        "measured": measured,
        "model_1024_ranks_20us": worst,
        "markdown": markdown(measured),
    }
    print(report["markdown"])
    print(json.dumps({k: v for k, v in report.items() if k != "markdown"}))
    return report


if __name__ == "__main__":
    main()

"""Scaling: samples/s of dmltrain with 1 and 2 processes on the CPU (Gloo, one thread
each); on a GPU also dmltrain vs the plain loop in fp32 and bf16.

    python benchmarks/scaling.py            # 5 rounds
    python benchmarks/scaling.py --quick    # 1 round

The MNIST CNN, batch 64 per process, in-memory data, ``--nprocs N`` (self-spawned
workers, DDP over Gloo), ``OMP_NUM_THREADS=1`` for both runs, interleaved 1, 2, 1, 2, ...
Samples/s = processes x batch / median step time of rank 0 (``common.Clocked``).

Beside them: a hand-written DDP loop, and the same loop as two independent processes that
never communicate, the most two processes can get on this machine for this step (cores
that share caches and memory bandwidth slow each other down even without any exchange).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Clocked, interleaved, make_data, make_model, run_worker, scratch
from benchmarks.overhead import worker_args
from dmltrain import BaseTrainer, register_experiment

BATCH, WARMUP = 64, 5


class ScalingBench(BaseTrainer):
    steps = 40

    def create_model(self):
        self.clock = Clocked(make_model("cnn"), WARMUP, self.steps, str(self.device))
        return self.clock

    def create_datasets(self):
        n = (WARMUP + self.steps + 2) * BATCH * self.dist.world_size
        return make_data(n), None

    def train_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_train_end(self):
        if self.dist.is_main:
            result = {"step_time": self.clock.step_time, "world": self.dist.world_size}
            (self.run_dir / "clock.json").write_text(json.dumps(result))


def plain_rank(rank: int, world: int, steps: int, port: int, communicate: bool = True) -> None:
    """A hand-written DDP loop (the reference): same model, data and batch, no DataLoader.
    ``communicate=False``: each process trains alone (no process group, no DDP)."""
    import torch.distributed as dist

    communicate = communicate and world > 1
    if communicate:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    clock = Clocked(make_model("cnn"), WARMUP, steps, "cpu")
    model = torch.nn.parallel.DistributedDataParallel(clock) if communicate else clock
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # as dmltrain
    x_all, y_all = make_data((WARMUP + steps + 2) * BATCH, seed=rank).tensors
    for i in range(WARMUP + steps + 2):
        x, y = x_all[i * BATCH : (i + 1) * BATCH], y_all[i * BATCH : (i + 1) * BATCH]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    if rank == 0:
        print(json.dumps({"step_time": clock.step_time, "world": world}), flush=True)
    if communicate:
        dist.destroy_process_group()


def plain_worker(nprocs: int, steps: int, communicate: bool = True) -> None:
    import torch.multiprocessing as mp

    from dmltrain.runtime.launch import free_port

    if nprocs == 1:
        plain_rank(0, 1, steps, 0)
    else:
        mp.start_processes(
            plain_rank,
            args=(nprocs, steps, free_port(), communicate),
            nprocs=nprocs,
            start_method="spawn",
        )


def worker(nprocs: int, steps: int, run_dir: str) -> None:
    from dmltrain.cli import main as cli_main

    ScalingBench.steps = steps
    experiment = register_experiment("scaling", ScalingBench)
    argv = ["scaling", "--nprocs", str(nprocs), "--epochs", "1", "--batch-size", str(BATCH)]
    argv += ["--progress", "off", "--wandb-mode", "disabled", "--run-dir", run_dir]
    status = cli_main(argv, experiments=[experiment])
    if status:
        raise SystemExit(status)
    print((Path(run_dir) / "clock.json").read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest size (a smoke test)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.plain or args.independent:
            plain_worker(args.worker, args.steps, communicate=not args.independent)
        else:
            worker(args.worker, args.steps, args.run_dir)
        return {}
    rounds, steps = (1, 4) if args.smoke else (1, 20) if args.quick else (5, 60)
    tmp = scratch("scaling")
    counter = iter(range(10**6))
    script = Path(__file__)
    names = [("dmltrain", 1), ("dmltrain", 2), ("plain", 1), ("plain", 2), ("independent", 2)]
    if args.smoke:  # the scripts run: the pair that never communicates is left out
        names.remove(("independent", 2))
    flags = {"dmltrain": [], "plain": ["--plain"], "independent": ["--independent"]}
    results = interleaved(
        names,
        rounds,
        lambda cn: run_worker(
            script,
            ["--worker", str(cn[1]), "--steps", str(steps), "--run-dir", f"{tmp}/{next(counter)}"]
            + flags[cn[0]],
            env={"OMP_NUM_THREADS": "1"},
        ),
    )
    rate = {
        cn: cn[1] * BATCH / statistics.median(r["step_time"] for r in results[cn]) for cn in names
    }
    if ("independent", 2) in rate:
        rate[("independent", 1)] = rate[("plain", 1)]  # one process alone is the plain loop
    lines = [
        f"scaling: MNIST CNN, batch {BATCH} per process, {steps} timed steps, one thread per "
        f"process, Gloo, median of {rounds}, interleaved; plain: a hand-written DDP loop; "
        "independent: that loop in 2 processes that never communicate (vs plain's 1 process)",
        "| contender | processes | samples/s | vs 1 process |",
        "|---|---|---|---|",
        *(
            f"| {c} | {n} | {rate[(c, n)]:.0f} | {rate[(c, n)] / rate[(c, 1)]:.2f}x |"
            for c, n in names
        ),
    ]
    ratios = {
        f"{c}: 2 processes / 1 (samples/s)": rate[(c, 2)] / rate[(c, 1)]
        for c in ("dmltrain", "plain", "independent")
        if (c, 2) in rate
    }
    if torch.cuda.is_available():
        lines += ["", *gpu_precision(rounds, ratios)]
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios}


def gpu_precision(rounds: int, ratios: dict) -> list[str]:
    """dmltrain vs the plain loop on one GPU, fp32 and bf16 (the MLP, where the GPU works)."""
    tmp = scratch("gpu")
    counter = iter(range(10**6))
    overhead = Path(__file__).with_name("overhead.py")
    names = [(c, p) for p in ("fp32", "bf16") for c in ("plain", "dmltrain")]
    results = interleaved(
        names,
        rounds,
        lambda cp: run_worker(
            overhead,
            [
                *worker_args(cp[0], "mlp", 10, 100, "cuda", f"{tmp}/{next(counter)}"),
                "--precision",
                cp[1],
            ],
        ),
    )
    lines = [
        "GPU: 37M-parameter MLP, batch 64, 100 timed steps",
        "| precision | contender | ms per step | samples/s | vs plain loop |",
        "|---|---|---|---|---|",
    ]
    for precision in ("fp32", "bf16"):
        plain = statistics.median(r["step_time"] for r in results[("plain", precision)])
        for contender in ("plain", "dmltrain"):
            step = statistics.median(r["step_time"] for r in results[(contender, precision)])
            lines.append(
                f"| {precision} | {contender} | {1000 * step:.2f} | {64 / step:.0f} | "
                f"{step / plain:.3f}x |"
            )
            ratios[f"GPU {precision}: {contender}"] = step / plain
    return lines


if __name__ == "__main__":
    main()

"""Per-step overhead: the same training run by a plain loop, dmltrain and its peers.

    python benchmarks/overhead.py                 # tiny, MNIST CNN and the 37M MLP
    python benchmarks/overhead.py --quick         # fewer steps; memory on the CNN only

Every contender trains the same model (same seed) on the same in-memory data (random
MNIST-shaped tensors, DataLoader with batch 64, shuffled, no workers) with fused Adam (lr
1e-3, dmltrain's default), fp32 (the ViT on a GPU: bf16 autocast), one process, on the
device given. Nothing is logged, no progress bar, no checkpoint inside the timed window,
no validation: dmltrain ``--progress off``, wandb disabled (it checkpoints at the end of
the epoch, after the window); Lightning with logger, progress bar, model summary and
checkpointing off. The time per step is taken by the
same clock inside each (``common.Clocked``: the starts of consecutive training forwards).

Time: all contenders run in one process, taking turns (``common.rotate``: a b c d e f a b
c ... until each has done its timed steps), because fresh processes running the very same
loop on these shared machines differ by up to 1.5x for their whole life. That is repeated
in a few fresh processes, the order of the turns shifted each time, and the median of each
process's ratio to the plain loop is reported with its range. On the CPU the same is
reported for each contender's fast steps (its 10th percentile step,
``common.Clocked.fast_step_time``), which the share of slow steps moves less.
``plain-twin`` is the plain loop once more: how far two identical contenders land apart is
the resolution of the table. Peak RSS (and peak CUDA memory on a GPU): each contender
alone in a fresh process. A peer that is not installed is reported as such.
"""

import argparse
import contextlib
import functools
import io
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (
    Clocked,
    make_data,
    make_model,
    median,
    pass_turn,
    peak_rss_mib,
    rotate,
    run_worker,
    scratch,
    single_process,
)

CONTENDERS = ["plain", "plain-twin", "dmltrain", "lightning", "fabric", "accelerate", "dmlcloud"]
PEERS = {
    "lightning": "lightning",
    "fabric": "lightning",
    "accelerate": "accelerate",
    "dmlcloud": "dmlcloud",
}
LR = 1e-3
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}


def setup(args: argparse.Namespace) -> tuple[Clocked, DataLoader]:
    torch.manual_seed(0)
    turn = pass_turn if args.block else None
    model = Clocked(make_model(args.model), args.warmup, args.steps, args.device, args.block, turn)
    data = make_data((args.warmup + args.steps + 2) * args.batch)
    g = torch.Generator().manual_seed(0)
    return model, DataLoader(data, batch_size=args.batch, shuffle=True, generator=g)


def train_plain(args: argparse.Namespace) -> Clocked:
    model, loader = setup(args)
    model.to(args.device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    device_type = torch.device(args.device).type
    bf16 = args.precision == "bf16"
    for x, y in loader:
        x, y = x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
        else:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return model


def train_dmltrain(args: argparse.Namespace) -> Clocked:
    from dmltrain import BaseTrainer, TrainConfig

    model, loader = setup(args)

    class Bench(BaseTrainer):
        name = "bench"

        def create_model(self):
            return model

        def create_datasets(self):
            return loader.dataset, None

        def train_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

    config = TrainConfig(
        epochs=1,
        batch_size=args.batch,
        lr=LR,
        precision=args.precision,
        progress="off",
        wandb_mode="disabled",
        run_dir=args.run_dir,
        resume="never",
    )
    with contextlib.redirect_stdout(io.StringIO()):
        Bench(config, dist=single_process(args.device)).fit()
    return model


def train_lightning(args: argparse.Namespace) -> Clocked:
    import lightning as L

    model, loader = setup(args)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=LR, fused=True)

    trainer = L.Trainer(
        accelerator="gpu" if args.device.startswith("cuda") else "cpu",
        devices=1,
        precision=LIGHTNING_PRECISION[args.precision],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), loader)
    return model


def train_fabric(args: argparse.Namespace) -> Clocked:
    from lightning.fabric import Fabric

    accelerator = "gpu" if args.device.startswith("cuda") else "cpu"
    fabric = Fabric(
        accelerator=accelerator, devices=1, precision=LIGHTNING_PRECISION[args.precision]
    )
    model, loader = setup(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    wrapped, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    wrapped.train()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        fabric.backward(loss)
        optimizer.step()
    return model


def train_accelerate(args: argparse.Namespace) -> Clocked:
    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=args.device == "cpu", mixed_precision=args.precision.replace("fp32", "no")
    )
    model, loader = setup(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    wrapped.train()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        accelerator.backward(loss)
        optimizer.step()
    return model


def train_dmlcloud(args: argparse.Namespace) -> Clocked:
    import dmlcloud as dml

    model, loader = setup(args)
    dml.init(kind="dummy")

    class Train(dml.Stage):
        def pre_stage(self):
            self.model = model.to(self.device)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR, fused=True)

        def run_epoch(self):
            self.model.train()
            for x, y in loader:
                x, y = x.to(self.device), y.to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                self.optimizer.step()

    pipe = dml.Pipeline(name="bench")
    pipe.append(Train(epochs=1))
    with contextlib.redirect_stdout(io.StringIO()):
        pipe.run()
    return model


def worker(args: argparse.Namespace) -> None:
    """One contender alone (``--worker NAME``), or all of ``--contenders`` taking turns
    (``--worker rotate``); prints one line of JSON."""
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if args.worker == "rotate":
        names = args.contenders.split(",")
        runs = {n: functools.partial(TRAIN[n], rotation_args(args, n)) for n in names}
        models = rotate(runs)
        out = {n: models[n].step_time for n in names}  # type: ignore[attr-defined]
        out.update({f"{n} fast": models[n].fast_step_time for n in names})  # type: ignore[attr-defined]
    else:
        model = TRAIN[args.worker](args)
        out = {
            "step_time": model.step_time,
            "first_step_wall": model.first_step_wall,
            "peak_rss_mib": peak_rss_mib(),
            "peak_cuda_mib": (
                torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else 0.0
            ),
        }
    # sys.__stdout__: contenders that silence their output swap sys.stdout in turns.
    print(json.dumps(out), file=sys.__stdout__, flush=True)


def rotation_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "run_dir": f"{args.run_dir}/{name}"})


TRAIN = {
    "plain": train_plain,
    "plain-twin": train_plain,  # the same loop again: how far identical contenders differ
    "dmltrain": train_dmltrain,
    "lightning": train_lightning,
    "fabric": train_fabric,
    "accelerate": train_accelerate,
    "dmlcloud": train_dmlcloud,
}


def available(name: str) -> bool:
    import importlib.util

    return name not in PEERS or importlib.util.find_spec(PEERS[name]) is not None


def worker_args(name: str, model: str, warmup: int, steps: int, device: str, run_dir: str,
                precision: str = "fp32"):  # fmt: skip
    return [
        "--worker", name, "--model", model, "--warmup", str(warmup), "--steps", str(steps),
        "--device", device, "--batch", "64", "--run-dir", run_dir, "--precision", precision,
    ]  # fmt: skip


def measure(model: str, plan: "Plan", device: str) -> dict:
    """{contender: {"step_ms", "ratio", "low", "high", "rss", "cuda"}} for one model."""
    names = [n for n in CONTENDERS if available(n)]
    tmp = scratch("overhead")
    script = Path(__file__)
    rotations = []
    for i in range(plan.processes):
        order = names[i % len(names) :] + names[: i % len(names)]  # no one always goes first
        rotations.append(
            run_worker(
                script,
                [
                    *worker_args(
                        "rotate",
                        model,
                        plan.warmup,
                        plan.steps,
                        device,
                        f"{tmp}/{i}",
                        plan.precision,
                    ),
                    *("--block", str(plan.block), "--contenders", ",".join(order)),
                ],
            )
        )
    alone = {
        n: run_worker(
            script,
            worker_args(n, model, plan.warmup, plan.block, device, f"{tmp}/{n}", plan.precision),
        )
        for n in names
        if n != "plain-twin" and plan.memory
    }
    alone["plain-twin"] = alone.get("plain", {})
    table: dict[str, dict | None] = {}
    for name in CONTENDERS:
        if name not in names:
            table[name] = None
            continue
        ratios = [r[name] / r["plain"] for r in rotations]
        fast = [r[f"{name} fast"] / r["plain fast"] for r in rotations]
        table[name] = {
            "step_ms": 1000 * median(rotations, name),
            "ratio": statistics.median(ratios),
            "low": min(ratios),
            "high": max(ratios),
            "fast_ms": 1000 * median(rotations, f"{name} fast"),
            "fast_ratio": statistics.median(fast),
            "fast_low": min(fast),
            "fast_high": max(fast),
            "rss": alone.get(name, {}).get("peak_rss_mib"),
            "cuda": alone.get(name, {}).get("peak_cuda_mib"),
        }
    return table


def extra_us(table: dict, name: str) -> float:
    """``name``'s time per step over the plain loop's, in us: its median ratio times the
    plain loop's step."""
    return 1000 * (table[name]["ratio"] - 1) * table["plain"]["step_ms"]


def markdown(model: str, table: dict, plan: "Plan", device: str) -> str:
    cuda = device != "cpu"
    lines = [
        f"overhead: {model}, batch 64, {plan.precision}, device {device}; {plan.steps} timed "
        f"steps each in turns "
        f"of {plan.block}, in {plan.processes} fresh process(es); median and range of the "
        "processes' ratios; peak memory alone in a fresh process"
        + ("" if plan.memory else " (not measured in quick mode: -)")
        + ("" if cuda else "; fast steps: each contender's 10th percentile step"),
        "| contender | ms per step | vs plain loop | range | extra us per step | peak RSS (MiB) |"
        + (" peak CUDA (MiB) |" if cuda else " fast steps: extra us | range (us) |"),
        "|---|---|---|---|---|---|" + ("---|" if cuda else "---|---|"),
    ]
    fast_ms = table["plain"]["fast_ms"]
    for name, row in table.items():
        if row is None:
            lines.append(f"| {name} | not installed | | | | |" + (" |" if cuda else " | |"))
            continue
        extra = extra_us(table, name)
        rss, gpu = (f"{row[k]:.0f}" if row[k] is not None else "-" for k in ("rss", "cuda"))
        fast = [1000 * (row[k] - 1) * fast_ms for k in ("fast_ratio", "fast_low", "fast_high")]
        lines.append(
            f"| {name} | {row['step_ms']:.3f} | {row['ratio']:.3f}x | "
            f"{row['low']:.3f}-{row['high']:.3f} | {extra:+.0f} | {rss} |"
            + (f" {gpu} |" if cuda else f" {fast[0]:+.0f} | {fast[1]:+.0f} to {fast[2]:+.0f} |")
        )
    return "\n".join(lines)


class Plan(NamedTuple):
    steps: int  # timed steps per contender and process
    warmup: int
    block: int  # steps per turn
    processes: int
    memory: bool = True  # each contender's peak memory, alone in a fresh process
    precision: str = "fp32"  # every contender's (autocast)


# Turns of one step where a step is long (every step of a contender lies between steps of
# the others, so all see the machine's moments alike); of 50 for the 1 ms tiny step, where
# a step right after another contender's runs with cold caches. On a GPU turns are of at
# least 20 steps: the clock syncs at every turn. The tiny model's figure is a few us, so
# it takes more processes: identical contenders of one process land tens of us apart.
FULL = {
    "tiny": Plan(600, 20, 50, 10),
    "cnn": Plan(120, 10, 1, 5),
    "mlp": Plan(24, 3, 1, 3),
}
QUICK = {"tiny": Plan(200, 10, 50, 1, memory=False), "cnn": Plan(40, 5, 1, 1)}
# on a GPU, the size users train too: a ViT-Base in bf16 (too slow for 2 CPU cores)
GPU = {"vit": Plan(60, 10, 20, 1, memory=False, precision="bf16")}
SMOKE = {"tiny": Plan(20, 2, 10, 1, memory=False), "cnn": Plan(4, 1, 1, 1, memory=False)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest size (a smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--contenders", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--block", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    texts, ratios, spread, extra = [], {}, {}, {}
    plans = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.device != "cpu" and not args.smoke:
        plans = {**plans, **GPU}
    for model, plan in plans.items():
        if args.device != "cpu":
            plan = plan._replace(block=max(plan.block, 20), steps=max(plan.steps, 100))
        table = measure(model, plan, args.device)
        texts.append(markdown(model, table, plan, args.device))
        print(texts[-1] + "\n", flush=True)
        ratios.update({f"{model}: {k}": v["ratio"] for k, v in table.items() if v})
        twin = table["plain-twin"]
        spread[model] = (twin["low"], twin["high"])  # where identical loops landed
        if table.get("dmltrain"):
            extra[model] = extra_us(table, "dmltrain")
    return {
        "markdown": "\n\n".join(texts),
        "ratios": ratios,
        "twin_range": spread,
        "extra_us": extra,
        "device": args.device,
    }


if __name__ == "__main__":
    main()

"""Models that do not fit: what ``--activation-checkpointing`` and FSDP's sharded
initialisation save, and what they cost.

    python -m benchmarks.big_models [--quick | --smoke]

A decoder-style transformer (``TransformerEncoderLayer`` blocks with a causal mask over
random tokens; 12 blocks of width 640, 70M parameters, at full size), trained by dmltrain
through its command line (``--activation-checkpointing``, ``--strategy fsdp``,
``--no-sharded-init``), each run in a fresh process so that its peak resident memory is
its own:

- recomputation: one process, with and without it, in turns: the peak memory over the
  steps above that before the first step (activations, gradients, optimizer state) and
  the median step time;
- initialisation: FSDP on 1, 2 and 4 processes (and HSDP on 4 as 2 x 2), built on every
  rank or on rank 0 alone,
  the peak resident memory per rank when the first step starts (rank 0, and the largest
  of the others). On a GPU, CUDA's peak allocated memory is what shows; here it is the
  process's, torch's own libraries (about 310 MB, the same in every process) included.
  Rank 0 holds the whole model on the CPU while it sends the shards: on a GPU its device
  memory is its shard's, as the others'.
"""

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_worker, scratch
from dmltrain import BaseTrainer, Callback, register_experiment

SIZES = {  # layers, width, heads, vocabulary, tokens a sample, batch, timed steps
    "full": (12, 640, 10, 8192, 256, 4, 4),
    "quick": (12, 640, 10, 8192, 256, 4, 2),
    "smoke": (2, 64, 4, 256, 32, 2, 2),
}
WARMUP = 1


class Transformer(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocabulary: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


class Memory(Callback):
    """Each rank's peak memory when training starts and after each step, and the time
    from one step's end to the next's (the step; the in-memory data costs nothing)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.at_start = self.peak = 0.0

    def on_train_start(self, trainer) -> None:
        self.at_start = peak_mb(trainer.device)
        self.ends.append(time.perf_counter())

    def on_step_end(self, trainer) -> None:
        self.ends.append(time.perf_counter())
        self.peak = peak_mb(trainer.device)  # before the checkpoint at the epoch's end

    def on_train_end(self, trainer) -> None:
        steps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        result = {
            "setup_mb": self.at_start,
            "peak_mb": self.peak,
            "step_s": statistics.median(steps[WARMUP:] or steps),
        }
        (trainer.run_dir / f"memory.{trainer.dist.rank}.json").write_text(json.dumps(result))


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


@dataclass(frozen=True)
class BigOptions:
    size: str = field(default="smoke", metadata={"help": "a key of SIZES"})


class BigModel(BaseTrainer):
    def create_model(self) -> nn.Module:
        layers, width, heads, vocabulary, *_ = SIZES[self.options.size]
        return Transformer(layers, width, heads, vocabulary)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)  # type: ignore[arg-type]

    def create_datasets(self):
        *_, vocabulary, tokens, batch, steps = SIZES[self.options.size]
        n = (WARMUP + steps) * batch * self.dist.world_size
        data = torch.randint(
            vocabulary, (n, tokens + 1), generator=torch.Generator().manual_seed(0)
        )
        return TensorDataset(data), None

    def train_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def create_callbacks(self):
        return [Memory()]


def worker(size: str, nprocs: int, flags: list[str], run_dir: str) -> None:
    from dmltrain.cli import main as cli_main

    experiment = register_experiment("big-model", BigModel, BigOptions)
    batch = SIZES[size][5]
    argv = ["big-model", "--size", size, "--nprocs", str(nprocs), "--epochs", "1",
            "--batch-size", str(batch), "--progress", "off", "--run-dir", run_dir,
            "--keep-last", "1", *flags]  # fmt: skip
    status = cli_main(argv, experiments=[experiment])
    if status:
        raise SystemExit(status)
    ranks = [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("memory.*.json"))]
    print(json.dumps(ranks))


def params_m(size: str) -> float:
    layers, width, heads, vocabulary, *_ = SIZES[size]
    return sum(p.numel() for p in Transformer(layers, width, heads, vocabulary).parameters()) / 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest size (a smoke test)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--flags", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.size, args.worker, args.flags.split(), args.run_dir)
        return {}
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    rounds = 1 if args.smoke or args.quick else 3
    tmp = scratch("big-models")
    counter = iter(range(10**6))

    def run(nprocs: int, *flags: str) -> list[dict]:
        worker_args = ["--worker", str(nprocs), "--size", size, "--run-dir",
                       f"{tmp}/{next(counter)}", f"--flags={' '.join(flags)}"]  # fmt: skip
        return run_worker(Path(__file__), worker_args)

    # Recomputation, in turns: (peak over the steps, step time) of rank 0.
    kept = {False: [], True: []}
    for _ in range(rounds):
        for ac in (False, True):
            (rank0,) = run(1, *(["--activation-checkpointing"] if ac else []))
            kept[ac].append(rank0)
    # at least 1 MB: the smoke size's steps may not raise the peak at all
    grown = {
        ac: max(1.0, statistics.median(r["peak_mb"] - r["setup_mb"] for r in kept[ac]))
        for ac in kept
    }
    step = {ac: statistics.median(r["step_s"] for r in kept[ac]) for ac in kept}
    layers, width, _, _, tokens, batch, steps = SIZES[size]
    lines = [
        f"big_models: a transformer of {layers} blocks, width {width}, {params_m(size):.0f}M "
        f"parameters, batch {batch} x {tokens} tokens, {steps} timed steps after {WARMUP}, "
        f"AdamW; each run its own process, median of {rounds}",
        "",
        "| one process | memory grown over the steps (MB) | s a step |",
        "|---|---|---|",
        f"| stored activations | {grown[False]:.0f} | {step[False]:.2f} |",
        f"| --activation-checkpointing | {grown[True]:.0f} | {step[True]:.2f} |",
        f"| ratio | {grown[True] / grown[False]:.2f}x | {step[True] / step[False]:.2f}x |",
        "",
        "| FSDP processes | built on | rank 0 peak at the first step (MB) | other ranks (MB) |",
        "|---|---|---|---|",
    ]
    setup = {}
    for nprocs in (2,) if args.smoke else (1, 2, 4):
        for sharded in (False, True) if nprocs > 1 else (False,):  # one rank: built whole
            built = [] if sharded else ["--no-sharded-init"]
            ranks = run(nprocs, "--strategy", "fsdp", "--max-steps", "1", *built)
            others = max((r["setup_mb"] for r in ranks[1:]), default=float("nan"))
            setup[nprocs, sharded] = (ranks[0]["setup_mb"], others)
            where = "rank 0 (sharded init)" if sharded else "every rank"
            shown = f"{others:.0f}" if ranks[1:] else "-"
            lines.append(f"| {nprocs} | {where} | {ranks[0]['setup_mb']:.0f} | {shown} |")
    if not args.smoke:  # HSDP: each pair holds a copy, sharded in two
        hsdp = run(4, "--strategy", "fsdp", "--max-steps", "1", "--fsdp-shard-size", "2")
        others = max(r["setup_mb"] for r in hsdp[1:])
        lines.append(f"| 4, --fsdp-shard-size 2 | rank 0 (sharded init) | "
                     f"{hsdp[0]['setup_mb']:.0f} | {others:.0f} |")  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    ratios = {
        "--activation-checkpointing: memory grown over the steps, with / without": grown[True]
        / grown[False],
        "--activation-checkpointing: step time, with / without": step[True] / step[False],
        "FSDP, other ranks' peak at the first step: sharded init / built on every rank": (
            setup[nprocs, True][1] / setup[nprocs, False][1]
        ),
    }
    return {"markdown": text, "ratios": ratios}


if __name__ == "__main__":
    main(sys.argv[1:])

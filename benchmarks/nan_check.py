"""What ``--check-nans`` (``--option ema``: ``--ema-decay``; ``--option monitor``: the
throughput, straggler and hang monitoring on by default) costs per training step.

    python benchmarks/nan_check.py            # MNIST CNN, batch 64, 150 steps, 5 processes
    python benchmarks/nan_check.py --quick    # 30 steps, 1 process (a smoke test)

The MNIST CNN on random MNIST-shaped data held in memory, trained by dmltrain with and
without ``--check-nans`` in one process, taking turns step by step (``common.rotate``, as
in ``overhead.py``: separate runs drift apart with the machine's load), each step timed by
the same clock (``common.Clocked``). A second unchecked run takes its turns beside them:
how far two identical runs land apart is the resolution of the ratio. Repeated in a few
fresh processes (who goes first rotates); reported: the median time per step of each and
the median and range of the processes' ratios. Logging off, no checkpoints inside the
loop, one process, the device given.
"""

import argparse
import contextlib
import functools
import io
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (
    Clocked,
    make_data,
    make_model,
    median,
    pass_turn,
    rotate,
    run_worker,
    scratch,
    single_process,
)
from dmltrain import BaseTrainer, TrainConfig

WARMUP = 5
MODELS = {"cnn": "MNIST CNN", "tiny": "tiny model (a 784-10 linear layer)"}


class Bench(BaseTrainer):
    name = "bench"
    steps = 150
    block = 1

    model_name = "cnn"

    def create_model(self):
        model = make_model(self.model_name)
        self.clock = Clocked(model, WARMUP, self.steps, str(self.device), self.block, pass_turn)
        return self.clock

    def create_datasets(self):
        return make_data((WARMUP + self.steps + 2) * self.config.batch_size), None

    def train_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


RUNS = ["off", "on", "off-twin"]  # the run without the option, with it, without again

# The options this measures (``--option``): the settings of the "on" run and of the "off"
# runs, and the words of the table: (title, the option as typed, the run without it).
OPTIONS: dict[str, tuple[dict, dict, str, str, str]] = {
    "nan_check": ({"check_nans": True}, {}, "nan-check", "--check-nans", "unchecked"),
    "ema": ({"ema_decay": 0.999}, {}, "ema", "--ema-decay 0.999", "without EMA"),
    "monitor": ({}, {"monitor": False, "hang_watchdog": False}, "monitor",
                "monitoring (default)", "--no-monitor --no-hang-watchdog"),
}  # fmt: skip


def run(
    name: str, steps: int, block: int, device: str, root: Path, option: str, model: str
) -> float:
    config = TrainConfig(
        epochs=1,
        batch_size=64,
        progress="off",
        wandb_mode="disabled",
        keep_last=1,
        run_dir=str(root / name),
        **(OPTIONS[option][0] if name == "on" else OPTIONS[option][1]),
    )
    trainer = Bench(config, dist=single_process(device))
    trainer.steps, trainer.block, trainer.model_name = steps, block, model
    trainer.fit()
    return trainer.clock.step_time


def worker(args: argparse.Namespace) -> None:
    first = RUNS.index(args.worker)
    order = RUNS[first:] + RUNS[:first]
    runs = {
        name: functools.partial(
            run,
            name,
            args.steps,
            args.block,
            args.device,
            Path(args.root),
            args.option,
            args.model,
        )
        for name in order
    }
    with contextlib.redirect_stdout(io.StringIO()):  # the runs' banners and epoch lines
        times = rotate(runs)  # type: ignore[arg-type]
    print(json.dumps(times), flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=150, help=argparse.SUPPRESS)
    parser.add_argument("--block", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--option", choices=sorted(OPTIONS), default="nan_check")
    parser.add_argument("--model", choices=["tiny", "cnn"], default="cnn")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    steps, processes = (30, 1) if args.quick else (150 if args.model == "cnn" else 600, 5)
    block = 1 if args.device == "cpu" else 20  # the clock syncs a GPU at every turn
    root = Path(scratch("nan-bench"))
    results = [
        run_worker(
            Path(__file__),
            [
                "--worker",
                RUNS[i % len(RUNS)],  # who goes first
                "--steps",
                str(steps),
                "--block",
                str(block),
                "--device",
                args.device,
                "--root",
                str(root / str(i)),
                "--option",
                args.option,
                "--model",
                args.model,
            ],
        )
        for i in range(processes)
    ]
    ms = {name: 1000 * median(results, name) for name in RUNS}
    ratios = {name: [r[name] / r["off"] for r in results] for name in ("on", "off-twin")}
    ratio = statistics.median(ratios["on"])
    _, _, title, typed, without = OPTIONS[args.option]
    text = "\n".join(
        [
            f"{title}: {MODELS[args.model]}, batch 64, {steps} timed steps each, taking turns "
            f"every {block} step(s) in one process, {processes} fresh process(es), device "
            f"{args.device}; ratio: median (range) of the processes'",
            f"| run | ms per step | vs {without} | range |",
            "|---|---|---|---|",
            f"| {without} | {ms['off']:.2f} | 1.000x | |",
            *(
                f"| {label} | {ms[name]:.2f} | {statistics.median(ratios[name]):.3f}x | "
                f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f} |"
                for name, label in (("on", typed), ("off-twin", f"{without} again"))
            ),
        ]
    )
    print(text, flush=True)
    twin = ratios["off-twin"]
    return {
        "markdown": text,
        "ratios": {f"{title}: on / off": ratio},
        "twin_range": (min(twin), max(twin)),
        "ms": ms,
    }


if __name__ == "__main__":
    main()

"""What a training step asks of the device, counted on the CPU: operators dispatched and
host reads, per step, for the plain loop and for dmltrain in the configurations users run.

    python benchmarks/step_counts.py            # every configuration, steps 20-120
    python benchmarks/step_counts.py --quick    # the same, steps 10-30 (a smoke test)

On a GPU each host read waits for every kernel queued before it: the CPU stops queueing
and the GPU idles while the next step is launched. The CPU counts exactly what a GPU would
be asked (the same operators, the same reads), with no timing noise. A
``TorchDispatchMode`` counts every operator the step dispatches; a host read is an
operator that returns a Python number (``aten._local_scalar_dense``: ``item``, ``bool()``,
``float()``) or a read of memory that dispatches nothing (``Tensor.tolist``,
``Tensor.numpy``). The model: a 784-64-10 MLP, batch 64, Adam; logging at steps outside
the counted ones, so what is counted is the steady step (a log interval adds one read).
"""

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dmltrain import BaseTrainer, Callback, TrainConfig

BATCH = 64
HOST_READ_OPS = {torch.ops.aten._local_scalar_dense.default}


class Counts(TorchDispatchMode):
    """Operators dispatched and host reads, while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        self.reads += func in HOST_READ_OPS
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def reads_without_dispatch(counts: Counts) -> Iterator[None]:
    """``Tensor.tolist`` and ``Tensor.numpy`` read memory without an operator: counted too."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts.reads += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


def data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 1, 28, 28, generator=g),
                         torch.randint(0, 10, (samples,), generator=g))  # fmt: skip


class Stream(IterableDataset):
    """The same samples as a stream (its position saved by the default loader)."""

    def __init__(self, samples: int) -> None:
        self.inner, self.position = data(samples), 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        while self.position < len(self.inner):
            self.position += 1
            yield self.inner[self.position - 1]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Window(Callback):
    """Counts from the end of step ``first`` to the end of step ``last``."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.counts = Counts()
        self._reads: Any = None

    def on_step_end(self, trainer: Any) -> None:
        if trainer.global_step == self.first:
            self._reads = reads_without_dispatch(self.counts)
            self._reads.__enter__()
            self.counts.__enter__()
        elif trainer.global_step == self.last:
            self.counts.__exit__(None, None, None)
            self._reads.__exit__(None, None, None)


class Counted(BaseTrainer):
    """The MLP under dmltrain, counted in a window of steps (``window``); ``stream``: the
    data as a stream; ``manual``: a manual step (``manual_optimization``)."""

    name = "step-counts"
    window: Window
    stream = False

    def create_model(self) -> nn.Module:
        return mlp()

    def create_datasets(self) -> tuple[Any, None]:
        samples = (self.window.last + 2) * BATCH
        return (Stream(samples) if self.stream else data(samples)), None

    def create_callbacks(self) -> list[Callback]:
        return [self.window]

    def train_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)


class Manual(Counted):
    manual_optimization = True

    def train_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.backward(loss)
        self.optimizer_step(self.optimizer)
        return loss.detach()


# what each row runs: (the flags as a user types them, the settings, the trainer)
CONFIGS: dict[str, tuple[str, dict[str, Any], type[Counted]]] = {
    "defaults": ("", {}, Counted),
    "nan-raise": ("--check-nans", {"check_nans": True}, Counted),
    "nan-skip": ("--check-nans --on-nan skip", {"check_nans": True, "on_nan": "skip"}, Counted),
    "grad-clip": ("--grad-clip 1", {"grad_clip": 1.0}, Counted),
    "grad-accum": ("--grad-accum 4", {"grad_accum": 4}, Counted),
    "ema": ("--ema-decay 0.99", {"ema_decay": 0.99}, Counted),
    "bf16": ("--precision bf16", {"precision": "bf16"}, Counted),
    "stream": ("a stream (its position kept)", {}, Counted),
    "manual": ("manual_optimization", {}, Manual),
    "log-every": ("--log-every 10 (a log interval every 10 steps)", {"log_every": 10}, Counted),
}  # fmt: skip


def plain(first: int, last: int) -> Counts:
    """The plain loop over the same model and data, counted over the same steps."""
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data((last + 2) * BATCH), batch_size=BATCH)
    counts = Counts()
    for step, (x, y) in enumerate(loader, start=1):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step == first:
            reading = reads_without_dispatch(counts)
            reading.__enter__()
            counts.__enter__()
        elif step == last:
            counts.__exit__(None, None, None)
            reading.__exit__(None, None, None)
            break
    return counts


def dmltrain_counts(config: str, first: int, last: int, run_dir: Path) -> Counts:
    _, settings, trainer_cls = CONFIGS[config]
    trainer_cls = type(trainer_cls.__name__, (trainer_cls,), {"stream": config == "stream"})
    window = Window(first, last)
    trainer_cls.window = window  # type: ignore[attr-defined]
    accum = settings.get("grad_accum", 1)
    given = {
        "epochs": 1,
        "max_steps": last,
        "batch_size": BATCH // accum,
        "log_every": 10 * last,  # no log interval inside the window, unless asked for
        "progress": "off",
        "run_dir": str(run_dir / config),
        "num_workers": 0,
        "checkpoint_every_steps": 0,
    }
    train = TrainConfig(**{**given, **settings})
    trainer_cls(train).fit()
    return window.counts


def measure(first: int, last: int, run_dir: Path) -> dict[str, dict[str, float]]:
    """Per step: operators and host reads of the plain loop and of each configuration."""
    steps = last - first
    found = {"plain": plain(first, last)}
    for config in CONFIGS:
        with contextlib.redirect_stdout(sys.stderr):
            found[config] = dmltrain_counts(config, first, last, run_dir)
    return {k: {"ops": c.ops / steps, "reads": c.reads / steps} for k, c in found.items()}


def table(counts: dict[str, dict[str, float]]) -> str:
    base = counts["plain"]
    lines = [
        "| run | operators a step | host reads a step | reads beyond the plain loop |",
        "|---|---|---|---|",
        f"| plain loop | {base['ops']:.1f} | {base['reads']:.2f} | |",
    ]
    for config, (typed, _, _) in CONFIGS.items():
        c = counts[config]
        lines.append(f"| dmltrain {typed or 'defaults'} | {c['ops']:.1f} | {c['reads']:.2f} | "
                     f"{c['reads'] - base['reads']:+.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The counts and their table (``benchmarks.run`` writes it into RESULTS.md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="steps 10-30")
    parser.add_argument("--json", type=Path, help="write the counts here too")
    args = parser.parse_args(argv)
    first, last = (10, 30) if args.quick else (20, 120)
    with tempfile.TemporaryDirectory() as runs:
        counts = measure(first, last, Path(runs))
    markdown = (
        f"Steps {first}-{last} of a 784-64-10 MLP, batch 64, Adam, on the CPU; each a mean "
        "over the steps. A host read on a GPU waits for every kernel queued before it.\n\n"
        + table(counts)
    )
    print(markdown)
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1) + "\n")
    return {"markdown": markdown, "counts": counts}


if __name__ == "__main__":
    main()

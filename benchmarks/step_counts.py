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
import os
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
from dmltrain.runtime.launch import detect, free_port

BATCH = 64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # dmltrain's choice too
HOST_READ_OPS = {torch.ops.aten._local_scalar_dense.default}
CONTROL = str(Path("dmltrain", "runtime", "control.py"))


class Counts(TorchDispatchMode):
    """Operators dispatched and host reads, while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        self.reads += func in HOST_READ_OPS or _to_host(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _to_host(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A copy from device memory into host memory that waits for it (``.cpu()``, a
    blocking ``copy_``): none on the CPU, where the device is the host."""
    if func is torch.ops.aten._to_copy.default:
        return args[0].device.type != "cpu" and kwargs.get("device") == torch.device("cpu")
    if func is torch.ops.aten.copy_.default:
        host, device = args[0].device.type == "cpu", args[1].device.type != "cpu"
        return host and device and not kwargs.get("non_blocking", False)
    return False


# waits for the device that dispatch never sees: (owner, attribute)
WAITS = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
         (torch.cuda.Event, "query"), (torch.cuda.Event, "elapsed_time"),
         (torch.cuda.Stream, "synchronize")]  # fmt: skip


@contextlib.contextmanager
def reads_without_dispatch(counts: Counts) -> Iterator[None]:
    """``Tensor.tolist`` and ``Tensor.numpy`` read memory without an operator, and CUDA's
    synchronize and event reads wait without one: counted too."""
    originals = {(torch.Tensor, n): getattr(torch.Tensor, n) for n in ("tolist", "numpy")}
    originals.update({(owner, n): getattr(owner, n) for owner, n in WAITS})

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            # the preemption agreement's small collective runs on a CPU tensor in a Gloo
            # group of its own (no device memory, even on a GPU), and when time says so
            counts.reads += not sys._getframe(1).f_code.co_filename.endswith(CONTROL)
            return original(*args, **kwargs)

        return read

    for (owner, name), original in originals.items():
        setattr(owner, name, counted(original))
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


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
        samples = (self.window.last + 2) * BATCH * self.dist.world_size
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


class Unfused(Counted):
    """An optimizer of the user's that cannot skip a step on the device (not fused)."""

    def create_optimizer(self, model: nn.Module) -> Any:
        return torch.optim.Adam(model.parameters(), lr=1e-3)


NAN = {"check_nans": True}
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
    "manual-nan": ("manual_optimization --check-nans", {"check_nans": True}, Manual),
    "nan-rollback": ("--check-nans --on-nan rollback", {**NAN, "on_nan": "rollback"}, Counted),
    "fp16": ("--precision fp16 (a grad scaler)", {"precision": "fp16"}, Counted),
    "fp16-nan": ("--precision fp16 --check-nans", {"precision": "fp16", **NAN}, Counted),
    "compile": ("--compile", {"compile": True}, Counted),
    "log-every": ("--log-every 10 (a log interval every 10 steps)", {"log_every": 10}, Counted),
    "nan-log-every": ("--check-nans --log-every 10", {**NAN, "log_every": 10}, Counted),
    "unfused": ("a non-fused Adam of the experiment's", {}, Unfused),
    "nan-unfused": ("a non-fused Adam --check-nans (waits for each check)", NAN, Unfused),
}  # fmt: skip


def plain(first: int, last: int, fused: bool = True) -> Counts:
    """The plain loop over the same model and data, counted over the same steps."""
    torch.manual_seed(0)
    model = mlp().to(DEVICE)
    # fused, as dmltrain's default (and a careful GPU loop): no host read in its step
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    loader = torch.utils.data.DataLoader(data((last + 2) * BATCH), batch_size=BATCH)
    counts = Counts()
    for step, (x, y) in enumerate(loader, start=1):
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
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


# on 2 processes (Gloo), rank 0 counted: (the flags as a user types them, the settings)
DISTRIBUTED: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("--strategy ddp, 2 processes", {"strategy": "ddp"}),
    "ddp-nan": ("--strategy ddp --check-nans, 2 processes", {"strategy": "ddp", **NAN}),
    "fsdp": ("--strategy fsdp, 2 processes", {"strategy": "fsdp"}),
    "fsdp-nan": ("--strategy fsdp --check-nans, 2 processes", {"strategy": "fsdp", **NAN}),
}  # fmt: skip


def _rank(rank: int, config: str, first: int, last: int, run_dir: Path, port: int) -> None:
    """One of 2 ranks (a spawned process): rank 0 writes its counts to run_dir/counts.json."""
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    os.environ.update(env)
    _, settings = DISTRIBUTED[config]
    with contextlib.redirect_stdout(sys.stderr):
        dist = detect("torchrun", env=env)
        counts = dmltrain_counts(config, first, last, run_dir, settings, dist)
    if rank == 0:
        (run_dir / "counts.json").write_text(json.dumps([counts.ops, counts.reads]))
    # as the dmltrain command leaves: without the interpreter's teardown, where a Gloo
    # thread now and then aborts the process after the run (about 1 exit in 8 here)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def two_process_counts(config: str, first: int, last: int, run_dir: Path) -> Counts:
    """``config`` of ``DISTRIBUTED`` on 2 processes: rank 0's counts."""
    run_dir.mkdir(parents=True, exist_ok=True)
    args = (config, first, last, run_dir, free_port())
    torch.multiprocessing.start_processes(_rank, args, nprocs=2, start_method="spawn")
    counts = Counts()
    counts.ops, counts.reads = json.loads((run_dir / "counts.json").read_text())
    return counts


def dmltrain_counts(
    config: str,
    first: int,
    last: int,
    run_dir: Path,
    settings: dict[str, Any] | None = None,
    dist: Any = None,
) -> Counts:
    _, own, trainer_cls = CONFIGS.get(config, ("", {}, Counted))
    settings = own if settings is None else settings
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
    trainer_cls(train, dist=dist).fit()
    return window.counts


def measure(first: int, last: int, run_dir: Path) -> dict[str, dict[str, float]]:
    """Per step: operators and host reads of the plain loop and of each configuration."""
    steps = last - first
    found = {"plain": plain(first, last), "plain-unfused": plain(first, last, fused=False)}
    for config in CONFIGS:
        with contextlib.redirect_stdout(sys.stderr):
            found[config] = dmltrain_counts(config, first, last, run_dir)
    if torch.cuda.device_count() != 1:  # 2 processes need 2 GPUs, or none (Gloo on the CPU)
        for config in DISTRIBUTED:
            found[config] = two_process_counts(config, first, last, run_dir / config)
    return {k: {"ops": c.ops / steps, "reads": c.reads / steps} for k, c in found.items()}


def table(counts: dict[str, dict[str, float]]) -> str:
    base = counts["plain"]
    lines = [
        "| run | operators a step | host reads a step | reads beyond the plain loop |",
        "|---|---|---|---|",
        f"| plain loop | {base['ops']:.1f} | {base['reads']:.2f} | |",
    ]
    unfused = counts["plain-unfused"]
    lines.append(f"| plain loop, non-fused Adam | {unfused['ops']:.1f} | {unfused['reads']:.2f} | "
                 f"{unfused['reads'] - base['reads']:+.2f} |")  # fmt: skip
    rows = [(config, typed) for config, (typed, _, _) in CONFIGS.items()]
    rows += [(config, typed) for config, (typed, _) in DISTRIBUTED.items()]
    for config, typed in rows:
        if config not in counts:
            continue
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
        f"Steps {first}-{last} of a 784-64-10 MLP, batch 64, Adam, on {DEVICE.type}; each a mean "
        "over the steps. A host read on a GPU waits for every kernel queued before it.\n\n"
        + table(counts)
    )
    print(markdown)
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1) + "\n")
    return {"markdown": markdown, "counts": counts}


if __name__ == "__main__":
    main()

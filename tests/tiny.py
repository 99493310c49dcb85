"""A tiny regression experiment: the fast stand-in for MNIST in mechanics tests."""

import atexit
import json
import os
import random
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

from dmltrain import BaseTrainer, Callback, Tracker, register_experiment
from dmltrain.features.tracking import TrackerStart


@dataclass(frozen=True)
class TinyOptions:
    samples: int = field(default=96, metadata={"help": "training samples"})
    features: int = field(default=4, metadata={"help": "input features"})
    save_weights: bool = field(default=False, metadata={"help": "save final_weights.pt"})
    die_rank: int = field(default=-1, metadata={"help": "this rank kills itself (SIGKILL)"})
    die_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    raise_rank: int = field(default=-1, metadata={"help": "a bug: this rank raises an error"})
    raise_at_step: int = field(default=-1, metadata={"help": "... in train_step at this global "
                               "step (-1: never; -2: in create_model)"})  # fmt: skip
    signal_rank: int = field(default=-1, metadata={"help": "this rank sends itself SIGUSR1"})
    signal_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    step_sleep: float = field(default=0.0, metadata={"help": "seconds to sleep each step"})
    slow_rank: int = field(default=-1, metadata={"help": "this rank sleeps --slow-seconds more"})
    slow_seconds: float = field(default=0.0, metadata={"help": "... in each train_step"})
    pause_at_step: int = field(default=0, metadata={"help": "sleep in this global step's"})
    pause_seconds: float = field(default=0.0, metadata={"help": "... train_step this long"})
    pause_rank: int = field(default=-1, metadata={"help": "... on this rank (-1: every rank)"})
    pause_stops: bool = field(
        default=False, metadata={"help": "... by stopping itself (SIGSTOP) instead: a frozen rank"}
    )
    data_sleep: float = field(
        default=0.0, metadata={"help": "seconds to sleep loading each training sample"}
    )
    data_sleep_rank: int = field(default=-1, metadata={"help": "... on this rank only"})
    first_job_only: bool = field(
        default=False,
        metadata={"help": "--step-sleep only in a Slurm job's first run (not once requeued)"},
    )
    nan_rank: int = field(default=-1, metadata={"help": "this rank injects a NaN"})
    nan_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    nan_into: str = field(default="loss", metadata={"help": "... into: loss or gradient"})
    exit_note: str = field(
        default="", metadata={"help": "an atexit handler writes PATH.RANK as the process ends"}
    )
    fill_disk_at_step: int = field(
        default=0, metadata={"help": "rank 0 fills the run directory's disk at this step"}
    )
    free_disk_at_step: int = field(default=0, metadata={"help": "... and frees it at this step"})
    fill_disk_leave: int = field(default=64, metadata={"help": "... leaving this many KiB"})
    dropout: float = field(default=0.0, metadata={"help": "dropout before the last layer"})
    augment: bool = field(
        default=False,
        metadata={"help": "random augmentation in __getitem__ (torch, numpy and random)"},
    )
    blocks: bool = field(
        default=False,
        metadata={
            "help": "two blocks with dropout and buffers; built.RANK says on which "
            "device each rank built the model, initial_weights.pt its first weights"
        },
    )
    wrapper_names: bool = field(
        default=False,
        metadata={"help": "a model whose submodules are named module and attn_module"},
    )
    prepare_log: str = field(
        default="", metadata={"help": "prepare_data appends 'HOST RANK' to this file"}
    )
    oom_at_step: int = field(
        default=0,
        metadata={
            "help": "run out of memory in this global step's train_step (on CUDA for real; "
            "on CPU, where no such error exists, by raising torch.OutOfMemoryError)"
        },
    )
    one_cycle: bool = field(
        default=False,
        metadata={"help": "a OneCycleLR schedule stepped each step over self.total_steps"},
    )
    schedule: str = field(
        default="",
        metadata={"help": "cosine or step: a schedule stepped each step, sized by total_steps"},
    )
    val_samples: int = field(default=32, metadata={"help": "validation samples"})
    test_samples: int = field(default=0, metadata={"help": "test samples (0: no test set)"})
    grad_norms_every: int = field(
        default=0, metadata={"help": "a callback logs each layer's gradient norm every N steps"}
    )
    listen_all: bool = field(
        default=False,
        metadata={"help": "a callback on every event writes what it saw to events.RANK.json"},
    )
    two_optimizers: str = field(
        default="",
        metadata={"help": "an optimizer for each Linear layer, stepped by the loop (auto) or "
                  "by train_step, which calls the layers one by one (manual); bypass: auto, "
                  "calling the layers one by one (a mistake under DDP)"},
    )  # fmt: skip
    fused: bool = field(
        default=False, metadata={"help": "--two-optimizers fused (they skip a NaN on the device)"}
    )
    own_names: bool = field(
        default=False,
        metadata={"help": "the trainer keeps its own step, monitor, state, budget and progress "
                  "attributes and writes them to RUN_DIR/own_names.RANK.json"},
    )  # fmt: skip
    rank_weights: bool = field(
        default=False, metadata={"help": "every rank saves its weights: final_weights.RANK.pt"}
    )
    exact_rmse: bool = field(
        default=False,
        metadata={"help": "val_rmse over the whole validation set (a torchmetrics object)"},
    )
    val_images: bool = field(
        default=False,
        metadata={"help": "a callback logs the first layer's weights as an image and as a "
                  "figure at each validation"},
    )  # fmt: skip
    stream: str = field(
        default="",
        metadata={"help": "the training set as an IterableDataset sharded by rank and worker: "
                  "stateful (state_dict/load_state_dict), stateless, or unsized (stateful, "
                  "no len)"},
    )  # fmt: skip
    own_loader: bool = field(
        default=False,
        metadata={"help": "create_dataloader returns torch's DataLoader (no place to save)"},
    )
    val_stream: bool = field(
        default=False, metadata={"help": "the validation set as a stream (stateful)"}
    )
    record_samples: bool = field(
        default=False,
        metadata={"help": "each rank appends 'EPOCH STEP INDEX...' of its batches to "
                  "RUN_DIR/samples.RANK.txt"},
    )  # fmt: skip


def tiny_data(o: TinyOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample: training, then validation, then test."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(o.samples + o.val_samples + o.test_samples, o.features, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g)
    return x, y


class WrapperNames(nn.Module):
    """Submodules named like wrappers' prefixes (DDP's ``module``): the names must survive
    a checkpoint of the wrapped model."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.module = nn.Linear(features, 8)
        self.attn_module = nn.Linear(8, 1)

    def forward(self, x):
        return self.attn_module(torch.tanh(self.module(x)))


class Block(nn.Module):
    """A layer with its own dropout (drawn again when its activations are recomputed), a
    batch norm (its statistics counted once all the same) and buffers, persistent or not
    (sent to every rank by FSDP's sharded initialisation)."""

    def __init__(self, features: int, dropout: float) -> None:
        super().__init__()
        # No bias before the batch norm: its gradient would be rounding noise alone, which
        # Adam scales up to steps of the learning rate, so that runs meant to agree within
        # rounding (an optimizer stepping on the CPU against one on the GPU) would not.
        self.linear = nn.Linear(features, 8, bias=False)
        self.norm = nn.BatchNorm1d(8)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 8))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)
        self.forwards = 0  # twice a training step when its activations are recomputed

    def forward(self, x):
        self.forwards += 1
        return self.dropout(torch.tanh(self.norm(self.linear(x))) * self.scale + self.shift)


class SlowSamples(Dataset):
    """Each sample takes ``seconds`` to load (a data-bound run)."""

    def __init__(self, inner: Dataset, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.inner[index]


class Augmented(Dataset):
    """Noise drawn from all three generators a data pipeline uses, in ``__getitem__``
    (in a DataLoader worker when --num-workers > 0)."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        x, y = self.inner[index]
        noise = torch.randn(x.shape) + float(np.random.randn()) + random.gauss(0.0, 1.0)
        return x + 0.05 * noise, y


class Stream(IterableDataset):
    """A user's stream: this rank's samples (every world-th), dealt out to the loader's
    workers, in order; it says where it is (samples of this worker's shard yielded in the
    pass), and begins a pass at set_epoch."""

    def __init__(self, inner: Dataset, rank: int, world_size: int) -> None:
        self.inner, self.rank, self.world_size = inner, rank, world_size
        self.position = 0

    def _shard(self) -> range:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.world_size * workers
        return range(self.rank + worker * self.world_size, len(self.inner), step)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.inner), self.world_size))

    def __iter__(self):
        shard = self._shard()
        while self.position < len(shard):
            index = shard[self.position]
            self.position += 1
            yield self.inner[index]

    def set_epoch(self, epoch):
        self.position = 0  # a new pass (a pass read to its end stays there until then)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class UnsizedStream(Stream):
    __len__ = None  # type: ignore[assignment]


class StatelessStream(IterableDataset):
    """The same samples, with no position to save (a generator over the shard)."""

    def __init__(self, inner: Dataset, rank: int, world_size: int) -> None:
        self.stream = Stream(inner, rank, world_size)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self):
        shard = self.stream._shard()
        return (self.stream.inner[i] for i in shard)


class GradNorms(Callback):
    """A user's callback: each layer's gradient norm every ``every`` steps, as scalars in
    the tracker, and a counter of what it logged that checkpoints keep."""

    def __init__(self, every: int) -> None:
        self.every, self.logged = every, 0

    def on_before_optimizer_step(self, trainer):
        step = trainer.global_step + 1  # the one being taken
        if step % self.every == 0:
            norms = {f"grad_norm/{name}": p.grad.norm() for name, p in
                     trainer.unwrapped_model.named_parameters() if p.grad is not None}  # fmt: skip
            self.logged += 1
            trainer.log_metrics({**norms, "grad_norms_logged": self.logged}, step)

    def state_dict(self):
        return {"logged": self.logged}

    def load_state_dict(self, state):
        self.logged = state["logged"]


class EveryEvent(Callback):
    """Listens to every event: what it saw goes to RUN_DIR/events.RANK.json at the end."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.steps: list[int] = []
        self.saved_at: list[int] = []  # the global step of each on_save_checkpoint
        self.loaded: list[list] = []  # each on_load_checkpoint: [file name, global step]

    def _saw(self, name: str) -> None:
        self.seen[name] = self.seen.get(name, 0) + 1

    def on_setup(self, trainer):
        self._saw("on_setup")

    def on_train_start(self, trainer):
        self._saw("on_train_start")

    def on_epoch_start(self, trainer):
        self._saw("on_epoch_start")

    def on_before_optimizer_step(self, trainer):
        self._saw("on_before_optimizer_step")

    def on_step_end(self, trainer):
        self._saw("on_step_end")
        self.steps.append(trainer.global_step)

    def on_log(self, trainer, values):
        self._saw("on_log")

    def on_validation_end(self, trainer, row):
        self._saw("on_validation_end")

    def on_epoch_end(self, trainer, row):
        self._saw("on_epoch_end")

    def on_save_checkpoint(self, trainer):
        self._saw("on_save_checkpoint")
        self.saved_at.append(trainer.global_step)

    def on_load_checkpoint(self, trainer, path):
        self._saw("on_load_checkpoint")
        self.loaded.append([path.name, trainer.global_step])

    def on_train_end(self, trainer):
        self._saw("on_train_end")

    def on_close(self, trainer, error):
        self._saw("on_close")
        path = trainer.run_dir / f"events.{trainer.dist.rank}.json"
        record = {"seen": self.seen, "steps": self.steps, "error": type(error).__name__,
                  "saved_at": self.saved_at, "loaded": self.loaded}  # fmt: skip
        path.write_text(json.dumps(record))


class JsonlTracker(Tracker):
    """An installed tracker (entry point ``jsonl``): RUN_DIR/tracked.jsonl, a line a call,
    under a run id it makes once and is given back in later jobs."""

    active = True

    def __init__(self, start: TrackerStart) -> None:
        self.run_id = start.run_id or f"run-{os.getpid()}"
        self.path = start.run_dir / "tracked.jsonl"
        self._write({"start": self.run_id, "step": start.global_step,
                     "lr": start.config["train"]["lr"]})  # fmt: skip

    def _write(self, record) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")

    def log(self, metrics, global_step):
        self._write({"step": global_step, **metrics})

    def finish(self, preempted=False):
        self._write({"finish": self.run_id, "preempted": preempted})


class FailingTracker(Tracker):
    """An installed tracker (entry point ``failing``) whose every log fails."""

    active = True

    def __init__(self, start: TrackerStart) -> None:
        pass

    def log(self, metrics, global_step):
        raise ConnectionError("the tracking server went away")


class WeightImages(Callback):
    """At each validation, rank 0 logs the first layer's weights as an image (squashed into
    [0, 1]) and as a matplotlib figure."""

    def on_validation_end(self, trainer, row):
        if not trainer.dist.is_main:
            return
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

        weights = torch.sigmoid(trainer.unwrapped_model[0].weight.detach())  # 8 x features
        trainer.log_image("val/weights", weights)
        figure, axes = pyplot.subplots(figsize=(2, 2))
        axes.imshow(weights.numpy())
        trainer.log_image("val/weights_figure", figure)
        pyplot.close(figure)


class TinyTrainer(BaseTrainer):
    name = "tiny"

    @property
    def opts(self) -> TinyOptions:
        return self.options or TinyOptions()

    def prepare_data(self) -> None:
        if self.opts.prepare_log:
            with open(self.opts.prepare_log, "a") as log:
                log.write(f"{socket.gethostname()} {self.dist.rank}\n")

    def create_model(self) -> nn.Module:
        self.manual_optimization = self.opts.two_optimizers == "manual"
        if self.dist.rank == self.opts.raise_rank and self.opts.raise_at_step == -2:
            raise RuntimeError("a bug in create_model")
        if self.opts.exit_note:  # an experiment's own clean-up, as a user would register it
            note = f"{self.opts.exit_note}.{self.dist.rank}"
            atexit.register(lambda: open(note, "w").close())
        if self.opts.wrapper_names:
            return WrapperNames(self.opts.features)
        if self.opts.blocks:
            model = nn.Sequential(Block(self.opts.features, self.opts.dropout),
                                  Block(8, self.opts.dropout), nn.Linear(8, 1))  # fmt: skip
            device = next(model.parameters()).device.type
            (self.run_dir / f"built.{self.dist.rank}").write_text(device)
            return model
        layers = [nn.Linear(self.opts.features, 8), nn.Tanh(), nn.Linear(8, 1)]
        if self.opts.dropout:
            layers.insert(2, nn.Dropout(self.opts.dropout))
        return nn.Sequential(*layers)

    def on_train_start(self):
        if self.opts.blocks and self.global_step == 0:
            weights = self.whole_weights()
            if self.dist.is_main:
                torch.save(weights, self.run_dir / "initial_weights.pt")
        if self.opts.own_names:  # names a user may pick that the engine used to own
            self.step, self.monitor, self.state = 0, "mine", {"seen": 0}
            self.budget, self.progress, self.checkpointer = 1.0, [], None

    def create_callbacks(self):
        made = [EveryEvent()] if self.opts.listen_all else []
        if self.opts.val_images:
            made.append(WeightImages())
        if self.opts.grad_norms_every:
            made.append(GradNorms(self.opts.grad_norms_every))
        return made

    def create_optimizer(self, model):
        if not self.opts.two_optimizers:
            return super().create_optimizer(model)
        layers = [m for m in self.unwrapped_model if isinstance(m, nn.Linear)]
        fused = self.opts.fused or None
        return [torch.optim.Adam(layers[0].parameters(), lr=1e-3, fused=fused),
                torch.optim.SGD(layers[-1].parameters(), lr=1e-2, momentum=0.9,
                                fused=fused)]  # fmt: skip

    def create_scheduler(self, optimizer):
        lr = torch.optim.lr_scheduler
        if self.opts.schedule:
            self.scheduler_interval = "step"
            if self.opts.schedule == "cosine":
                return lr.CosineAnnealingLR(optimizer, T_max=self.total_steps)
            return lr.StepLR(optimizer, step_size=max(1, self.total_steps // 3), gamma=0.1)
        if not self.opts.one_cycle:
            return super().create_scheduler(optimizer)
        self.scheduler_interval = "step"  # it raises if stepped more than total_steps times
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.01, total_steps=self.total_steps)

    def create_datasets(self):
        x, y = self._data()
        n, val = self.opts.samples, self.opts.val_samples
        train = TensorDataset(x[:n], y[:n])
        if self.opts.record_samples:
            train = TensorDataset(x[:n], y[:n], torch.arange(n))
        validation = TensorDataset(x[n : n + val], y[n : n + val])
        if self.opts.val_stream:
            validation = Stream(validation, self.dist.rank, self.dist.world_size)
        train = Augmented(train) if self.opts.augment else train
        o = self.opts
        if o.stream:
            kind = {"stateful": Stream, "stateless": StatelessStream, "unsized": UnsizedStream}
            train = kind[o.stream](train, self.dist.rank, self.dist.world_size)
        if o.data_sleep and o.data_sleep_rank in (-1, self.dist.rank):
            train = SlowSamples(train, o.data_sleep)
        return train, validation

    def _data(self):
        return tiny_data(self.opts)

    def create_dataloader(self, dataset, train):
        if not self.opts.own_loader:
            return super().create_dataloader(dataset, train)
        return DataLoader(dataset, batch_size=self.config.batch_size)

    def create_test_dataset(self):
        if not self.opts.test_samples:
            return None
        x, y = self._data()
        start = self.opts.samples + self.opts.val_samples
        return TensorDataset(x[start:], y[start:])

    def test_step(self, batch):
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y), "mae": F.l1_loss(self.model(x), y)}

    def predict_step(self, batch):
        x, _ = batch
        return {"y": self.model(x)}

    def train_step(self, batch):
        o = self.opts
        if self.dist.rank == self.opts.die_rank and self.global_step == self.opts.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.dist.rank == o.raise_rank and self.global_step == o.raise_at_step:
            raise RuntimeError(f"a bug in train_step at step {self.global_step}")
        if self.dist.rank == self.opts.signal_rank and self.global_step == self.opts.signal_at_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.dist.is_main and self.global_step in {o.fill_disk_at_step, o.free_disk_at_step} - {
            0
        }:
            filler = self.run_dir / "filler"
            if self.global_step == o.free_disk_at_step:
                filler.unlink()
            else:  # 64 KiB by default: a checkpoint no longer fits, the training log does
                with open(filler, "wb") as handle:
                    free = shutil.disk_usage(self.run_dir).free
                    os.posix_fallocate(handle.fileno(), 0, free - (o.fill_disk_leave << 10))
        requeued = os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
        if self.opts.step_sleep and not (self.opts.first_job_only and requeued):
            time.sleep(self.opts.step_sleep)  # a slow step, so a test can signal mid-run
        if self.dist.rank == o.slow_rank:
            time.sleep(o.slow_seconds)  # a straggler
        if self.global_step + 1 == o.pause_at_step and o.pause_rank in (-1, self.dist.rank):
            if o.pause_stops:  # its threads stop too: no stack, no answer
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(o.pause_seconds)  # a long step, or a rank blocked (a hang)
        if self.global_step + 1 == o.oom_at_step:
            if self.device.type == "cuda":
                torch.empty(1 << 50, device=self.device)  # a petabyte: a real allocator failure
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 TiB")
        x, y, *index = batch
        if self.opts.own_names and self.model.training:  # not in validation's val_step
            self.step += 1
            self.state["seen"] += len(x)
            self.progress.append(self.global_step)
        if index:
            with open(self.run_dir / f"samples.{self.dist.rank}.txt", "a") as record:
                shown = " ".join(str(int(i)) for i in index[0])
                record.write(f"{self.epoch + 1} {self.step_in_epoch + 1} {shown}\n")
        if self.opts.two_optimizers == "bypass":  # a user's mistake under DDP
            for layer in self.unwrapped_model:
                x = layer(x)
            return F.mse_loss(x, y)
        if self.manual_optimization:  # each layer called on its own: no wrapper's hooks
            for layer in self.model:
                x = layer(x)
            loss = F.mse_loss(x, y)
            if self._injecting("loss"):
                loss = loss * float("nan")
            self.backward(loss)
            for optimizer in self.optimizers:
                self.optimizer_step(optimizer)
            return loss
        loss = F.mse_loss(self.model(x), y)
        if self._injecting("loss"):
            loss = loss * float("nan")
        return loss

    def create_metrics(self):
        if not self.opts.exact_rmse:
            return {}
        from torchmetrics import MeanSquaredError

        return {"rmse": MeanSquaredError(squared=False)}

    def val_step(self, batch):
        if self.opts.exact_rmse:
            x, y = batch
            prediction = self.model(x)
            return {"loss": F.mse_loss(prediction, y), "rmse": (prediction, y)}
        if not self.manual_optimization:
            return super().val_step(batch)
        x, y, *_ = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def _injecting(self, into: str) -> bool:
        o = self.opts
        return (o.nan_into, self.dist.rank, self.global_step) == (into, o.nan_rank, o.nan_at_step)

    def on_after_backward(self):
        if self._injecting("gradient"):  # after DDP's all-reduce: this rank alone sees it
            self.strategy.eval_model(self.model)[-1].weight.grad[0, 0] = float("inf")

    def whole_weights(self, every_rank: bool = False) -> dict:
        """The model's whole weights on the CPU under their experiment names (on rank 0
        alone for a sharded model unless every_rank), told apart as the checkpointer tells
        them. torch's state-dict API is imported only for a sharded model: importing it is
        much of a process's start-up, and most of the suite's processes run this experiment."""
        if self.strategy.name != "fsdp":  # FSDP and HSDP
            return {
                k: v.detach().cpu().clone() for k, v in self.unwrapped_model.state_dict().items()
            }
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
        return {k: v.cpu() for k, v in get_model_state_dict(self.model, options=options).items()}

    def on_train_end(self):
        if self.opts.blocks:
            forwards = sum(
                m.forwards for m in self.unwrapped_model.modules() if isinstance(m, Block)
            )
            (self.run_dir / f"forwards.{self.dist.rank}").write_text(str(forwards))
        if self.opts.own_names:
            mine = {"step": self.step, "monitor": self.monitor, "state": self.state,
                    "budget": self.budget, "progress": self.progress}  # fmt: skip
            (self.run_dir / f"own_names.{self.dist.rank}.json").write_text(json.dumps(mine))
        if self.opts.save_weights or self.opts.rank_weights:
            weights = self.whole_weights()
            if self.dist.is_main and self.opts.save_weights:
                torch.save(weights, self.run_dir / "final_weights.pt")
            if self.opts.rank_weights:  # cpu_offload gives rank 0 alone the weights
                weights = self.whole_weights(every_rank=True)
                torch.save(weights, self.run_dir / f"final_weights.{self.dist.rank}.pt")


EXPERIMENT = register_experiment("tiny", TinyTrainer, TinyOptions, help="tiny regression (tests)")

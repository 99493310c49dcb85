"""A tiny regression experiment: the fast stand-in for MNIST in mechanics tests."""

import atexit
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, register_experiment


@dataclass(frozen=True)
class TinyOptions:
    samples: int = field(default=96, metadata={"help": "training samples"})
    features: int = field(default=4, metadata={"help": "input features"})
    save_weights: bool = field(default=False, metadata={"help": "save final_weights.pt"})
    die_rank: int = field(default=-1, metadata={"help": "this rank kills itself (SIGKILL)"})
    die_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    signal_rank: int = field(default=-1, metadata={"help": "this rank sends itself SIGUSR1"})
    signal_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    step_sleep: float = field(default=0.0, metadata={"help": "seconds to sleep each step"})
    nan_rank: int = field(default=-1, metadata={"help": "this rank injects a NaN"})
    nan_at_step: int = field(default=0, metadata={"help": "... at this global step"})
    nan_into: str = field(default="loss", metadata={"help": "... into: loss or gradient"})
    exit_note: str = field(
        default="", metadata={"help": "an atexit handler writes PATH.RANK as the process ends"}
    )


class TinyTrainer(BaseTrainer):
    name = "tiny"

    @property
    def opts(self) -> TinyOptions:
        return self.options or TinyOptions()

    def create_model(self) -> nn.Module:
        if self.opts.exit_note:  # an experiment's own clean-up, as a user would register it
            note = f"{self.opts.exit_note}.{self.dist.rank}"
            atexit.register(lambda: open(note, "w").close())
        return nn.Sequential(nn.Linear(self.opts.features, 8), nn.Tanh(), nn.Linear(8, 1))

    def create_datasets(self):
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(self.opts.samples + 32, self.opts.features, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g)
        n = self.opts.samples
        return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])

    def train_step(self, batch):
        if self.dist.rank == self.opts.die_rank and self.global_step == self.opts.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.dist.rank == self.opts.signal_rank and self.global_step == self.opts.signal_at_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.opts.step_sleep:
            time.sleep(self.opts.step_sleep)  # a slow step, so a test can signal mid-run
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        if self._injecting("loss"):
            loss = loss * float("nan")
        return loss

    def _injecting(self, into: str) -> bool:
        o = self.opts
        return (o.nan_into, self.dist.rank, self.global_step) == (into, o.nan_rank, o.nan_at_step)

    def on_after_backward(self):
        if self._injecting("gradient"):  # after DDP's all-reduce: this rank alone sees it
            self.strategy.eval_model(self.model)[2].weight.grad[0, 0] = float("inf")

    def on_train_end(self):
        if self.opts.save_weights:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.model, options=options)
            if self.dist.is_main:
                torch.save(weights, self.run_dir / "final_weights.pt")


EXPERIMENT = register_experiment("tiny", TinyTrainer, TinyOptions, help="tiny regression (tests)")

"""A tiny regression experiment: the fast stand-in for MNIST in mechanics tests.

Each concern's options and code live in its own module: ``tiny_faults`` (injected faults),
``tiny_streams`` (data variants), ``tiny_models`` (models, optimizers, schedules) and
``tiny_listeners`` (callbacks, trackers). This one holds the regression and what a test
reads back of a run (weights, the names a user keeps)."""

import json
import socket
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dmltrain import BaseTrainer, register_experiment
from tiny_faults import FaultOptions, after_backward, at_model, before_step, injecting, slowed
from tiny_listeners import ListenerOptions, callbacks
from tiny_models import Block, ModelOptions, model, scheduler, two_optimizers
from tiny_streams import Stream, StreamOptions, training


@dataclass(frozen=True)
class TinyOptions(ListenerOptions, StreamOptions, ModelOptions, FaultOptions):
    samples: int = field(default=96, metadata={"help": "training samples"})
    features: int = field(default=4, metadata={"help": "input features"})
    val_samples: int = field(default=32, metadata={"help": "validation samples"})
    test_samples: int = field(default=0, metadata={"help": "test samples (0: no test set)"})
    save_weights: bool = field(default=False, metadata={"help": "save final_weights.pt"})
    rank_weights: bool = field(
        default=False, metadata={"help": "every rank saves its weights: final_weights.RANK.pt"}
    )
    prepare_log: str = field(
        default="", metadata={"help": "prepare_data appends 'HOST RANK' to this file"}
    )
    exact_rmse: bool = field(
        default=False,
        metadata={"help": "val_rmse over the whole validation set (a torchmetrics object)"},
    )
    own_names: bool = field(
        default=False,
        metadata={"help": "the trainer keeps its own step, monitor, state, budget and progress "
                  "attributes and writes them to RUN_DIR/own_names.RANK.json"},
    )  # fmt: skip


def tiny_data(o: TinyOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample: training, then validation, then test."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(o.samples + o.val_samples + o.test_samples, o.features, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g)
    return x, y


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
        at_model(self, self.opts)
        made, blocks = model(self.opts.features, self.opts)
        if blocks:
            device = next(made.parameters()).device.type
            (self.run_dir / f"built.{self.dist.rank}").write_text(device)
        return made

    def on_train_start(self):
        if self.opts.blocks and self.global_step == 0:
            weights = self.whole_weights()
            if self.dist.is_main:
                torch.save(weights, self.run_dir / "initial_weights.pt")
        if self.opts.own_names:  # names a user may pick that the engine used to own
            self.step, self.monitor, self.state = 0, "mine", {"seen": 0}
            self.budget, self.progress, self.checkpointer = 1.0, [], None

    def create_callbacks(self):
        return callbacks(self.opts)

    def create_optimizer(self, model):
        if not self.opts.two_optimizers:
            return super().create_optimizer(model)
        return two_optimizers(self.unwrapped_model, self.opts)

    def create_scheduler(self, optimizer):
        if not (self.opts.schedule or self.opts.one_cycle):
            return super().create_scheduler(optimizer)
        self.scheduler_interval = "step"
        return scheduler(optimizer, self.opts, self.total_steps)

    def create_datasets(self):
        x, y = tiny_data(self.opts)
        n, val = self.opts.samples, self.opts.val_samples
        train = TensorDataset(x[:n], y[:n])
        if self.opts.record_samples:
            train = TensorDataset(x[:n], y[:n], torch.arange(n))
        validation = TensorDataset(x[n : n + val], y[n : n + val])
        if self.opts.val_stream:
            validation = Stream(validation, self.dist.rank, self.dist.world_size)
        train = training(train, self.opts, self.dist.rank, self.dist.world_size)
        return slowed(train, self, self.opts), validation

    def create_dataloader(self, dataset, train):
        if not self.opts.own_loader:
            return super().create_dataloader(dataset, train)
        return DataLoader(dataset, batch_size=self.config.batch_size,
                          shuffle=train and self.opts.own_shuffle,
                          num_workers=self.config.num_workers if self.opts.own_shuffle
                          else 0)  # fmt: skip

    def create_test_dataset(self):
        if not self.opts.test_samples:
            return None
        x, y = tiny_data(self.opts)
        start = self.opts.samples + self.opts.val_samples
        return TensorDataset(x[start:], y[start:])

    def test_step(self, batch):
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y), "mae": F.l1_loss(self.model(x), y)}

    def predict_step(self, batch):
        x, _ = batch
        return {"y": self.model(x)}

    def train_step(self, batch):
        before_step(self, self.opts)
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
            if injecting(self, self.opts, "loss"):
                loss = loss * float("nan")
            self.backward(loss)
            for optimizer in self.optimizers:
                self.optimizer_step(optimizer)
            return loss
        loss = F.mse_loss(self.model(x), y)
        if injecting(self, self.opts, "loss"):
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

    def on_after_backward(self):
        after_backward(self, self.opts)

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

"""What an experiment gives the loop: the three methods it must write (model, data, the
loss of a step) and those it may override (optimizer, scheduler, validation metrics,
data loaders, FSDP units, and hooks called at points of the loop).

``BaseTrainer`` (``dmltrain.trainer``) runs the loop around them; subclass it.
"""

import abc
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

from dmltrain import compat
from dmltrain.config import TrainConfig
from dmltrain.data import streams
from dmltrain.data.batches import StepOutput, split_step_output
from dmltrain.errors import UserError
from dmltrain.runtime import finetune
from dmltrain.runtime.strategies import Strategy, unwrap


class TrainerHooks(abc.ABC):
    """The experiment's side of ``BaseTrainer``."""

    scheduler_interval = "epoch"  # or "step": when the LR scheduler steps
    # True: train_step makes its own updates with self.backward(loss) and
    # self.optimizer_step(optimizer) (several models and optimizers, e.g. a GAN)
    manual_optimization = False
    config: TrainConfig
    strategy: Strategy
    device: torch.device

    # ----- what an experiment provides -------------------------------------------------
    @abc.abstractmethod
    def create_model(self) -> nn.Module:
        """The model, on the CPU; the trainer moves and wraps it."""

    @abc.abstractmethod
    def create_datasets(self) -> tuple[Dataset, Dataset | None]:
        """The training dataset and the validation dataset (or None)."""

    @abc.abstractmethod
    def train_step(self, batch: Any) -> StepOutput:
        """The loss of one batch (already on the device), optionally with a dict of metrics."""

    def create_optimizer(self, model: nn.Module) -> Any:
        """The optimizer, or a list of several (each over its own parameters); by default
        --optimizer over the parameters that train (not --freeze's), a group for each
        --lr-scale."""
        cfg = self.config
        groups = finetune.param_groups(unwrap(model), cfg.lr, cfg.lr_scale)
        params = [p for group in groups for p in group["params"]]
        # fused where torch has the kernel: one launch for all the parameters, faster on the
        # CPU too, and it skips a non-finite step on the device (--check-nans, fp16)
        kernels = compat.fused_devices()
        fused = bool(params) and all(p.device.type in kernels for p in params)
        kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}.get(cfg.optimizer)
        optimizer_cls = kind or torch.optim.Adam
        return optimizer_cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)

    def create_scheduler(self, optimizer: Any) -> Any:
        """An LR scheduler stepped every epoch (or step, see ``scheduler_interval``), or a
        list of several; None. With several optimizers, ``optimizer`` is their tuple."""
        return None

    def val_step(self, batch: Any) -> Mapping[str, Tensor | float | tuple[Any, Any]]:
        """Validation metrics of one batch; by default the training loss. Each is averaged
        over the samples of every batch and rank; one given as ``(value, weight)`` (e.g.
        ``(loss, tokens)``) is averaged by its weight instead."""
        if self.manual_optimization:
            raise UserError(
                f"{type(self).__name__} has manual_optimization: define val_step(batch) "
                "(the default would run train_step, which updates the model)"
            )
        loss, metrics = split_step_output(self.train_step(batch))
        return {"loss": loss, **metrics}

    def create_metrics(self) -> Mapping[str, Any]:
        """Metrics over the whole validation (and test) set that a mean of batches cannot
        give: torchmetrics ``Metric`` objects by name, e.g. ``{"rmse":
        MeanSquaredError(squared=False)}``. ``val_step`` returns the arguments of each one's
        ``update`` under its name (``{"loss": loss, "rmse": (prediction, target)}``); its
        value over every rank's samples is logged as ``val_<name>``. None by default."""
        return {}

    def create_test_dataset(self) -> Dataset | None:
        """A test dataset for ``--evaluate`` (``test_*`` metrics) and ``--predict``; None."""
        return None

    def test_step(self, batch: Any) -> Mapping[str, Tensor | float | tuple[Any, Any]]:
        """Test metrics of one batch (``--evaluate``); by default ``val_step``'s."""
        return self.val_step(batch)

    def predict_step(self, batch: Any) -> Any:
        """What ``--predict`` writes for one batch: a tensor with a row a sample, or a dict,
        tuple or list of those. No default: an experiment that predicts defines it."""
        raise NotImplementedError

    def flops_per_sample(self) -> float | None:
        """Training FLOPs of one sample (forward and backward, about 3x the forward's), for
        the achieved TFLOP/s and MFU at each log interval; None: not shown."""
        return None

    def prepare_data(self) -> None:
        """Download or unpack data; runs on one process per node before create_datasets."""

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules that become FSDP units (then the root): children that own parameters."""
        return [child for child in model.children() if any(True for _ in child.parameters())]

    def checkpointed_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose activations ``--activation-checkpointing`` recomputes in the
        backward (the blocks of a transformer, say): by default the FSDP units."""
        return self.fsdp_units(model)

    def create_dataloader(self, dataset: Dataset, train: bool) -> DataLoader:
        """A loader of ``dataset``: dmltrain's samplers for a map-style one; for an
        ``IterableDataset``, one that saves the stream's position (``data.streams``)."""
        cfg = self.config
        # pinned where loader workers fill it (a thread of the loader pins their batches);
        # without workers the training loop itself would copy each batch once more
        pin = self.device.type == "cuda" and cfg.num_workers > 0
        if streams.is_stream(dataset):
            return streams.loader(dataset, cfg.batch_size, cfg.num_workers, pin)
        sampler: Sampler[tuple[int, int] | int] = (
            self.strategy.train_sampler(dataset, cfg.seed, cfg.shuffle)
            if train
            else self.strategy.val_sampler(dataset)
        )
        return DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=pin,
            persistent_workers=cfg.num_workers > 0,
            drop_last=train and cfg.drop_last,
        )

    def create_callbacks(self) -> list[Any]:
        """The run's ``dmltrain.Callback`` objects, made in every process; none by default.
        ``--callbacks`` adds installed ones after these."""
        return []

    def create_states(self) -> Mapping[str, Any]:
        """Objects of the experiment whose ``state_dict()`` checkpoints keep (restored with
        ``load_state_dict`` on resume), by a key of your choosing; none by default. Called
        once in setup, after the model, data and optimizer are made."""
        return {}

    # ----- optional hooks ----------------------------------------------------------------
    def on_train_start(self) -> None:
        """Called once, after setup, before the first epoch."""

    def on_epoch_start(self, epoch: int) -> None:
        """Called before each epoch (0-based)."""

    def on_validation_start(self) -> None:
        """Called before each validation (at an epoch's end, and within it with
        --val-every-steps), the model in eval mode after."""

    def on_validation_end(self, row: dict[str, Any]) -> None:
        """Called after each validation with its row of the training log (``val_*``
        included), before callbacks' ``on_validation_end`` and ``best_value`` is updated."""

    def on_epoch_end(self, epoch: int, metrics: dict[str, float]) -> None:
        """Called after each epoch with the row just written to the training log, after the
        epoch's scheduler step and before the epoch's checkpoint (which keeps what it
        changed)."""

    def on_train_end(self) -> None:
        """Called once after the last epoch."""

    def on_after_backward(self) -> None:
        """Called after the backward pass(es) of a step, before gradients are checked,
        clipped and applied. They may still be scaled (fp16) and, under Horovod, not yet
        summed over the ranks: a ``Callback``'s ``on_before_optimizer_step`` sees them final."""

"""The tiny experiment's model variants, optimizers and schedules."""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class ModelOptions:
    dropout: float = field(default=0.0, metadata={"help": "dropout before the last layer"})
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
    one_cycle: bool = field(
        default=False,
        metadata={"help": "a OneCycleLR schedule stepped each step over self.total_steps"},
    )
    schedule: str = field(
        default="",
        metadata={
            "help": "cosine, step, lambda, warm-restarts, sequential, chained or one-cycle: "
            "a schedule stepped each step, sized by total_steps; plateau: ReduceLROnPlateau "
            "on val_loss"
        },
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
    spectral: str = field(
        default="",
        metadata={"help": "old or new: spectral norm on the first layer (each block's: --blocks)"},
    )
    transformer: bool = field(
        default=False,
        metadata={"help": "a small transformer over the features as tokens (LoRA's tests)"},
    )


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


class Attention(nn.Module):
    """One transformer block: self-attention over the tokens (q, k, v, o), then an MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        weights = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        x = self.norm(x + self.o(weights @ v))
        return x + self.down(torch.relu(self.up(x)))


class Transformer(nn.Module):
    """Each feature a token: embedded, two blocks, pooled, one output."""

    def __init__(self, features: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(1, width)
        self.position = nn.Parameter(torch.randn(features, width) * 0.02)
        self.blocks = nn.Sequential(Attention(width), Attention(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        tokens = self.embed(x.unsqueeze(-1)) + self.position
        return self.head(self.blocks(tokens).mean(dim=1))


def model(features: int, o: ModelOptions) -> tuple[nn.Module, bool]:
    """The model --wrapper-names, --blocks, --transformer and --dropout ask for; whether it
    is --blocks'."""
    if o.transformer:
        return Transformer(features), False
    if o.wrapper_names:
        return WrapperNames(features), False
    if o.blocks:
        blocks = nn.Sequential(Block(features, o.dropout), Block(8, o.dropout), nn.Linear(8, 1))
        for block in blocks[:2] if o.spectral else []:
            _spectral(block.linear, o.spectral)
        return blocks, True
    layers = [nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1)]
    if o.dropout:
        layers.insert(2, nn.Dropout(o.dropout))
    if o.spectral:
        _spectral(layers[0], o.spectral)
    return nn.Sequential(*layers), False


def _spectral(layer: nn.Module, api: str) -> None:
    """Spectral norm on ``layer`` by torch's old API or its new one (a parametrization)."""
    if api == "old":
        nn.utils.spectral_norm(layer)
    else:
        nn.utils.parametrizations.spectral_norm(layer)


def two_optimizers(model: nn.Module, o: ModelOptions) -> list[torch.optim.Optimizer]:
    """--two-optimizers: Adam for the first Linear layer, SGD for the last."""
    layers = [m for m in model if isinstance(m, nn.Linear)]
    fused = o.fused or None
    return [torch.optim.Adam(layers[0].parameters(), lr=1e-3, fused=fused),
            torch.optim.SGD(layers[-1].parameters(), lr=1e-2, momentum=0.9,
                            fused=fused)]  # fmt: skip


def scheduler(optimizer, o: ModelOptions, total_steps: int):
    """--schedule or --one-cycle (one of them is given), stepped each step."""
    lr = torch.optim.lr_scheduler
    if o.schedule == "plateau":  # stepped on each validation's val_loss; "max": it halves
        return lr.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
    if o.schedule == "cosine":
        return lr.CosineAnnealingLR(optimizer, T_max=total_steps)
    if o.schedule == "lambda":  # a lambda: LambdaLR's state leaves it out, create_scheduler
        return lr.LambdaLR(optimizer, lambda step: 0.95**step)  # makes it again
    if o.schedule == "warm-restarts":
        return lr.CosineAnnealingWarmRestarts(optimizer, T_0=5, T_mult=2)
    if o.schedule == "sequential":
        warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=5)
        cosine = lr.CosineAnnealingLR(optimizer, T_max=total_steps - 5)
        return lr.SequentialLR(optimizer, [warmup, cosine], milestones=[5])
    if o.schedule == "chained":
        return lr.ChainedScheduler(
            [lr.ConstantLR(optimizer, factor=0.5, total_iters=4), lr.ExponentialLR(optimizer, 0.97)]
        )
    if o.schedule == "one-cycle":
        return lr.OneCycleLR(optimizer, 0.01, total_steps=total_steps)
    if o.schedule:
        return lr.StepLR(optimizer, step_size=max(1, total_steps // 3), gamma=0.1)
    return lr.OneCycleLR(optimizer, 0.01, total_steps=total_steps)  # raises past total_steps

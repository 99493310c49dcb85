"""MNIST GAN: a small DCGAN (a generator and a discriminator, each with its own Adam) with
the manual step: ``train_step`` updates the discriminator, then the generator.

``dmltrain mnist-gan --epochs 1`` trains on the bundled sample when full MNIST is missing.
Validation reports how the discriminator tells real digits from generated ones.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dmltrain import BaseTrainer, register_experiment

from . import mnist_data
from .mnist import MnistOptions, MnistTrainer


@dataclass(frozen=True)
class GanOptions(MnistOptions):  # and the data's options: --no-download, --mirrors...
    latent: int = field(default=64, metadata={"help": "size of the generator's noise vector"})
    width: int = field(default=32, metadata={"help": "channels of the first conv layers"})
    d_lr: float = field(default=2e-4, metadata={"help": "the discriminator's learning rate"})
    g_lr: float = field(default=2e-4, metadata={"help": "the generator's learning rate"})
    save_samples: bool = field(
        default=False, metadata={"help": "save 64 generated digits to RUN_DIR/samples.pt"}
    )


class Generator(nn.Module):
    """Noise -> 28x28 digit, normalised as the data are (mnist_data.MEAN, STD)."""

    def __init__(self, latent: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.project = nn.Linear(latent, 2 * width * 7 * 7)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 4, 2, 1)  # 7 -> 14
        self.norm = nn.GroupNorm(8, width)  # no running statistics to keep equal on ranks
        self.up2 = nn.ConvTranspose2d(width, 1, 4, 2, 1)  # 14 -> 28

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.project(z)).view(-1, 2 * self.width, 7, 7)
        x = F.relu(self.norm(self.up1(x)))
        pixels = (torch.tanh(self.up2(x)) + 1) / 2  # in [0, 1]
        return (pixels - mnist_data.MEAN) / mnist_data.STD


class Discriminator(nn.Module):
    """28x28 digit -> the logit of its being real."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.down1 = nn.Conv2d(1, width, 4, 2, 1)  # 28 -> 14
        self.down2 = nn.Conv2d(width, 2 * width, 4, 2, 1)  # 14 -> 7
        self.norm = nn.GroupNorm(8, 2 * width)
        self.out = nn.Linear(2 * width * 7 * 7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.down1(x), 0.2)
        x = F.leaky_relu(self.norm(self.down2(x)), 0.2)
        return self.out(torch.flatten(x, 1)).squeeze(1)


class GAN(nn.Module):
    def __init__(self, latent: int, width: int) -> None:
        super().__init__()
        self.generator = Generator(latent, width)
        self.discriminator = Discriminator(width)


def real_or_fake(logits: torch.Tensor, real: bool) -> torch.Tensor:
    target = torch.ones_like(logits) if real else torch.zeros_like(logits)
    return F.binary_cross_entropy_with_logits(logits, target)


class GanTrainer(MnistTrainer):  # its data (prepare_data, create_datasets)
    name = "mnist-gan"
    manual_optimization = True  # train_step makes both updates
    predict_step = BaseTrainer.predict_step  # none

    @property
    def opts(self) -> GanOptions:
        return self.options or GanOptions()

    def create_model(self) -> nn.Module:
        return GAN(self.opts.latent, self.opts.width)

    def create_optimizer(self, model):
        gan = self.unwrapped_model
        # fused (CPU and CUDA kernels): one launch an update, and --check-nans skips a
        # non-finite update on the device instead of waiting for its check each step
        kw = {"betas": (0.5, 0.999), "fused": self.device.type in ("cpu", "cuda") or None}
        return [
            torch.optim.Adam(gan.generator.parameters(), lr=self.opts.g_lr, **kw),
            torch.optim.Adam(gan.discriminator.parameters(), lr=self.opts.d_lr, **kw),
        ]

    def flops_per_sample(self) -> None:
        return None

    def train_step(self, batch):
        real, _ = batch
        g_opt, d_opt = self.optimizers
        gan = self.model  # under FSDP each half is an FSDP unit of its own
        fake = gan.generator(torch.randn(len(real), self.opts.latent, device=real.device))
        d_loss = real_or_fake(gan.discriminator(real), True)
        d_loss = d_loss + real_or_fake(gan.discriminator(fake.detach()), False)
        self.backward(d_loss, d_opt)
        self.optimizer_step(d_opt)
        g_loss = real_or_fake(gan.discriminator(fake), True)  # the updated discriminator
        self.backward(g_loss, g_opt)  # only the generator keeps these gradients
        self.optimizer_step(g_opt)
        return g_loss.detach(), {"d_loss": d_loss.detach()}

    def val_step(self, batch):
        real, _ = batch
        gan = self.model
        noise = torch.Generator().manual_seed(len(real))  # the same fakes at every validation
        z = torch.randn(len(real), self.opts.latent, generator=noise).to(real.device)
        real_logits, fake_logits = gan.discriminator(real), gan.discriminator(gan.generator(z))
        return {
            "d_loss": real_or_fake(real_logits, True) + real_or_fake(fake_logits, False),
            "loss": real_or_fake(fake_logits, True),  # the generator's, as in training
            "d_acc": ((real_logits > 0).float().mean() + (fake_logits < 0).float().mean()) / 2,
        }

    def on_train_end(self) -> None:
        if self.opts.save_samples:  # every rank runs the generator (FSDP gathers its shards)
            with torch.no_grad():
                z = torch.randn(64, self.opts.latent, generator=torch.Generator().manual_seed(0))
                samples = self.model.generator(z.to(self.device))
            if self.dist.is_main:
                torch.save(samples.cpu(), self.run_dir / "samples.pt")


EXPERIMENT = register_experiment(
    "mnist-gan", GanTrainer, GanOptions, help="a small DCGAN on MNIST (two optimizers)"
)

"""pytorch/examples' dcgan/main.py (``--dataset fake``) as a dmltrain experiment.

Its model, weight initialisation and loss code are the script's, as they are (copied whole
under the BSD-3-Clause licence of pytorch/examples; tests/test_ports.py checks them against
the script). The classes read the script's module-level ``nz``, ``ngf``, ``ndf`` and
``nc``: ``create_model`` sets them from the options, as the script's argparse did.

What the port changed: ``loss.backward()`` and ``optimizer.step()`` became
``self.backward(loss)`` and ``self.optimizer_step(optimizer)`` (manual optimization: two
models, two optimizers), the loader is the script's own (``create_dataloader``), the fixed
noise is drawn in ``create_model`` right after the models as the script draws it, and the
images go to the run directory. The script seeds once (``--seed-once``)."""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
from ports.vision import torchvision

from dmltrain import BaseTrainer, register_experiment

torchvision()
import torchvision.datasets as dset  # noqa: E402
import torchvision.transforms as transforms  # noqa: E402
import torchvision.utils as vutils  # noqa: E402

# the script's globals that its classes read (its argparse options); create_model sets them
nz = ngf = ndf = nc = 0
real_label = 1
fake_label = 0


# fmt: off
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super(Generator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(     nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            # state size. (ngf*8) x 4 x 4
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 8 x 8
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 16 x 16
            nn.ConvTranspose2d(ngf * 2,     ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            # state size. (ngf) x 32 x 32
            nn.ConvTranspose2d(    ngf,      nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 64 x 64
        )

    def forward(self, input):
        
        if (input.is_cuda or input.is_xpu) and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super(Discriminator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is (nc) x 64 x 64
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 32 x 32
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 16 x 16
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*4) x 8 x 8
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*8) x 4 x 4
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid()
        )

    def forward(self, input):
        if (input.is_cuda or input.is_xpu) and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)

        return output.view(-1, 1).squeeze(1)
# fmt: on


@dataclass(frozen=True)
class Options:
    image_size: int = field(default=64, metadata={"help": "the script's --imageSize"})
    nz: int = field(default=100, metadata={"help": "size of the latent z vector"})
    ngf: int = field(default=64, metadata={"help": "number of generator filters"})
    ndf: int = field(default=64, metadata={"help": "number of discriminator filters"})
    beta1: float = field(default=0.5, metadata={"help": "beta1 for adam"})


class DCGAN(BaseTrainer):
    manual_optimization = True  # two models, two optimizers

    def create_model(self):
        global nz, ngf, ndf, nc
        nz, ngf, ndf, nc = self.options.nz, self.options.ngf, self.options.ndf, 3
        netG = Generator(1)
        netG.apply(weights_init)
        netD = Discriminator(1)
        netD.apply(weights_init)
        self.fixed_noise = torch.randn(self.config.batch_size, nz, 1, 1)
        return nn.ModuleDict({"netG": netG, "netD": netD})

    def create_datasets(self):
        size = self.options.image_size
        return dset.FakeData(image_size=(3, size, size), transform=transforms.ToTensor()), None

    def create_dataloader(self, dataset, train):
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=True,
            num_workers=self.config.num_workers,
        )

    def create_optimizer(self, model):
        nets, lr, beta1 = self.unwrapped_model, self.config.lr, self.options.beta1
        optimizerD = optim.Adam(nets["netD"].parameters(), lr=lr, betas=(beta1, 0.999))
        optimizerG = optim.Adam(nets["netG"].parameters(), lr=lr, betas=(beta1, 0.999))
        return [optimizerD, optimizerG]

    def train_step(self, data):
        netG, netD = self.unwrapped_model["netG"], self.unwrapped_model["netD"]
        optimizerD, optimizerG = self.optimizers
        criterion, device = nn.BCELoss(), self.device
        i, epoch = self.step_in_epoch, self.epoch  # the script's, before this step
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        # train with real
        netD.zero_grad()
        real_cpu = data[0].to(device)
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=device)

        output = netD(real_cpu)
        errD_real = criterion(output, label)
        self.backward(errD_real)

        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        self.backward(errD_fake)
        errD = errD_real + errD_fake
        self.optimizer_step(optimizerD)

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        self.backward(errG)
        self.optimizer_step(optimizerG)

        if i % 100 == 0:  # the script's images: its netG(fixed_noise) moves the batch norms
            fake = netG(self.fixed_noise.to(device))
            if self.dist.is_main:
                vutils.save_image(real_cpu, self.run_dir / "real_samples.png", normalize=True)
                vutils.save_image(
                    fake.detach(),
                    self.run_dir / f"fake_samples_epoch_{epoch:03d}.png",
                    normalize=True,
                )
        return errD, {"loss_g": errG.detach()}


EXPERIMENT = register_experiment(
    "dcgan",
    DCGAN,
    Options,
    help="pytorch/examples' DCGAN on torchvision's FakeData",
    # the script: --lr 0.0002, --batchSize 64, one seeding (its --manualSeed)
    defaults={"lr": 0.0002, "batch_size": 64, "seed_once": True},
)

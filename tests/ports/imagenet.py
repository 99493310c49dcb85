"""pytorch/examples' imagenet/main.py (``--dummy``) as a dmltrain experiment.

Its model (torchvision's ``--arch``), loss, SGD, StepLR and ``accuracy`` are the script's
(``accuracy`` copied whole under the BSD-3-Clause licence of pytorch/examples;
tests/test_ports.py checks it against the script). What the port changed: the script's
own set-up of processes, devices and DDP, its ``--resume``, its best-accuracy checkpoint
and its meters are dmltrain's (``--best-metric val_acc1``); its loaders are its own
(``create_dataloader``), a DistributedSampler on several processes as it has. FakeData's
size and image size are options: the script's 1,281,167 images of 224 x 224 take days
an epoch on a CPU."""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
from ports.vision import torchvision
from torch.optim.lr_scheduler import StepLR

from dmltrain import BaseTrainer, register_experiment

torchvision()
import torchvision.datasets as datasets  # noqa: E402
import torchvision.models as models  # noqa: E402
import torchvision.transforms as transforms  # noqa: E402


# fmt: off
def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res
# fmt: on


@dataclass(frozen=True)
class Options:
    arch: str = field(default="resnet18", metadata={"help": "torchvision model architecture"})
    momentum: float = field(default=0.9, metadata={"help": "momentum"})
    train_samples: int = field(default=1281167, metadata={"help": "FakeData training images"})
    val_samples: int = field(default=50000, metadata={"help": "FakeData validation images"})
    image_size: int = field(default=224, metadata={"help": "FakeData images' height and width"})


class ImageNet(BaseTrainer):
    def create_model(self):
        return models.__dict__[self.options.arch]()

    def create_datasets(self):
        options = self.options
        shape = (3, options.image_size, options.image_size)
        train_dataset = datasets.FakeData(options.train_samples, shape, 1000, transforms.ToTensor())
        val_dataset = datasets.FakeData(options.val_samples, shape, 1000, transforms.ToTensor())
        return train_dataset, val_dataset

    def create_dataloader(self, dataset, train):
        sampler = None
        if self.dist.world_size > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(
                dataset, shuffle=train, drop_last=not train
            )
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=train and sampler is None,
            num_workers=self.config.num_workers,
            pin_memory=True,
            sampler=sampler,
        )

    def create_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), self.config.lr,
                               momentum=self.options.momentum,
                               weight_decay=self.config.weight_decay)  # fmt: skip

    def create_scheduler(self, optimizer):
        """Sets the learning rate to the initial LR decayed by 10 every 30 epochs"""
        return StepLR(optimizer, step_size=30, gamma=0.1)

    def train_step(self, batch):
        images, target = batch
        output = self.model(images)
        loss = nn.CrossEntropyLoss()(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        return loss, {"acc1": acc1[0], "acc5": acc5[0]}

    def val_step(self, batch):
        images, target = batch
        output = self.model(images)
        loss = nn.CrossEntropyLoss()(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        return {"loss": loss, "acc1": acc1[0], "acc5": acc5[0]}


EXPERIMENT = register_experiment(
    "imagenet",
    ImageNet,
    Options,
    help="pytorch/examples' ImageNet classifier on torchvision's FakeData (--dummy)",
    # the script's defaults; its --seed seeds once, and its best checkpoint is by acc@1
    defaults={
        "epochs": 90,
        "batch_size": 256,
        "lr": 0.1,
        "optimizer": "sgd",
        "weight_decay": 1e-4,
        "seed_once": True,
        "best_metric": "val_acc1",
        "best_mode": "max",
    },
)

"""pytorch/examples' mnist_forward_forward/main.py as a dmltrain experiment.

Forward-forward training is layer-local: each layer has its own optimizer and loss, and
no backward crosses layers. The script trains its first layer ``--epochs`` times on one
batch, then the next layer on the first one's outputs. Its functions and classes are the
script's, as they are (copied whole under the BSD-3-Clause licence of pytorch/examples;
tests/test_ports.py checks them against the script). They read the script's module-level
``args`` and ``device``: ``create_model`` sets them, as the script's argparse did.

What the port changed: a dmltrain epoch is one layer's training, a step one of its
iterations (``Layer.train``'s loop body, its loss as it is, with ``self.backward`` and
``self.optimizer_step``). The batch of the first ``--train-size`` samples comes once a
step. The positive and negative inputs drawn at the first step, and the layer's inputs
after, are a state that checkpoints keep: a resume cannot draw them again. The script
never seeds, so torch starts each run from a seed of its own choosing: the port seeds
once (``--seed-once``), where a run of the script given the same seed draws alike."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn as nn
from ports.vision import torchvision
from torch.optim import Adam
from torch.utils.data import DataLoader, Subset

from dmltrain import BaseTrainer, register_experiment

torchvision()
from torchvision.datasets import MNIST  # noqa: E402
from torchvision.transforms import Compose, Lambda, Normalize, ToTensor  # noqa: E402

# the script's globals that its code reads; create_model sets them
args = SimpleNamespace(lr=0.03, threshold=2.0, epochs=1000)
device = torch.device("cpu")


# fmt: off
def get_y_neg(y):
    y_neg = y.clone()
    for idx, y_samp in enumerate(y):
        allowed_indices = list(range(10))
        allowed_indices.remove(y_samp.item())
        y_neg[idx] = torch.tensor(allowed_indices)[
            torch.randint(len(allowed_indices), size=(1,))
        ].item()
    return y_neg.to(device)


def overlay_y_on_x(x, y, classes=10):
    x_ = x.clone()
    x_[:, :classes] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Net(torch.nn.Module):
    def __init__(self, dims):

        super().__init__()
        self.layers = []
        for d in range(len(dims) - 1):
            self.layers = self.layers + [Layer(dims[d], dims[d + 1]).to(device)]

    def predict(self, x):
        goodness_per_label = []
        for label in range(10):
            h = overlay_y_on_x(x, label)
            goodness = []
            for layer in self.layers:
                h = layer(h)
                goodness = goodness + [h.pow(2).mean(1)]
            goodness_per_label += [sum(goodness).unsqueeze(1)]
        goodness_per_label = torch.cat(goodness_per_label, 1)
        return goodness_per_label.argmax(1)

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for i, layer in enumerate(self.layers):
            print("training layer: ", i)
            h_pos, h_neg = layer.train(h_pos, h_neg)


class Layer(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.relu = torch.nn.ReLU()
        self.opt = Adam(self.parameters(), lr=args.lr)
        self.threshold = args.threshold
        self.num_epochs = args.epochs

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for i in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log1p(
                torch.exp(
                    torch.cat([-g_pos + self.threshold, g_neg - self.threshold])
                )
            ).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if i % args.log_interval == 0:
                print("Loss: ", loss.item())
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()
# fmt: on


class Layers(nn.ModuleList):
    """The net's layers as one module for dmltrain. The script's Net keeps them in a plain
    list (it has no parameters of its own), and ``Layer.train(x_pos, x_neg)`` replaces
    ``nn.Module.train(mode)``: this module's ``train`` and ``eval`` set its own mode alone."""

    def train(self, mode=True):
        self.training = mode
        return self


class Inputs:
    """The layer in training's positive and negative inputs (a state in checkpoints)."""

    def __init__(self):
        self.h_pos = self.h_neg = None

    def state_dict(self):
        return {} if self.h_pos is None else {"h_pos": self.h_pos, "h_neg": self.h_neg}

    def load_state_dict(self, state):
        self.h_pos, self.h_neg = state.get("h_pos"), state.get("h_neg")


@dataclass(frozen=True)
class Options:
    layer_epochs: int = field(
        default=1000, metadata={"help": "the script's --epochs: iterations of each layer"}
    )
    threshold: float = field(default=2.0, metadata={"help": "threshold for training"})
    train_size: int = field(default=50000, metadata={"help": "size of training set"})
    test_size: int = field(default=10000, metadata={"help": "size of test set"})


class ForwardForward(BaseTrainer):
    manual_optimization = True  # each layer its own optimizer and loss

    def create_model(self):
        global args, device
        options = self.options
        args = SimpleNamespace(
            lr=self.config.lr, threshold=options.threshold, epochs=options.layer_epochs
        )
        device = self.device
        self.net = Net([784, 500, 500])
        self.inputs = Inputs()
        return Layers(self.net.layers)

    def create_datasets(self):
        transform = Compose(
            [
                ToTensor(),
                Normalize((0.1307,), (0.3081,)),
                Lambda(lambda x: torch.flatten(x)),
            ]
        )
        options = self.options
        train = MNIST(self.config.data_dir, train=True, download=True, transform=transform)
        test = MNIST(self.config.data_dir, train=False, download=True, transform=transform)
        return Subset(train, range(options.train_size)), Subset(test, range(options.test_size))

    def create_dataloader(self, dataset, train):
        if not train:
            return DataLoader(dataset, batch_size=self.options.test_size)
        # the script's first batch, once for each iteration of a layer: an epoch a layer
        batch = list(range(len(dataset)))
        return DataLoader(dataset, batch_sampler=[batch] * self.options.layer_epochs)

    def create_optimizer(self, model):
        return [layer.opt for layer in self.net.layers]

    def create_states(self):
        return {"inputs": self.inputs}

    def train_step(self, batch):
        x, y = batch
        inputs, index = self.inputs, self.epoch
        if self.step_in_epoch == 0:  # the layer's first iteration: its inputs
            if index == 0:
                inputs.h_pos = overlay_y_on_x(x, y)
                y_neg = get_y_neg(y)
                inputs.h_neg = overlay_y_on_x(x, y_neg)
            else:  # what the layer before returned from its train()
                previous = self.net.layers[index - 1]
                inputs.h_pos = previous.forward(inputs.h_pos).detach()
                inputs.h_neg = previous.forward(inputs.h_neg).detach()
        layer, opt = self.net.layers[index], self.optimizers[index]
        g_pos = layer.forward(inputs.h_pos).pow(2).mean(1)
        g_neg = layer.forward(inputs.h_neg).pow(2).mean(1)
        loss = torch.log1p(
            torch.exp(torch.cat([-g_pos + layer.threshold, g_neg - layer.threshold]))
        ).mean()
        opt.zero_grad()
        self.backward(loss)
        self.optimizer_step(opt)
        return loss

    def val_step(self, batch):
        x_te, y_te = batch
        return {"error": 1.0 - self.net.predict(x_te).eq(y_te).float().mean()}


EXPERIMENT = register_experiment(
    "forward-forward",
    ForwardForward,
    Options,
    help="pytorch/examples' forward-forward MNIST network, trained layer by layer",
    # the script: --lr 0.03, 2 layers (an epoch each), seeded once (it never seeds: torch
    # starts from a seed of its own choosing, another each run)
    defaults={
        "lr": 0.03,
        "epochs": 2,
        "seed_once": True,
        "data_dir": "./data/",
        "best_metric": "val_error",
    },
)

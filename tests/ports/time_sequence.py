"""pytorch/examples' time_sequence_prediction/train.py as a dmltrain experiment.

Its model and loss are the script's, as they are (``Sequence`` below is copied whole, under
the BSD-3-Clause licence of pytorch/examples; tests/test_ports.py checks it against the
script). What the port changed: the whole set is one batch read in order (``--no-shuffle``,
batch size = the set), a script step is an epoch, LBFGS gets its closure through
``self.optimizer_step(optimizer, closure)``, and the script's test loss is ``val_step``'s.
The script seeds numpy and torch once (``--seed-once``)."""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import TensorDataset

from dmltrain import BaseTrainer, register_experiment


# fmt: off
class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future = 0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):# if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs
# fmt: on


@dataclass(frozen=True)
class Options:
    data: str = field(default="traindata.pt", metadata={"help": "generate_sine_wave.py's file"})
    future: int = field(default=1000, metadata={"help": "steps predicted past the test input"})


class TimeSequence(BaseTrainer):
    manual_optimization = True  # LBFGS evaluates the loss several times a step

    def create_model(self):
        seq = Sequence()
        seq.double()
        return seq

    def create_datasets(self):
        # the script's own file: a numpy array that torch.save pickled (not weights)
        data = torch.load(self.options.data, weights_only=False)
        input = torch.from_numpy(data[3:, :-1])
        target = torch.from_numpy(data[3:, 1:])
        test_input = torch.from_numpy(data[:3, :-1])
        test_target = torch.from_numpy(data[:3, 1:])
        return TensorDataset(input, target), TensorDataset(test_input, test_target)

    def create_optimizer(self, model):
        return optim.LBFGS(model.parameters(), lr=0.8)

    def train_step(self, batch):
        input, target = batch
        criterion = nn.MSELoss()
        optimizer = self.optimizer

        def closure():
            optimizer.zero_grad()
            out = self.model(input)
            loss = criterion(out, target)
            self.backward(loss)
            return loss

        return self.optimizer_step(optimizer, closure)

    def val_step(self, batch):
        test_input, test_target = batch
        future = self.options.future
        pred = self.model(test_input, future=future)
        return {"loss": nn.MSELoss()(pred[:, :-future], test_target)}


EXPERIMENT = register_experiment(
    "time-sequence",
    TimeSequence,
    Options,
    help="pytorch/examples' LSTM sine-wave predictor, trained with LBFGS",
    # the script: seed 0 once, the whole training set (97 sequences) in one batch, in order
    defaults={"seed": 0, "seed_once": True, "batch_size": 97, "shuffle": False, "lr": 0.8},
)

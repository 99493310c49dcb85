"""The checkpointer's storage seam (dmltrain/checkpoint/storage.py: CheckpointStore): a
store of another kind is one class. This one keeps checkpoints in memory, as bytes; a run
saved there and resumed from there ends with the weights of a run never stopped, and
writes no checkpoint file: the tiny model, and once the bundled MNIST CNN (dropout, a
resume mid-epoch)."""

import io

import torch

from dmltrain import TrainConfig
from dmltrain.engine import assembly
from dmltrain_experiments.mnist import MnistOptions, MnistTrainer
from tiny import TinyOptions, TinyTrainer


class MemoryStore:
    """Full checkpoints as torch.save's bytes, by location ``memory:<name>``."""

    asynchronous = False

    def __init__(self, keep_last: int) -> None:
        self.keep_last, self.objects, self.published = keep_last, {}, []

    def where(self):
        return "memory"

    def save(self, state, epoch, global_step, best, wait=False):
        location = f"memory:ckpt-{epoch:06d}-{global_step:08d}"
        buffer = io.BytesIO()
        torch.save(state, buffer)  # a copy: the state's tensors are the model's own
        self.objects[location] = buffer.getvalue()
        self.published = [x for x in self.published if x != location] + [location]  # then
        for old in self.published[: -self.keep_last] if self.keep_last else ():
            del self.objects[old]
        self.published = [x for x in self.published if x in self.objects]
        return location

    def save_sharded(self, *args, **kwargs):
        raise NotImplementedError("the memory store keeps full checkpoints")

    def wait(self):
        pass

    def holds(self, epoch, global_step, sharded):
        return f"memory:ckpt-{epoch:06d}-{global_step:08d}" in self.objects

    def newest(self):
        return self.published[-1] if self.published else None

    def latest_valid(self, warn):
        newest = self.newest()
        return None if newest is None else (newest, self.read(newest))

    def read(self, location):
        return torch.load(io.BytesIO(self.objects[location]), weights_only=True)

    def read_shards(self, location, shards, index):
        raise NotImplementedError("the memory store keeps full checkpoints")

    def shards_problem(self):
        return "the memory store keeps full checkpoints"

    def settle(self, main=True, failed=False):
        pass  # nothing in flight


def test_a_run_saved_to_and_resumed_from_another_store_trains_as_one_never_stopped(
    tmp_path, monkeypatch, capsys
):
    def fit(name, epochs):
        config = TrainConfig(run_dir=str(tmp_path / name), epochs=epochs, batch_size=8,
                             progress="off", keep_last=2)  # fmt: skip
        trainer = TinyTrainer(config, TinyOptions(dropout=0.2))
        trainer.fit()
        return trainer

    whole = fit("whole", 3)
    store = MemoryStore(keep_last=2)
    monkeypatch.setattr(assembly, "CheckpointDir", lambda directory, keep, background: store)
    fit("cut", 2)
    assert len(store.objects) == 2  # keep-last 2
    # the run directory's own records are files (its check for a run there reads them):
    # the second job keeps its records apart and finds its checkpoints in the store
    capsys.readouterr()
    resumed = fit("cut-again", 3)
    assert "dmltrain: resuming from memory:ckpt-000002-00000024 (epoch 3" in capsys.readouterr().out
    assert resumed.global_step == whole.global_step
    for key, value in whole.unwrapped_model.state_dict().items():
        assert torch.equal(value, resumed.unwrapped_model.state_dict()[key]), key
    for name in ("cut", "cut-again"):  # nothing went to files
        assert not list((tmp_path / name).glob("checkpoints/*"))


def test_the_mnist_cnn_resumed_mid_epoch_from_memory_ends_bitwise_equal(
    tmp_path, monkeypatch, capsys
):
    def fit(name, max_steps):
        config = TrainConfig(run_dir=str(tmp_path / name), data_dir=str(tmp_path / "data"),
                             epochs=1, batch_size=64, max_steps=max_steps, progress="off",
                             log_every=5)  # fmt: skip
        trainer = MnistTrainer(config, MnistOptions(download=False))
        trainer.fit()
        return trainer

    whole = fit("whole", 30)
    store = MemoryStore(keep_last=2)
    monkeypatch.setattr(assembly, "CheckpointDir", lambda directory, keep, background: store)
    fit("cut", 15)
    capsys.readouterr()
    resumed = fit("cut-again", 30)
    said = capsys.readouterr().out
    assert "dmltrain: resuming from memory:ckpt-000001-00000015 (epoch 1, 15 steps into it" in said
    assert resumed.global_step == whole.global_step == 30
    for key, value in whole.unwrapped_model.state_dict().items():
        assert torch.equal(value, resumed.unwrapped_model.state_dict()[key]), key
    assert not list((tmp_path / "cut-again").glob("checkpoints/*"))

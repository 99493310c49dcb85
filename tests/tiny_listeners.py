"""The tiny experiment's callbacks and trackers, as users write them (some installed under
entry points by tests/dmltrain_test_experiments-0.dist-info)."""

import json
import os
from dataclasses import dataclass, field

import torch

from dmltrain import Callback, Tracker
from dmltrain.features.tracking import TrackerStart


@dataclass(frozen=True)
class ListenerOptions:
    grad_norms_every: int = field(
        default=0, metadata={"help": "a callback logs each layer's gradient norm every N steps"}
    )
    listen_all: bool = field(
        default=False,
        metadata={"help": "a callback on every event writes what it saw to events.RANK.json"},
    )
    val_images: bool = field(
        default=False,
        metadata={"help": "a callback logs the first layer's weights as an image and as a "
                  "figure at each validation"},
    )  # fmt: skip


class GradNorms(Callback):
    """A user's callback: each layer's gradient norm every ``every`` steps, as scalars in
    the tracker, and a counter of what it logged that checkpoints keep."""

    def __init__(self, every: int) -> None:
        self.every, self.logged = every, 0

    def on_before_optimizer_step(self, trainer):
        step = trainer.global_step + 1  # the one being taken
        if step % self.every == 0:
            norms = {f"grad_norm/{name}": p.grad.norm() for name, p in
                     trainer.unwrapped_model.named_parameters() if p.grad is not None}  # fmt: skip
            self.logged += 1
            trainer.log_metrics({**norms, "grad_norms_logged": self.logged}, step)

    def state_dict(self):
        return {"logged": self.logged}

    def load_state_dict(self, state):
        self.logged = state["logged"]


class EveryEvent(Callback):
    """Listens to every event: what it saw goes to RUN_DIR/events.RANK.json at the end."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.steps: list[int] = []
        self.saved_at: list[int] = []  # the global step of each on_save_checkpoint
        self.loaded: list[list] = []  # each on_load_checkpoint: [file name, global step]

    def _saw(self, name: str) -> None:
        self.seen[name] = self.seen.get(name, 0) + 1

    def on_setup(self, trainer):
        self._saw("on_setup")

    def on_train_start(self, trainer):
        self._saw("on_train_start")

    def on_epoch_start(self, trainer):
        self._saw("on_epoch_start")

    def on_before_optimizer_step(self, trainer):
        self._saw("on_before_optimizer_step")

    def on_step_end(self, trainer):
        self._saw("on_step_end")
        self.steps.append(trainer.global_step)

    def on_log(self, trainer, values):
        self._saw("on_log")

    def on_validation_end(self, trainer, row):
        self._saw("on_validation_end")

    def on_epoch_end(self, trainer, row):
        self._saw("on_epoch_end")

    def on_save_checkpoint(self, trainer):
        self._saw("on_save_checkpoint")
        self.saved_at.append(trainer.global_step)

    def on_load_checkpoint(self, trainer, path):
        self._saw("on_load_checkpoint")
        self.loaded.append([path.name, trainer.global_step])

    def on_train_end(self, trainer):
        self._saw("on_train_end")

    def on_close(self, trainer, error):
        self._saw("on_close")
        path = trainer.run_dir / f"events.{trainer.dist.rank}.json"
        record = {"seen": self.seen, "steps": self.steps, "error": type(error).__name__,
                  "saved_at": self.saved_at, "loaded": self.loaded}  # fmt: skip
        path.write_text(json.dumps(record))


class JsonlTracker(Tracker):
    """An installed tracker (entry point ``jsonl``): RUN_DIR/tracked.jsonl, a line a call,
    under a run id it makes once and is given back in later jobs."""

    active = True

    def __init__(self, start: TrackerStart) -> None:
        self.run_id = start.run_id or f"run-{os.getpid()}"
        self.path = start.run_dir / "tracked.jsonl"
        self._write({"start": self.run_id, "step": start.global_step,
                     "lr": start.config["train"]["lr"]})  # fmt: skip

    def _write(self, record) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")

    def log(self, metrics, global_step):
        self._write({"step": global_step, **metrics})

    def finish(self, preempted=False):
        self._write({"finish": self.run_id, "preempted": preempted})


class FailingTracker(Tracker):
    """An installed tracker (entry point ``failing``) whose every log fails."""

    active = True

    def __init__(self, start: TrackerStart) -> None:
        pass

    def log(self, metrics, global_step):
        raise ConnectionError("the tracking server went away")


class WeightImages(Callback):
    """At each validation, rank 0 logs the first layer's weights as an image (squashed into
    [0, 1]) and as a matplotlib figure."""

    def on_validation_end(self, trainer, row):
        if not trainer.dist.is_main:
            return
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

        weights = torch.sigmoid(trainer.unwrapped_model[0].weight.detach())  # 8 x features
        trainer.log_image("val/weights", weights)
        figure, axes = pyplot.subplots(figsize=(2, 2))
        axes.imshow(weights.numpy())
        trainer.log_image("val/weights_figure", figure)
        pyplot.close(figure)


def callbacks(o: ListenerOptions) -> list[Callback]:
    made: list[Callback] = [EveryEvent()] if o.listen_all else []
    if o.val_images:
        made.append(WeightImages())
    if o.grad_norms_every:
        made.append(GradNorms(o.grad_norms_every))
    return made

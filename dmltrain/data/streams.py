"""The training batches of each epoch, from a sampler's keys or from a stream, and a
stream's saved position.

A map-style dataset's epoch is a permutation (``samples.ResumableSampler``); a resume
starts the sampler part-way. An ``IterableDataset`` (a stream: WebDataset shards, zarr
windows, a generator) has no index: its position is what its DataLoader and the loader's
workers hold. torchdata's ``StatefulDataLoader`` (``dmltrain[streaming]``) saves that,
each worker's too, through the dataset's ``state_dict``/``load_state_dict``; a dataset
without them is read forward again to the position. Every rank's position goes into the
checkpoint.

A stream shards itself: by rank (``trainer.dist``) and by loader worker
(``torch.utils.data.get_worker_info``). Ranks must take as many steps each epoch (their
collectives pair up), so a stream on several processes needs ``--steps-per-epoch`` or a
``len()`` that gives every rank as many batches.
"""

import importlib.util
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from dmltrain.config import LoopConfig
from dmltrain.data import own_loaders
from dmltrain.data.samples import ResumableSampler, ShardSampler, iterate
from dmltrain.errors import UserError

EXTRA = "pip install 'dmltrain[streaming]'"
# Loader workers send their place every this many batches, and a resume replays the batches
# since (sent every batch, the state slowed the training step: benchmarks/findings.md)
SNAPSHOT_EVERY = 32


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def stateful(dataset: Any) -> bool:
    """Whether ``dataset`` says where it is (torchdata's protocol)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def loader(dataset: Dataset, batch_size: int, num_workers: int, pin_memory: bool) -> DataLoader:
    """The default loader of a stream: no sampler; torchdata's ``StatefulDataLoader`` where
    it is installed (a position to save), else torch's (a resume starts the stream again).
    Workers are not kept between epochs: each pass of a stream starts in fresh ones."""
    options: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers}
    options["pin_memory"] = pin_memory
    if importlib.util.find_spec("torchdata") is None:
        if stateful(dataset):
            raise UserError(
                f"{type(dataset).__name__} has state_dict/load_state_dict, which only "
                f"torchdata's StatefulDataLoader saves: {EXTRA}"
            )
        return DataLoader(dataset, **options)
    from torchdata.stateful_dataloader import StatefulDataLoader

    # dmltrain says in one line what a resume of a stateless stream does (TrainFeed.restore)
    logging.getLogger("torchdata.stateful_dataloader.stateful_dataloader").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(dataset, snapshot_every_n_steps=SNAPSHOT_EVERY, **options)


def steps_per_epoch(train: DataLoader, loop: LoopConfig, world_size: int) -> int | None:
    """Optimizer steps in an epoch; None for a stream of unknown length on one process."""
    if not is_stream(train.dataset):
        if loop.steps_per_epoch:
            raise UserError(
                "--steps-per-epoch is for iterable (streaming) datasets; a map-style "
                "dataset's epoch is one pass of it: use --max-steps to stop sooner"
            )
        return math.ceil(len(train) / loop.grad_accum)
    if loop.steps_per_epoch:
        return loop.steps_per_epoch
    try:
        batches = len(train)
    except TypeError:  # no __len__
        if world_size > 1:
            raise UserError(
                f"the training stream ({type(train.dataset).__name__}) has no len() and "
                f"{world_size} processes train on it: give --steps-per-epoch N, so that every "
                "rank takes as many steps an epoch"
            ) from None
        return None
    if batches == 0:
        raise UserError(
            f"the training stream ({type(train.dataset).__name__}) has no batch: its len() "
            "is 0; check its data"
        )
    return math.ceil(batches / loop.grad_accum)


def begin_pass(loader: DataLoader, number: int) -> Iterator[Any]:
    """A new pass of ``loader``; a stream with ``set_epoch`` is told which (its shuffle),
    before the loader's workers take their copies of it."""
    set_epoch = getattr(loader.dataset, "set_epoch", None)
    if is_stream(loader.dataset) and callable(set_epoch):
        set_epoch(number)
    return iterate(loader)


def evaluation_pass(loader: DataLoader) -> Iterator[Any]:
    """The batches of one validation or test pass: a stream begins it anew (the same pass
    each time). An experiment's own loader over map-style data is iterated as its script
    would: without a generator of its own, it draws from torch's (own_loaders)."""
    if not is_stream(loader.dataset) and not isinstance(loader.sampler, ShardSampler):
        return iter(loader)
    return begin_pass(loader, 0)


class TrainFeed:
    """The training loader's micro-batches, epoch by epoch, from where the run is."""

    def __init__(self, train: DataLoader, loop: LoopConfig, rank: int, world_size: int) -> None:
        self.loader, self.loop, self.rank = train, loop, rank
        self.stream = is_stream(train.dataset)
        # an experiment's own loader over map-style data (own_loaders); dmltrain's sampler
        # is told where to start instead
        self.own = not self.stream and not isinstance(train.sampler, ResumableSampler)
        self._began: Any = None  # own: its generators as this epoch began
        self.steps = steps_per_epoch(train, loop, world_size)  # None: until the stream ends
        self.strict = self.stream and world_size > 1  # a short stream would unpair ranks
        self._iterator: Iterator[Any] | None = None  # kept across epochs: --steps-per-epoch
        self._resume: Any = None  # a saved position, taken when the next epoch starts
        self.passes = 0  # of the stream begun, under --steps-per-epoch

    def epoch(self, epoch: int, step_in_epoch: int) -> Iterator[Any]:
        """The micro-batches left of ``epoch`` (0-based), whose first ``step_in_epoch``
        steps are done."""
        accum = self.loop.grad_accum
        if self.own:
            own_loaders.set_epoch(self.loader, epoch)
            if self._resume is not None and step_in_epoch:  # at the next batch, as it began
                began, self._resume = self._resume, None
                rest = own_loaders.resumed(self.loader, began, step_in_epoch * accum)
                return iterate(rest)
            self._resume, self._began = None, own_loaders.begin(self.loader)
            # as the experiment's script would iterate it: a loader without a generator
            # of its own draws its workers' seed from torch's, which moves (own_loaders)
            return iter(self.loader)
        if not self.stream:
            sampler = self.loader.sampler
            assert isinstance(sampler, ResumableSampler)
            sampler.set_epoch(epoch)
            sampler.start = step_in_epoch * accum * self.loop.batch_size
            return iterate(self.loader)
        if self._resume is not None:  # the iterator goes on from the saved position
            self.loader.load_state_dict(self._resume)  # type: ignore[attr-defined]
            self._resume, self._iterator = None, iterate(self.loader)
        elif not self.loop.steps_per_epoch:  # a pass an epoch
            self._iterator = begin_pass(self.loader, epoch)
        if self.loop.steps_per_epoch:
            return islice(self._endless(), ((self.steps or 0) - step_in_epoch) * accum)
        assert self._iterator is not None
        if not self.strict:  # one process: an epoch is a pass, whatever len() says
            return self._yields(self._iterator) if step_in_epoch == 0 else self._iterator
        return self._exactly(self._iterator, len(self.loader) - step_in_epoch * accum)

    def _endless(self) -> Iterator[Any]:
        """The stream read on from where the last epoch left it, started again when it ends."""
        while True:
            fresh = self._iterator is None  # else the last epoch's, or a restored one
            if fresh:
                self._iterator = begin_pass(self.loader, self.passes)
                self.passes += 1
            assert self._iterator is not None
            yield from self._yields(self._iterator) if fresh else self._iterator
            self._iterator = None

    def _yields(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, a whole pass, which must hold one at least: a pass that yields
        nothing would end the run as done without a step."""
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            raise self._empty()

    def _empty(self) -> UserError:
        return UserError(
            f"the training stream ({type(self.loader.dataset).__name__}) yields no batch on "
            f"rank {self.rank}: check its data, and how it shards itself by rank and worker"
        )

    def _exactly(self, batches: Iterator[Any], n: int) -> Iterator[Any]:
        """``batches``, which must be ``n`` (the ranks take as many steps)."""
        taken = 0
        for batch in batches:
            taken += 1
            if taken > n:
                break
            yield batch
        if taken != n:
            said = "ended before" if taken < n else "went on past"
            raise UserError(
                f"the training stream ({type(self.loader.dataset).__name__}) on rank "
                f"{self.rank} {said} the {len(self.loader)} batches its len() gives: every "
                "rank must take as many steps; make __len__ the samples each rank yields "
                "(each worker's last batch may be short), or give --steps-per-epoch"
            )

    # ----- the position a checkpoint keeps ------------------------------------------------
    def position(self) -> Any:
        """This rank's place in the stream; None for a sampler's keys (the counters say
        where those are) and for a loader that cannot say."""
        if self.own:
            return None if self._began is None else {"began": self._began}
        state_dict = getattr(self.loader, "state_dict", None)
        if not (self.stream and callable(state_dict)):
            return None
        return {"loader": state_dict(), "passes": self.passes}

    def takes_position(self, mid_epoch: bool) -> bool:
        """Whether a resume goes on from a saved position: a stream's, in the middle of an
        epoch, and always under --steps-per-epoch (the stream runs across epochs); an own
        loader's in the middle of an epoch."""
        if self.own:
            return mid_epoch
        return self.stream and (mid_epoch or bool(self.loop.steps_per_epoch))

    def restore(self, position: Any, say: Callable[[str], None]) -> None:
        """Go on from ``position`` when the next epoch starts. ``say``: a line about a
        stream that cannot resume exactly."""
        name = type(self.loader.dataset).__name__
        if self.own:
            if position is None:  # a checkpoint of a dmltrain before own loaders resumed
                say(
                    "create_dataloader's loader starts this epoch again from its first batch: "
                    "the checkpoint does not say how its order began (resume from one this "
                    "dmltrain saved, or start the epoch anew)"
                )
                return
            self._resume = position["began"]
            why = own_loaders.inexact(self.loader)
            if why is not None:
                say(why)
            return
        if position is None or not callable(getattr(self.loader, "load_state_dict", None)):
            say(
                f"the training stream ({name}) starts again from its beginning, so this "
                "epoch's first samples are trained again: its loader cannot save where it "
                f"is (use dmltrain's default loader, with torchdata: {EXTRA})"
            )
            return
        if not stateful(self.loader.dataset):
            say(
                f"the training stream ({name}) has no state_dict/load_state_dict: it is read "
                "again from its start up to the checkpoint's position, exact only if it "
                "yields the same samples each time; implement both to resume without that"
            )
        self._resume, self.passes = position["loader"], position["passes"]

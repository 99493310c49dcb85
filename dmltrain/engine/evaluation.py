"""Evaluation exact over a dataset, and predictions in the dataset's order.

Under FSDP every rank must run as many forwards as the others (the forward is collective),
so its validation sampler pads the shorter shards with repeats of the first samples
(``samples.ShardSampler``, at most one a rank, at the end of its shard). ``real_batches``
trims those from the last batch before its forward; a batch made only of padding still
runs (the collectives stay matched) and is marked to be left out. Metrics and predictions
then count every sample once.

``--predict``: each rank writes its outputs, with the dataset indices they belong to, to
``predictions/rank-N.pt``; rank 0 merges them into ``predictions/predictions.pt`` in the
dataset's order (``merge``).
"""

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from dmltrain.data import streams
from dmltrain.data.batches import batch_size_of, to_device
from dmltrain.engine import contract, metric_objects
from dmltrain.engine.metrics import MetricAccumulator, WeightedMeans
from dmltrain.engine.precision import Precision
from dmltrain.errors import StopForRequeue, UserError
from dmltrain.records.files import write_atomic
from dmltrain.runtime.launch import DistInfo
from dmltrain.runtime.strategies import Strategy

Output = Any  # a tensor, or a dict, tuple or list of them (lists: one item a sample)
CHECK_EVERY = 8  # batches between the ranks' agreements on a preemption (--evaluate)


@dataclass(frozen=True)
class Evaluator:
    """Runs a step over a loader's batches without gradients, under the run's precision.
    The caller puts the model in eval mode (the trainer's ``_evaluating_model``)."""

    strategy: Strategy
    precision: Precision
    device: torch.device
    # --evaluate/--predict: whether the ranks agree to stop (a preemption signal; a
    # collective), asked every CHECK_EVERY batches
    stop: Callable[[], bool] | None = None
    # create_metrics()'s torchmetrics objects, by name (metric_objects)
    objects: Mapping[str, Any] = field(default_factory=dict)

    def batches(self, loader: DataLoader, step: Callable[[Any], Any]) -> Iterator[tuple[Any, int]]:
        """``(step's output, how many samples it counts)`` per batch (``real_batches``)."""
        with torch.no_grad():
            for i, (batch, n) in enumerate(real_batches(loader, streams.evaluation_pass(loader))):
                if self.stop is not None and i % CHECK_EVERY == 0 and self.stop():
                    raise StopForRequeue(
                        "preempted during the evaluation: nothing is kept (it runs again whole, "
                        "with the same result); exit status 3"
                    )
                yield self.precision.forward(step, to_device(batch, self.device)), n

    def metrics(
        self, loader: DataLoader, step: Callable[[Any], Any]
    ) -> tuple[dict[str, float], int]:
        """The sample-weighted means of ``step``'s metrics over every rank's shard (those it
        returns as ``(value, weight)`` weighted by their weight), with the metric objects'
        values over all of it (``metric_objects``), and the number of samples they count."""
        metrics, weighted = MetricAccumulator(self.device), WeightedMeans(self.device)
        method = getattr(step, "__name__", "val_step")
        metric_objects.reset(self.objects)
        for values, n in self.batches(loader, step):
            if n:
                values = metric_objects.feed(
                    self.objects, contract.step_metrics(values, method), method
                )
                if any(isinstance(v, tuple) for v in values.values()):  # (value, weight)
                    for name, pair in values.items():
                        if isinstance(pair, tuple):
                            weighted.update(name, pair, method)
                    values = {k: v for k, v in values.items() if not isinstance(v, tuple)}
                metrics.update(values, n)
        count = torch.tensor([float(metrics.count)], device=self.device)
        total = int(self.strategy.all_reduce_sum(count).item())
        results = metrics.compute(self.strategy.all_reduce_sum)
        if weighted:
            results.update(weighted.compute(self.strategy.all_reduce_sum))
        if total:
            results.update(metric_objects.compute(self.objects))
        return results, total

    def evaluate(
        self, sets: Mapping[str, tuple[DataLoader | None, Callable[[Any], Any]]]
    ) -> dict[str, float | int]:
        """``{prefix_metric: mean, prefix_samples: count}`` of each named ``(loader, step)``
        that has a loader."""
        results: dict[str, float | int] = {}
        for prefix, (loader, step) in sets.items():
            if loader is not None:
                metrics, count = self.metrics(loader, step)
                results.update({f"{prefix}_{k}": v for k, v in metrics.items()})
                results[f"{prefix}_samples"] = count
        return results

    def predict(
        self, loader: DataLoader, step: Callable[[Any], Any], run_dir: Path, dist: DistInfo
    ) -> Path:
        """Each rank's outputs to ``RUN_DIR/predictions/rank-N.pt``, then rank 0 merges them
        (``merge``); returns the merged file's path."""
        directory = run_dir / "predictions"
        outputs = [to_cpu(out) for out, n in self.batches(loader, step) if n]
        count = sum(_length(out) for out in outputs)
        write_rank(directory, dist.rank, sample_indices(loader, count), outputs)
        self.strategy.barrier()
        if dist.is_main:
            merge(directory, dist.world_size)
        return directory / "predictions.pt"


def _length(output: Output) -> int:
    if isinstance(output, Tensor | list):
        return len(output)
    if isinstance(output, Mapping):
        return _length(next(iter(output.values())))
    if isinstance(output, tuple):
        return _length(output[0])
    raise UserError(_kind_error(output))


def real_batches(loader: DataLoader, batches: Iterable[Any]) -> Iterator[tuple[Any, int]]:
    """``(batch, n)``: the loader's batches with the sampler's padding trimmed off, and how
    many of the batch's samples count (0: a batch of padding alone, run only to keep the
    ranks' collectives matched). A sampler that does not say how many of its samples are
    real (``real``) counts them all."""
    real = getattr(loader.sampler, "real", None)
    for batch in batches:
        n = batch_size_of(batch)
        if real is None:
            yield batch, n
            continue
        keep = min(n, real)
        real -= keep
        yield (batch if keep in (n, 0) else take(batch, keep)), keep


def take(batch: Any, n: int) -> Any:
    """The first ``n`` samples of a (nested) batch, as ``batch_size_of`` reads one: tensors
    sliced, dicts, tuples and lists of them taken apart (the default collate makes a list
    of a sample's fields); a list of plain items (strings, numbers) is an item a sample."""
    if isinstance(batch, Tensor):
        return batch[:n]
    if isinstance(batch, Mapping):
        return {key: take(value, n) for key, value in batch.items()}
    if isinstance(batch, list) and not any(isinstance(v, _CONTAINERS) for v in batch):
        return batch[:n]
    if isinstance(batch, tuple | list):
        return type(batch)(take(value, n) for value in batch)
    return batch


_CONTAINERS = (Tensor, Mapping, tuple, list)


def _select(output: Output, order: Tensor) -> Output:
    if isinstance(output, Tensor):
        return output[order]
    if isinstance(output, list):
        return [output[i] for i in order.tolist()]
    if isinstance(output, Mapping):
        return {key: _select(value, order) for key, value in output.items()}
    if isinstance(output, tuple):
        return tuple(_select(value, order) for value in output)
    raise UserError(_kind_error(output))


def _kind_error(output: Any) -> str:
    return (
        f"predict_step returned a {type(output).__name__}: return a tensor (a row a sample), "
        "or a dict, tuple or list of those (a list: one item a sample)"
    )


def concatenate(outputs: list[Output]) -> Output:
    """One output from a batch's each: tensors along dim 0, lists joined, dicts and tuples
    by key and position."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs)
    if isinstance(first, list):
        return [item for output in outputs for item in output]
    if isinstance(first, Mapping):
        return {key: concatenate([output[key] for output in outputs]) for key in first}
    if isinstance(first, tuple):
        return tuple(concatenate(list(parts)) for parts in zip(*outputs, strict=True))
    raise UserError(_kind_error(first))


def to_cpu(output: Output) -> Output:
    if isinstance(output, Tensor):
        return output.detach().cpu()
    if isinstance(output, Mapping):
        return {key: to_cpu(value) for key, value in output.items()}
    if isinstance(output, tuple | list):
        return type(output)(to_cpu(value) for value in output)
    return output


def sample_indices(loader: DataLoader, count: int) -> list[int]:
    """The dataset indices of this rank's first ``count`` samples (dmltrain's samplers)."""
    indices = getattr(loader.sampler, "indices", None)
    if indices is None:
        raise UserError(
            "--predict needs dmltrain's validation sampler (strategy.val_sampler) to know "
            "which samples each rank predicts; use it in create_dataloader"
        )
    return list(indices[:count])


def write_rank(directory: Path, rank: int, indices: list[int], outputs: list[Output]) -> Path:
    """This rank's predictions: ``{"indices": LongTensor, "outputs": ...}``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank}.pt"
    joined = concatenate(outputs) if outputs else None
    torch.save({"indices": torch.tensor(indices, dtype=torch.long), "outputs": joined}, path)
    return path


def merge(directory: Path, world_size: int) -> Path:
    """The ranks' files as one, ``predictions.pt``, in the dataset's order."""
    parts = [torch.load(directory / f"rank-{r}.pt", weights_only=False) for r in range(world_size)]
    parts = [part for part in parts if part["outputs"] is not None]
    indices = torch.cat([part["indices"] for part in parts])
    outputs = concatenate([part["outputs"] for part in parts])
    order = torch.argsort(indices)
    path = directory / "predictions.pt"
    torch.save({"indices": indices[order], "outputs": _select(outputs, order)}, path)
    return path


def write_metrics(path: Path, metrics: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(dict(metrics), indent=2) + "\n")

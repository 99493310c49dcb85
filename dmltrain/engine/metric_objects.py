"""Metric objects: values over a whole validation set that a mean of batches cannot give
(RMSE, anomaly correlation, CRPS, area-weighted scores, F1...).

An experiment returns torchmetrics ``Metric`` (or ``MetricCollection``) objects from
``create_metrics()``, by name; its ``val_step``/``test_step`` returns, under each name, the
arguments of that object's ``update`` (a tuple, a dict of keyword arguments, or one value):
``{"loss": loss, "rmse": (prediction, target)}``. The evaluator resets the objects before
each pass, updates them with every batch's real samples (the padding a sampler adds to
keep FSDP's ranks in step is left out) and calls ``compute`` once at the end, which
reduces their states over the ranks: torchmetrics' own gather under torch.distributed, the
strategy's (``Strategy.gather_tensors``) under Horovod.
"""

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from dmltrain.errors import UserError

UPDATE_FIRST = "was called before the ``update`` method"  # a rank that had no batch


def prepare(
    made: Any, device: torch.device, gather: Callable[..., list[Tensor]] | None
) -> dict[str, Any]:
    """``create_metrics()``'s objects, checked and moved to ``device``; ``gather``: how a
    state is collected from every rank (None: torchmetrics' torch.distributed gather)."""
    if made is None or (isinstance(made, Mapping) and not made):
        return {}
    if not isinstance(made, Mapping):
        raise UserError(
            f"create_metrics must return a dict of torchmetrics objects by name; it returned "
            f"a {type(made).__name__}"
        )
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:
        raise UserError(
            "create_metrics needs torchmetrics: pip install 'dmltrain[metrics]'"
        ) from None
    objects: dict[str, Any] = {}
    for name, metric in made.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"create_metrics: {name!r} is not a column name; use e.g. 'rmse'")
        if not isinstance(metric, Metric | MetricCollection):
            raise UserError(
                f"create_metrics: {name!r} is a {type(metric).__name__}, not a torchmetrics "
                "Metric or MetricCollection (whose states dmltrain reduces over the ranks)"
            )
        for each in metric.values() if isinstance(metric, MetricCollection) else [metric]:
            if gather is not None:  # both are torchmetrics' constructor options
                each.dist_sync_fn = gather
                each.distributed_available_fn = lambda: True
        objects[name] = metric.to(device)
    return objects


def reset(objects: Mapping[str, Any]) -> None:
    for metric in objects.values():
        metric.reset()


def feed(objects: Mapping[str, Any], values: Mapping[str, Any], method: str) -> Mapping[str, Any]:
    """Updates each object with the arguments ``values`` holds under its name; the other
    values (the batch's scalar metrics)."""
    if not objects:
        return values
    for name, metric in objects.items():
        if name not in values:
            raise UserError(
                f"{method} returned no {name!r}: return the arguments of the metric's update "
                f"under its name, e.g. {{{name!r}: (prediction, target)}}"
            )
        args = values[name]
        if isinstance(args, tuple):
            metric.update(*args)
        elif isinstance(args, Mapping):
            metric.update(**args)
        else:
            metric.update(args)
    return {k: v for k, v in values.items() if k not in objects}


def compute(objects: Mapping[str, Any]) -> dict[str, float]:
    """Each object's value over every rank's samples (a collective on every rank, in the
    order ``create_metrics`` gave them); a dict result gives a column a key."""
    results: dict[str, float] = {}
    for name, metric in objects.items():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{UPDATE_FIRST}")
            value = metric.compute()
        items = value.items() if isinstance(value, Mapping) else [(None, value)]
        for key, each in items:
            column = name if key is None else f"{name}_{key}"
            results[column] = _number(column, each)
    return results


def _number(column: str, value: Any) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise UserError(
                f"metric {column!r} computes a tensor of shape {tuple(value.shape)}: the "
                "training log takes single numbers (e.g. average='macro', or one metric a class)"
            )
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"metric {column!r} computes a {type(value).__name__}: it must be a number"
        ) from None

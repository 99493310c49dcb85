"""Metric objects (dmltrain/engine/metric_objects.py): create_metrics's torchmetrics objects
are checked, fed the arguments val_step returns under their names, and computed over
the whole set. Their reduction over real ranks is tested in test_distributed (every
launcher, uneven shards, FSDP's padding)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from dmltrain.engine import metric_objects
from dmltrain.engine.evaluation import Evaluator
from dmltrain.engine.precision import Precision
from dmltrain.errors import UserError
from dmltrain.runtime.launch import DistInfo
from dmltrain.runtime.strategies import Strategy

pytestmark = pytest.mark.quick
CPU = torch.device("cpu")


def prepare(made):
    return metric_objects.prepare(made, CPU, None)


def test_what_create_metrics_may_return():
    assert prepare(None) == {} and prepare({}) == {}
    rmse = MeanSquaredError(squared=False)
    assert prepare({"rmse": rmse}) == {"rmse": rmse}
    refused = {
        "a list": ([rmse], "create_metrics must return a dict of torchmetrics objects by name; "
                   "it returned a list"),
        "a function": ({"rmse": torch.sqrt}, "create_metrics: 'rmse' is a "
                       "builtin_function_or_method, not a torchmetrics Metric or "
                       "MetricCollection (whose states dmltrain reduces over the ranks)"),
        "a bad name": ({"val rmse": rmse}, "create_metrics: 'val rmse' is not a column name; "
                       "use e.g. 'rmse'"),
    }  # fmt: skip
    for what, (made, line) in refused.items():
        with pytest.raises(UserError) as caught:
            prepare(made)
        assert str(caught.value) == line, what


def test_a_gather_is_given_to_every_metric_of_a_collection():
    def gather(tensor, group=None):
        return [tensor]

    collection = MetricCollection(
        {"mse": MeanSquaredError(), "acc": MulticlassAccuracy(3, average="micro")}
    )
    metric_objects.prepare({"scores": collection}, CPU, gather)
    assert all(m.dist_sync_fn is gather for m in collection.values())
    assert all(m.distributed_available_fn() for m in collection.values())


def test_arguments_by_position_keyword_or_alone_and_a_missing_one():
    objects = prepare(
        {"rmse": MeanSquaredError(squared=False), "acc": MulticlassAccuracy(3, average="micro")}
    )
    scalars = metric_objects.feed(
        objects,
        {"loss": 1.0, "rmse": (torch.zeros(2), torch.ones(2)),
         "acc": {"preds": torch.tensor([0, 1]), "target": torch.tensor([0, 2])}},
        "val_step",
    )  # fmt: skip
    assert scalars == {"loss": 1.0}
    assert metric_objects.compute(objects) == {"rmse": 1.0, "acc": 0.5}
    with pytest.raises(UserError) as caught:
        metric_objects.feed(objects, {"loss": 1.0, "acc": torch.zeros(1)}, "test_step")
    assert str(caught.value) == (
        "test_step returned no 'rmse': return the arguments of the metric's update under its "
        "name, e.g. {'rmse': (prediction, target)}"
    )


def test_a_collection_gives_a_column_a_key_and_a_vector_is_refused():
    collection = MetricCollection({"mse": MeanSquaredError(), "mae": MeanSquaredError()})
    objects = prepare({"err": collection})
    metric_objects.feed(objects, {"err": (torch.zeros(2), torch.full((2,), 2.0))}, "val_step")
    assert metric_objects.compute(objects) == {"err_mse": 4.0, "err_mae": 4.0}
    per_class = prepare({"acc": MulticlassAccuracy(3, average=None)})
    metric_objects.feed(per_class, {"acc": (torch.tensor([0]), torch.tensor([0]))}, "val_step")
    with pytest.raises(UserError) as caught:
        metric_objects.compute(per_class)
    assert str(caught.value).startswith("metric 'acc' computes a tensor of shape (3,)")


def test_the_evaluator_computes_rmse_over_every_sample_and_resets_between_passes():
    """One process over 21 samples in batches of 8: the RMSE of all 21, not the mean of the
    batches' RMSEs; a second pass, over the first 8, counts those alone (reset)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(21, 1, generator=g), torch.randn(21, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    objects = prepare({"rmse": MeanSquaredError(squared=False)})
    evaluator = Evaluator(Strategy(DistInfo(), None), Precision("fp32", CPU), CPU, objects=objects)

    def step(batch):
        prediction, target = batch
        return {"mse": ((prediction - target) ** 2).mean(), "rmse": (prediction, target)}

    first, count = evaluator.metrics(loader, step)
    second, _ = evaluator.metrics(DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8), step)
    whole = ((x - y) ** 2).mean().sqrt().item()
    of_batches = sum(((a - b) ** 2).mean().sqrt().item() for a, b in zip(
        x.split(8), y.split(8), strict=True)) / 3  # fmt: skip
    assert count == 21
    assert second["rmse"] == pytest.approx(((x[:8] - y[:8]) ** 2).mean().sqrt().item(), rel=1e-6)
    assert first["rmse"] == pytest.approx(whole, rel=1e-6)
    assert first["mse"] == pytest.approx(whole**2, rel=1e-6)
    assert abs(of_batches - whole) > 1e-3

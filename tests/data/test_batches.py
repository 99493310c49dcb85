import pytest
import torch

from dmltrain import UserError
from dmltrain.data.batches import batch_size_of, chunks, split_step_output, to_device


def test_nested_batches_move_and_count():
    batch = {"x": torch.zeros(5, 2), "meta": [torch.ones(5), "id"], "pair": (torch.ones(5),)}
    # "meta" tensors have shapes and no storage: a real move off the CPU without a GPU
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["x"].shape == (5, 2)
    assert moved["meta"][0].device.type == "meta" and moved["meta"][1] == "id"
    assert isinstance(moved["pair"], tuple) and moved["pair"][0].device.type == "meta"
    assert batch["x"].device.type == "cpu"  # the original batch is left as it was
    assert batch_size_of(batch) == 5 and batch_size_of(moved) == 5
    assert batch_size_of([{"x": torch.zeros(3)}]) == 3


def test_cpu_batches_pass_through_unchanged():
    batch = [torch.zeros(4, 2), torch.ones(4)]
    assert to_device(batch, torch.device("cpu")) is batch


@pytest.mark.parametrize("batch", [["a", "b"], 7, "text", {}])
def test_a_batch_without_tensors_is_a_user_error(batch):
    with pytest.raises(UserError, match="at least one tensor"):
        batch_size_of(batch)


def test_chunks_group_micro_batches_and_keep_the_rest():
    assert list(chunks(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(chunks(range(6), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert [list(group) for group in chunks(range(2), 1)] == [[0], [1]]


def test_step_output_is_a_loss_or_a_loss_and_metrics():
    loss = torch.tensor(1.5)
    assert split_step_output(loss) == (loss, {})
    assert split_step_output((loss, {"acc": 0.5})) == (loss, {"acc": 0.5})


def test_step_metrics_are_detached_and_must_be_a_dict():
    """The accumulator keeps a step's metrics for a while: one that requires grad must
    not hold its autograd graph (and the activations it saved) that long."""
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    out_loss, metrics = split_step_output((loss, {"aux": (w * 3).sum(), "n": 1}))
    assert out_loss is loss and out_loss.requires_grad
    assert not metrics["aux"].requires_grad and metrics["aux"].item() == 9.0
    assert metrics["n"] == 1
    with pytest.raises(UserError, match=r"\(loss, dict of metrics\).*second element is a float"):
        split_step_output((loss, 0.5))

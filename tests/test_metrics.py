import pytest
import torch

from dmltrain.metrics import MetricAccumulator


def test_sample_weighted_mean_keeps_order():
    acc = MetricAccumulator("cpu")
    acc.update({"loss": torch.tensor(1.0), "acc": 0.5}, 3)
    acc.update({"loss": torch.tensor(4.0), "acc": 1.0}, 1)
    assert acc.count == 4
    result = acc.compute()
    assert list(result) == ["loss", "acc"]
    assert result["loss"] == pytest.approx((3 * 1 + 4) / 4)
    assert result["acc"] == pytest.approx((1.5 + 1.0) / 4)


def test_reduce_sees_sums_and_count_in_one_tensor():
    acc = MetricAccumulator("cpu")
    acc.update({"loss": torch.tensor(2.0)}, 2)
    seen = []

    def reduce(packed):
        seen.append(packed.clone())
        return packed * 2  # as if a second rank held the same totals

    assert acc.compute(reduce) == {"loss": pytest.approx(2.0)}
    assert torch.equal(seen[0], torch.tensor([4.0, 2.0]))


def test_empty():
    assert MetricAccumulator("cpu").compute() == {}


def test_state_dict_is_a_snapshot_and_restores():
    """A checkpoint's copy of the sums must not move on with the in-place accumulation."""
    acc = MetricAccumulator("cpu")
    acc.update({"loss": torch.tensor(1.0), "acc": 0.5}, 2)
    state = acc.state_dict()
    acc.update({"loss": torch.tensor(3.0), "acc": 1.0}, 2)
    restored = MetricAccumulator("cpu")
    restored.load_state_dict(state)
    assert restored.compute() == {"loss": pytest.approx(1.0), "acc": pytest.approx(0.5)}
    restored.update({"loss": torch.tensor(3.0), "acc": 1.0}, 2)
    assert restored.compute() == acc.compute() == {"loss": 2.0, "acc": 0.75}

"""What of a model trains: frozen parameters, optimizer groups by pattern, LoRA adapters."""

import re

import pytest
import torch
from torch import nn

from dmltrain.config import FinetuneConfig
from dmltrain.errors import UserError
from dmltrain.runtime import finetune

pytestmark = pytest.mark.quick


def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))


def test_frozen_parameters_and_groups_by_pattern():
    model = _net()
    assert finetune.freeze(model, ("0",)) == ["0.weight", "0.bias"]
    groups = finetune.param_groups(model, 0.1, ("2.*=0.5", "*.bias=0.0"))
    got = [(g["lr"], [id(p) for p in g["params"]]) for g in groups]
    named = dict(model.named_parameters())
    assert got == [
        (0.1, [id(named["3.weight"])]),
        (0.05, [id(named["2.weight"]), id(named["2.bias"])]),  # the first rule that matches
        (0.0, [id(named["3.bias"])]),
    ]


def test_lora_adapters_are_all_that_train():
    torch.manual_seed(0)
    model = finetune.add_lora(_net(), FinetuneConfig(lora_targets=("0", "2"), lora_rank=2))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == [f"{m}.lora_{x}.default.weight" for m in "02" for x in "AB"]
    x = torch.randn(5, 3)
    plain = _net()
    plain.load_state_dict({k.replace("base_layer.", ""): v for k, v in model.state_dict().items()
                           if "lora_" not in k})  # fmt: skip
    torch.testing.assert_close(model(x), plain(x))  # B starts at zero: the same model


def test_a_pattern_that_matches_nothing_is_refused():
    with pytest.raises(UserError, match=re.escape("--freeze 'enc*' matches no parameter")):
        finetune.freeze(_net(), ("enc*",))
    with pytest.raises(UserError, match=re.escape("--lr-scale 'enc*' matches no parameter")):
        finetune.param_groups(_net(), 0.1, ("enc*=2",))

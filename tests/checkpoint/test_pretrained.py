"""Pretrained weights from the files users have, and how they map onto a model: real files
written by torch, safetensors and Lightning."""

import json
import pickle

import pytest
import torch
from torch import nn

from dmltrain.checkpoint import pretrained
from dmltrain.checkpoint.storage import FORMAT_VERSION, atomic_save
from dmltrain.config import FinetuneConfig
from dmltrain.errors import UserError

pytestmark = pytest.mark.quick


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _same(read, expected):
    assert sorted(read) == sorted(expected)
    for key in expected:
        assert torch.equal(read[key], expected[key]), key


def test_every_format_reads_to_the_same_tensors(tmp_path):
    from safetensors.torch import save_file

    weights = _net().state_dict()
    torch.save(weights, tmp_path / "plain.pt")
    torch.save({"state_dict": weights, "epoch": 3}, tmp_path / "nested.pt")
    save_file(dict(weights), tmp_path / "model.safetensors")
    atomic_save({"model": weights, "format_version": FORMAT_VERSION, "config": {}},
                tmp_path / "dmltrain.pt")  # fmt: skip
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"0.weight": weights["0.weight"]}, folder / "a.safetensors")
    save_file({k: weights[k] for k in ("0.bias", "2.weight", "2.bias")}, folder / "b.safetensors")
    index = {"weight_map": {"0.weight": "a.safetensors"} | dict.fromkeys(
        ("0.bias", "2.weight", "2.bias"), "b.safetensors")}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    kinds = {}
    for name in ("plain.pt", "nested.pt", "model.safetensors", "dmltrain.pt", "hf"):
        read, kinds[name] = pretrained.read(str(tmp_path / name), tmp_path)
        _same(read, weights)
    assert kinds == {
        "plain.pt": "state_dict",
        "nested.pt": "state_dict (under 'state_dict')",
        "model.safetensors": "safetensors",
        "dmltrain.pt": "dmltrain checkpoint",
        "hf": "safetensors shards",
    }


def test_a_lightning_checkpoint_loads_under_a_map(tmp_path):
    """A real .ckpt of a LightningModule with saved hyperparameters (pickled as Lightning's
    AttributeDict), read with weights_only."""
    lightning = pytest.importorskip("pytorch_lightning")

    class Module(lightning.LightningModule):
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = _net()

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)))
    trainer = lightning.Trainer(max_steps=2, default_root_dir=tmp_path, logger=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                accelerator="cpu", devices=1)  # fmt: skip
    module = Module()
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    read, kind = pretrained.read(str(tmp_path / "model.ckpt"), tmp_path)
    assert kind == "Lightning checkpoint"
    report = pretrained.Report("model.ckpt", kind)
    own = {k: tuple(v.shape) for k, v in _net().state_dict().items()}
    fitted = pretrained.fit(
        pretrained.shapes(read), own, FinetuneConfig(load_map=("net.=",)), report
    )
    _same(
        {new: read[old] for new, old in fitted.items()},
        {k[4:]: v for k, v in module.state_dict().items()},
    )
    assert len(report.loaded) == 4 and not report.unexpected


class Unsafe:
    pass


@pytest.mark.parametrize(
    "content, says",
    [
        (b"not weights at all", "holds none of: a dmltrain checkpoint"),
        ("objects", "holds Python objects as well as tensors (test_pretrained.Unsafe)"),
        ("numbers", "holds none of: a dmltrain checkpoint"),
        ("truncated", "is truncated or corrupt"),
        ("safetensors", "is not a readable safetensors file"),
    ],
)
def test_a_file_that_is_none_of_the_formats_is_one_line(tmp_path, content, says):
    path = tmp_path / ("w.safetensors" if content == "safetensors" else "w.pt")
    if content == "objects":
        torch.save({"model": Unsafe(), "w": torch.ones(1)}, path)
    elif content == "numbers":
        torch.save({"epoch": 3, "lr": 0.1}, path)
    elif content == "truncated":
        torch.save(_net().state_dict(), path)
        path.write_bytes(path.read_bytes()[:300])
    elif content == "safetensors":
        path.write_bytes(pickle.dumps({"a": 1}))
    else:
        path.write_bytes(content)
    with pytest.raises(UserError, match="--load-weights") as caught:
        pretrained.read(str(path), tmp_path)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_missing_files_and_folders_are_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        pretrained.read(str(tmp_path / "nope.pt"), tmp_path)
    with pytest.raises(UserError, match="is a folder that holds none of"):
        pretrained.read(str(tmp_path), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x.safetensors"}}')
    with pytest.raises(UserError, match=r"names shards that are missing: x\.safetensors"):
        pretrained.read(str(tmp_path), tmp_path)


def test_the_map_renames_skips_and_reports_what_did_not_fit():
    weights = {"enc.0.weight": (4, 3), "enc.0.bias": (4,), "head.weight": (10, 4),
               "head.bias": (10,), "aux.weight": (1,)}  # fmt: skip
    own = {"body.0.weight": (4, 3), "body.0.bias": (4,), "head.weight": (5, 4),
           "head.bias": (5,), "extra.weight": (2,)}  # fmt: skip
    config = FinetuneConfig(load_map=("enc.=body.",), load_skip=("aux*",), load_partial=True)
    report = pretrained.Report("w.pt", "state_dict")
    chosen = pretrained.fit(weights, own, config, report)
    assert chosen == {"body.0.weight": "enc.0.weight", "body.0.bias": "enc.0.bias"}
    assert report.skipped == ["aux.weight"]
    assert report.shapes == ["head.weight (10, 4) in file vs (5, 4) in model",
                             "head.bias (10,) in file vs (5,) in model"]  # fmt: skip
    assert report.missing == ["extra.weight"] and report.unexpected == []
    line = report.line()
    assert line.startswith("weights from w.pt (state_dict): loaded 2; skipped 1 (aux.weight)")
    with pytest.raises(UserError) as caught:
        pretrained.fit(weights, own, FinetuneConfig(load_map=("enc.=body.",)), report)
    said = str(caught.value)
    assert "missing keys extra.weight; unexpected keys aux.weight" in said
    assert "shape mismatch: head.weight (10, 4) in file vs (5, 4) in model" in said

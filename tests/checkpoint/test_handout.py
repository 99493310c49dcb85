"""A checkpoint's state handed from rank 0 to the others (dmltrain.checkpoint.handout)
over real Gloo processes and dmltrain's DDP strategy."""

import pickle
from collections import OrderedDict

import torch
import torch.multiprocessing as mp

from dmltrain.checkpoint import handout
from dmltrain.config import DistConfig
from dmltrain.runtime.launch import DistInfo, free_port
from dmltrain.runtime.strategies import DDPStrategy


def _state() -> dict:
    """Every kind of entry a checkpoint holds: tensors of each dtype, shape and layout
    (0-d, empty, strided views, several times the bucket's size), nested in dicts,
    ordered dicts, lists and tuples beside plain values."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": OrderedDict(
            w=torch.randn(64, 33, generator=g),
            half=torch.randn(7, generator=g).half(),
            bf=torch.randn(3, 5, generator=g).bfloat16(),
            big=torch.randn(1000, generator=g, dtype=torch.float64),
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp": torch.zeros(0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "rng": [(torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=g), 7, None)],
        "view": torch.arange(300, dtype=torch.int64).reshape(10, 30)[:, ::2],
        "flags": torch.tensor([True, False, True]),
        "config": {"seed": 1, "name": "tiny"},
        "global_step": 9,
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))  # fmt: skip
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_equal(x, y) for x, y in zip(a, b, strict=True)))  # fmt: skip
    return a == b


def _receive(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    handout.BUCKET_BYTES = 4096  # several buckets, and tensors larger than one
    info = DistInfo(rank=rank, world_size=3, master_port=port)
    strategy = DDPStrategy(info, DistConfig(backend="gloo"))
    strategy.setup()
    try:
        got = handout.hand_out(strategy, _state() if rank == 0 else None)
        out[rank] = pickle.dumps(got)
    finally:
        strategy.teardown()


def test_every_rank_gets_rank_0s_state_bitwise():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_receive, args=(free_port(), out), nprocs=3)
        got = {rank: pickle.loads(out[rank]) for rank in range(3)}
    expected = _state()
    for rank in range(3):
        assert _equal(expected, got[rank]), rank
    assert got[1]["view"].is_contiguous()  # a copy of its own, not a view of a bucket
    assert got[1]["model"]["w"].untyped_storage().nbytes() == 64 * 33 * 4


def test_one_process_gets_its_own_state_back():
    strategy = DDPStrategy(DistInfo(), DistConfig())
    state = _state()
    assert handout.hand_out(strategy, state) is state

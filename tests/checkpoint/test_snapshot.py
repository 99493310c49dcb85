"""Copies of live state for an asynchronous save (dmltrain.checkpoint.snapshot), with FSDP's
DTensor shards over real Gloo processes."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmltrain.checkpoint.snapshot import snapshot
from dmltrain.runtime.launch import free_port


def _dtensors(rank: int, port: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
        live = {"model": {"w": weight}, "optimizer": {"state": {"w": {"step": torch.tensor(1.0)}}}}
        first = snapshot(live)
        with torch.no_grad():
            weight.add_(1.0)  # the loop goes on after a save
        assert torch.equal(first["model"]["w"].full_tensor() + 1, weight.full_tensor())
        local = first["model"]["w"].to_local()
        again = snapshot(live, first)  # the next save, into the last one's copy
        assert again["model"]["w"] is first["model"]["w"]  # the same wrapper and memory
        assert again["model"]["w"].to_local().data_ptr() == local.data_ptr()
        assert torch.equal(again["model"]["w"].full_tensor(), weight.full_tensor())
        assert not again["model"]["w"].requires_grad
        assert again["model"]["w"].to_local().data_ptr() != weight.to_local().data_ptr()
        # another placement (or shape) is not copied into: a new copy, right all the same
        other = distribute_tensor(torch.randn(6, 4), mesh, [Replicate()])
        moved = snapshot({"model": {"w": other}}, again)
        assert moved["model"]["w"] is not again["model"]["w"]
        assert moved["model"]["w"].placements == (Replicate(),)
        assert torch.equal(moved["model"]["w"].full_tensor(), other.full_tensor())
    finally:
        dist.destroy_process_group()


def test_a_sharded_state_is_copied_into_the_last_copy_and_stays_apart_from_the_live_one():
    mp.spawn(_dtensors, args=(free_port(),), nprocs=2)

"""dmltrain/runtime/preflight.py's decision on GPUs: each process of an NCCL job needs a
GPU of its own. The shapes Slurm makes (no GPU here: the devices each task sees are
given, and each rank picks its device as ``launch.default_device`` does)."""

import torch

from dmltrain.runtime import preflight
from dmltrain.runtime.launch import default_device


def ranks(visible: list[list[str]], monkeypatch, host: str = "node1") -> list[dict]:
    """What each of a node's tasks posts: task i sees the GPUs ``visible[i]`` (their
    UUIDs, in CUDA_VISIBLE_DEVICES order) and picks ``default_device(i)`` among them."""
    posted = []
    for local_rank, seen in enumerate(visible):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        count = len(seen)
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=count: n)
        device = default_device(local_rank)
        uuid = seen[int(device.split(":")[1])]
        posted.append({"host": host, "gpu": {"uuid": uuid, "device": device, "sees": len(seen)}})
    return posted


NODE = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


def test_a_gpu_per_task_each_seeing_one_runs(monkeypatch):
    """srun --ntasks-per-node 4 --gpus-per-task 1: each task sees its own GPU as cuda:0."""
    assert preflight._shared_gpu(ranks([[g] for g in NODE], monkeypatch)) is None


def test_every_task_seeing_the_nodes_gpus_runs(monkeypatch):
    """srun --ntasks-per-node 4 --gpus-per-node 4: each sees all four; rank i uses cuda:i."""
    assert preflight._shared_gpu(ranks([NODE] * 4, monkeypatch)) is None


def test_more_tasks_than_gpus_is_refused_with_what_was_seen(monkeypatch):
    """4 tasks on a node of 2 GPUs, each seeing both: ranks 0 and 2 would share one."""
    problem = preflight._shared_gpu(ranks([NODE[:2]] * 4, monkeypatch))
    assert problem is not None and problem.startswith(
        "ranks 0 and 2 on node1 use the same GPU (cuda:0 and cuda:0, each process seeing 2 "
        "and 2 GPU(s); 4 processes on that node)"
    ), problem


def test_the_same_gpu_id_on_two_nodes_is_two_gpus(monkeypatch):
    both = ranks([["GPU-a"]], monkeypatch, "node1") + ranks([["GPU-a"]], monkeypatch, "node2")
    assert preflight._shared_gpu(both) is None


def test_cpu_ranks_post_no_gpu():
    assert preflight.gpu(None) is None
    assert preflight._shared_gpu([{"host": "h", "gpu": None}] * 2) is None

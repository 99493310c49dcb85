"""dmltrain/runtime/preflight.py: its requests to the store, a few a rank whatever the
number of ranks, and its decision on GPUs: each process of an NCCL job needs a
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


def preflight_of(world: int) -> tuple[list[int], list[str | None]]:
    """``preflight.check`` on ``world`` ranks (threads, each with its own client of a real
    TCPStore); each rank's requests and what it raised."""
    import datetime
    import threading

    import torch.distributed as dist
    from helpers import Counted

    from dmltrain.errors import UserError
    from dmltrain.runtime.launch import free_port

    port = free_port()
    timeout = datetime.timedelta(seconds=20)
    stores = [Counted(dist.TCPStore("127.0.0.1", port, world, is_master=r == 0,
                                    timeout=timeout, wait_for_workers=False))
              for r in range(world)]  # fmt: skip
    raised: list[str | None] = [None] * world

    def rank(r: int) -> None:
        try:
            preflight.check(stores[r], r, world, f"node{r}", False)
        except UserError as exc:
            raised[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [s.requests for s in stores], raised


def test_the_store_serves_a_few_requests_a_rank_whatever_the_number_of_ranks(monkeypatch):
    monkeypatch.setattr(preflight, "_resolves_to", lambda name: "10.0.0.1")
    """Rank 0 reads every post in one request and posts one verdict: 2 requests a rank, 3
    for rank 0 (each rank read every post before, N+1 a rank)."""
    for world in (2, 4, 8):
        requests, raised = preflight_of(world)
        assert raised == [None] * world
        assert requests == [3] + [2] * (world - 1), (world, requests)


def test_a_problem_is_the_same_line_on_every_rank(monkeypatch):
    import threading

    def packages():  # rank 3 runs another torch
        torch_version = "2.0.0" if threading.current_thread().name == "rank3" else "2.13.0"
        return {"torch": torch_version, "dmltrain": "0.1.0", "horovod": None}

    monkeypatch.setattr(preflight, "_packages", packages)
    monkeypatch.setattr(preflight, "_resolves_to", lambda name: "10.0.0.1")
    requests, raised = preflight_of(4)
    assert len(set(raised)) == 1 and raised[0] is not None
    assert raised[0].startswith("the nodes run different versions of torch"), raised[0]
    assert requests[1:] == [3, 3, 3]  # the verdict read, then said read

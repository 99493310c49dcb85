"""Checks across the job's hosts before the first collective, one line each naming the node.

The ranks meet at the rendezvous (the TCPStore at MASTER_ADDR) before the process group
connects them to each other. What would make that connection hang for ``--init-timeout``
and then fail with a backend's message is checked here, through the store:

- a rank that cannot reach the rendezvous, or a rendezvous that not every rank reaches;
- a host whose name resolves to a loopback address (Debian writes ``127.0.1.1 HOSTNAME``
  into /etc/hosts) in a job that spans hosts: Gloo would offer the others that address;
- hosts with different versions of torch, dmltrain or Horovod;
- two ranks of an NCCL job on one GPU: Slurm may give each task its own GPU
  (``--gpus-per-task 1``: each sees one, as its ``cuda:0``) or every task all of the
  node's (``--gpus-per-node``); only the GPUs' UUIDs tell which, so the node's ranks
  compare them here.
"""

import datetime
import json
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from dmltrain.errors import UserError, first_line
from dmltrain.runtime.diagnostics import package_version
from dmltrain.runtime.launch import hostname


def rendezvous(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    seconds: float,
    interface_set: bool,
    agent_attempt: int | None = None,
    nccl_device: str | None = None,
) -> Any:
    """Meet the other ranks at the TCPStore on ``addr:port`` (rank 0 holds it, or with
    ``agent_attempt`` torchrun's agent does), then make the checks across hosts
    (``check``); the store, for the process group and the roll call after a failed
    collective (``dmltrain.runtime.peers``). ``nccl_device``: this rank's GPU in an NCCL
    job, which no other rank may share. Failures are one line naming the node."""
    here = hostname()
    held = agent_attempt is not None  # rank 0 binding the agent's port fails, with a line
    try:
        store: Any = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=rank == 0 and not held,
            timeout=datetime.timedelta(seconds=seconds),
        )
    except RuntimeError as exc:  # DistStoreError and the transport's timeouts
        raise _rendezvous_failed(exc, rank, f"{addr}:{port}", here, seconds) from None
    if held:  # the agent's store outlives a restart of its workers: keys of this attempt
        store = dist.PrefixStore(f"/dmltrain/attempt_{agent_attempt}", store)
    check(store, rank, world_size, here, interface_set, nccl_device)
    return store


def _rendezvous_failed(
    exc: BaseException, rank: int, where: str, here: str, seconds: float
) -> UserError:
    """The one line for a TCPStore that could not be made (``exc``) on this rank."""
    text = str(exc)
    if rank == 0 and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        return UserError(
            f"rank 0 on {here}: the rendezvous port {where.rsplit(':', 1)[-1]} is in use by "
            "another program: set MASTER_PORT to a free port (under Slurm, leave it unset: "
            "the job id picks one)"
        )
    if rank == 0:
        return UserError(
            f"rank 0 on {here}: not every rank reached the rendezvous at {where} within "
            f"{seconds:g} s (--init-timeout; {first_line(exc)}): the others cannot reach "
            "this address (MASTER_ADDR) or did not start"
        )
    return UserError(
        f"rank {rank} on {here} cannot reach the rendezvous at {where} (MASTER_ADDR) "
        f"within {seconds:g} s (--init-timeout): check that the nodes can reach each other "
        "at that address"
    )


def _resolves_to(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _packages() -> dict[str, str | None]:
    return {"torch": torch.__version__, **{n: package_version(n) for n in ("dmltrain", "horovod")}}


def gpu(device: str | None) -> dict[str, Any] | None:
    """The GPU ``device`` names, as preflight compares it: its UUID, and what this process
    sees (for the message)."""
    if device is None:
        return None
    properties = torch.cuda.get_device_properties(torch.device(device))
    return {"uuid": str(properties.uuid), "device": device, "sees": torch.cuda.device_count()}


def check(
    store: Any,
    rank: int,
    world_size: int,
    here: str,
    interface_set: bool,
    nccl_device: str | None = None,
) -> None:
    """Every rank posts its host, the address its name resolves to, its versions and its
    GPU; rank 0 reads them all in one request and posts one verdict, which every rank reads
    and raises as the same UserError when something is wrong: 2 requests a rank (3 for
    rank 0), not N+1 (the store's load grows as N, not N²). ``interface_set``:
    GLOO_SOCKET_IFNAME chooses the address, so the name's does not matter."""
    mine = {"host": here, "address": _resolves_to(here), "versions": _packages(),
            "gpu": gpu(nccl_device)}  # fmt: skip
    store.set(f"{_POST}/{rank}", json.dumps(mine))
    if rank == 0:  # multi_get waits for every key
        posts = store.multi_get([f"{_POST}/{r}" for r in range(world_size)])
        problem = _problem([json.loads(post) for post in posts], interface_set)
        store.set(_VERDICT, json.dumps(problem))
    else:
        problem = json.loads(store.get(_VERDICT))
    if problem is None:
        return
    if rank == 0:  # the store leaves with rank 0: the others read the verdict first
        deadline = time.monotonic() + 30.0
        while store.add(_READ, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        store.add(_READ, 1)
    raise UserError(problem)


_POST = "dmltrain/preflight"  # each rank's post, under its rank
_VERDICT = "dmltrain/preflight-verdict"  # rank 0's: null, or the problem's line
_READ = "dmltrain/preflight-read"  # how many ranks other than 0 have read a problem


def _problem(ranks: list[dict[str, Any]], interface_set: bool) -> str | None:
    """What is wrong with the ranks' hosts and versions (the same on every rank), or None."""
    hosts = {r["host"]: r for r in ranks}
    if len(hosts) > 1 and not interface_set:
        loopback = [
            f"{h} ({r['address']})"
            for h, r in hosts.items()
            if (r["address"] or "").startswith("127.")
        ]
        if loopback:
            return (
                f"the job spans {len(hosts)} hosts, and the name of {', '.join(loopback)} "
                "resolves to a loopback address the others cannot reach: map it to the "
                "node's network address in /etc/hosts, or set GLOO_SOCKET_IFNAME (and "
                "NCCL_SOCKET_IFNAME) to the network interface"
            )
    for package in ("torch", "dmltrain", "horovod"):
        seen: dict[str | None, list[str]] = {}
        for host, r in hosts.items():
            seen.setdefault(r["versions"].get(package), []).append(host)
        if len(seen) > 1:
            which = "; ".join(f"{v or 'not installed'} on {', '.join(h)}" for v, h in seen.items())
            return (
                f"the nodes run different versions of {package}: {which}: install the same "
                "environment on every node"
            )
    return _shared_gpu(ranks)


def _shared_gpu(ranks: list[dict[str, Any]]) -> str | None:
    """Two ranks of an NCCL job on one GPU (NCCL cannot run them), or None."""
    users: dict[tuple[str, str], list[int]] = {}
    for rank, r in enumerate(ranks):
        if r.get("gpu"):
            users.setdefault((r["host"], r["gpu"]["uuid"]), []).append(rank)
    for (host, _), sharing in users.items():
        if len(sharing) > 1:
            on_host = sum(r["host"] == host for r in ranks)
            a, b = (ranks[i]["gpu"] for i in sharing[:2])
            return (
                f"ranks {sharing[0]} and {sharing[1]} on {host} use the same GPU ({a['device']} "
                f"and {b['device']}, each process seeing {a['sees']} and {b['sees']} GPU(s); "
                f"{on_host} processes on that node): NCCL needs a GPU for each process: start "
                "at most one process per GPU (srun --gpus-per-task 1, or as many tasks a node "
                "as --gpus-per-node), or use --backend gloo"
            )
    return None

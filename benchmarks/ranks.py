"""What dmltrain's own work costs a rank as the job grows: 2, 4 and 8 Gloo processes here.

    python benchmarks/ranks.py            # 2, 4 and 8 ranks, a 100M-value sharded state
    python benchmarks/ranks.py --quick    # 2 and 4 ranks, a smaller state
    python benchmarks/ranks.py --smoke    # 2 ranks

Connections: the TCP connections a rank other than 0 holds to its peers (not to the
store) after the collectives a training run makes (all-reduce, broadcast, barrier), with
Gloo's full mesh (torch's default) and with the lazy connections dmltrain sets. Sharded
save: how long the loop is blocked by a save of an FSDP-like state (every tensor sharded
over the ranks, with two optimizer states each), the slowest rank's, median of the
repetitions after the first, interleaved: ``dcp.save`` with its default planner (every
save plans anew; dmltrain's save before), dmltrain's synchronous save (cached plan,
pruning after the closing barrier) and its asynchronous save (the loop waits for a copy).
Full resume: how many ranks open the checkpoint file (each such rank on a node of its own
reads it from the file system) and the seconds until every rank holds its state, from a
cold file, against one read of it by one rank.

One rank's part of a sharded save at 1,024 ranks: a 16 GB checkpoint is 16 MB a rank, but
still one shard of every tensor: 291 weights (as many as Llama 2 7B has) and two Adam
states each. One process saves such a state; the copy is timed through DTensor's public
``to_local``/``from_local`` and with dmltrain's copy into the last save's wrappers.
"""

import argparse
import contextlib
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def peer_connections(store_port: int) -> int:
    """This process's established TCP connections, but those to or from the store."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            ports = {int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)}
            count += fields[3] == "01" and fields[9] in inodes and store_port not in ports
    return count


def connections(rank: int, world: int, port: int, lazy: bool, out: dict) -> None:
    if lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.all_reduce(torch.ones(1000))
    dist.broadcast(torch.ones(1000), src=0)
    dist.barrier()
    out[rank] = peer_connections(port)
    dist.barrier()
    dist.destroy_process_group()


def share_cores(world: int) -> None:
    """Each rank its share of the cores' threads, as dmltrain gives a rank: with torch's
    default (all cores) in every rank, 4 ranks on 2 cores made a 100 MB copy take seconds."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def sharded_state(world: int, values: int, weights: int | None = None) -> dict:
    """Model and optimizer state dicts of DTensors sharded over the ranks, as FSDP's:
    512x512 weights, or ``weights`` of them in one dimension, with two Adam states each."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    side = 512
    layers = weights or max(1, values // (3 * side * side))
    shape = (side, side) if weights is None else (values // (3 * weights),)
    torch.manual_seed(0)
    model, optim = {}, {}
    for layer in range(layers):
        name = f"layers.{layer}.weight"
        model[name] = distribute_tensor(torch.randn(shape), mesh, [Shard(0)])
        optim[name] = {
            "exp_avg": distribute_tensor(torch.randn(shape), mesh, [Shard(0)]),
            "exp_avg_sq": distribute_tensor(torch.rand(shape), mesh, [Shard(0)]),
            "step": torch.tensor(1.0),
        }
    return {"model": model, "optimizer": {"state": optim}}


def gloo(rank: int, world: int, port: int) -> None:
    """This rank in a Gloo process group with lazy connections, as dmltrain makes them."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=300))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def saves(rank: int, world: int, port: int, root: str, values: int, repeats: int,
          out: dict) -> None:  # fmt: skip
    import torch.distributed.checkpoint as dcp

    from dmltrain.checkpoint.storage import CheckpointDir

    share_cores(world)
    gloo(rank, world, port)
    background = dist.new_group(backend="gloo")
    shards = sharded_state(world, values)
    plain = Path(root) / "plain"
    sync = CheckpointDir(Path(root) / "sync", keep_last=1)
    later = CheckpointDir(Path(root) / "async", keep_last=1, asynchronous=True)
    meta = {"global_step": 0} if rank == 0 else None

    def default_planner(step: int) -> None:
        dcp.save(shards, storage_writer=dcp.FileSystemWriter(str(plain / str(step))))

    def dmltrain_sync(step: int) -> None:
        sync.save_sharded(shards, meta, 1, step, False, dist.barrier)

    def dmltrain_async(step: int) -> None:
        later.save_sharded(shards, meta, 1, step, False, dist.barrier, True, background)

    contenders = {"dcp.save, default planner": default_planner,
                  "dmltrain sync, cached plan": dmltrain_sync,
                  "dmltrain async": dmltrain_async}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for step in range(repeats + 1):
        for name, save in contenders.items():
            dist.barrier()
            started = time.perf_counter()
            save(step)
            times[name].append(time.perf_counter() - started)
            later.wait()  # each contender starts from a quiet disk
            sync.wait()
            if rank == 0:
                shutil.rmtree(plain / str(step), ignore_errors=True)
    out[rank] = {name: seconds[1:] for name, seconds in times.items()}  # after the first
    dist.barrier()
    dist.destroy_process_group()


def wrapped_copy(obj: dict, into: dict) -> dict:
    """A copy of nested DTensor shards through ``to_local`` and ``from_local``."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = into.to_local().copy_(obj.to_local())
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())  # fmt: skip
    if isinstance(obj, dict):
        return {key: wrapped_copy(value, into[key]) for key, value in obj.items()}
    return into.copy_(obj) if isinstance(obj, torch.Tensor) else obj


def rank_part(rank: int, world: int, port: int, root: str, weights: int, repeats: int,
              out: dict) -> None:  # fmt: skip
    from dmltrain.checkpoint.snapshot import snapshot
    from dmltrain.checkpoint.storage import CheckpointDir

    torch.set_num_threads(1)  # a rank's share of a node's cores
    gloo(rank, world, port)
    shards = sharded_state(world, 16 * 2**20 // 4, weights)  # 16 MB a rank
    copy = snapshot(shards)
    sync = CheckpointDir(Path(root) / "sync", keep_last=1)
    later = CheckpointDir(Path(root) / "async", keep_last=1, asynchronous=True)
    meta = {"global_step": 0}
    contenders = {
        "copy through to_local/from_local": lambda step: wrapped_copy(shards, copy),
        "dmltrain's copy": lambda step: snapshot(shards, copy),
        "dmltrain sync save": lambda step: sync.save_sharded(
            shards, meta, 1, step, False, dist.barrier),
        "dmltrain async save": lambda step: later.save_sharded(
            shards, meta, 1, step, False, dist.barrier, True, None),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for step in range(repeats + 1):
        for name, run in contenders.items():
            started = time.perf_counter()
            run(step)
            times[name].append(time.perf_counter() - started)
            later.wait()
            sync.wait()
    out[rank] = {name: statistics.median(seconds[1:]) for name, seconds in times.items()}
    out["bytes"] = sum(t.to_local().numel() * 4 for t in shards["model"].values()) * 3
    dist.destroy_process_group()


def resumes(rank: int, world: int, port: int, path: str, out: dict) -> None:
    """Every rank gets the same full checkpoint and uses every tensor, each time from a
    cold file (its pages dropped from the cache): rank 0 alone reading it (one read, the
    goal's measure), each rank ``torch.load``ing it (dmltrain's load two versions ago),
    each rank mapping it (``load_file``; the last version), rank 0 mapping it and handing
    it out (``hand_out``: dmltrain's resume now), and the same from a file rank 0 has
    already read (the hand-out's other stages alone: packing, broadcasts, unpacking). For
    each, whether this rank opened the file, and the seconds until the slowest rank holds
    it. The ranks here share one page cache, so the first two read the disk about once:
    what matters across nodes is how many ranks open the file."""
    from dmltrain.checkpoint.handout import hand_out
    from dmltrain.checkpoint.storage import load_file
    from dmltrain.config import DistConfig
    from dmltrain.runtime.launch import DistInfo
    from dmltrain.runtime.strategies import DDPStrategy

    share_cores(world)
    strategy = DDPStrategy(DistInfo(rank=rank, world_size=world, master_port=port),
                           DistConfig(backend="gloo"))  # fmt: skip
    strategy.setup()
    opened = {"now": ""}
    sys.addaudithook(lambda event, args: event == "open" and str(args[0]) == path
                     and opened.update({opened["now"]: "yes"}))  # fmt: skip

    def use(state: dict | None) -> float:
        return 0.0 if state is None else float(sum(t.sum() for t in state["model"].values()))

    loads = {"one read": lambda: load_file(Path(path)) if rank == 0 else None,
             "torch.load": lambda: torch.load(path, weights_only=True),
             "mmap": lambda: load_file(Path(path)),
             "hand_out": lambda: hand_out(strategy, load_file(Path(path)) if rank == 0
                                          else None),
             "hand_out, read before": lambda: hand_out(strategy, read)}  # fmt: skip
    measured = {}
    for name, load in loads.items():
        opened["now"] = name
        if rank == 0:
            with open(path, "rb") as handle:  # cold: as on a node that has not read it
                os.fsync(handle.fileno())  # written pages can be dropped once on disk
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        read = load_file(Path(path)) if rank == 0 and name.endswith("read before") else None
        use(read)  # its pages in memory before the clock starts
        dist.barrier()
        started = time.perf_counter()
        use(load())
        dist.barrier()  # until the slowest rank holds it
        measured[name] = (name in opened, time.perf_counter() - started)
    out[rank] = measured
    strategy.teardown()


def spawn(target, world: int, *args) -> dict:
    from dmltrain.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=target, args=(rank, world, port, *args, out))
                 for rank in range(world)]  # fmt: skip
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
            if proc.exitcode != 0:
                raise RuntimeError(f"a rank of {target.__name__} at {world} ranks failed")
        return dict(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    worlds = (2,) if args.smoke else (2, 4) if args.quick else (2, 4, 8)
    values = 3 * 512 * 512 * (4 if args.smoke else 32 if args.quick else 128)
    repeats = 2 if args.smoke else 3
    weights = 24 if args.smoke else 291  # a rank's part at 1,024: its shard of each weight
    lines = [
        "| ranks | connections a rank: full mesh | lazy (dmltrain) | sharded save blocks: "
        "dcp.save, default planner (s) | dmltrain sync (s) | dmltrain async (s) | "
        "async / sync | full resume, ranks that open the file (s): one read, rank 0 alone | "
        "every rank torch.load | every rank maps | rank 0 hands out (dmltrain) | "
        "the same, the file read before | hand-out / one read | hand-out / its slower part "
        "alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for world in worlds:
        held = {lazy: max(spawn(connections, world, lazy)[r] for r in range(1, world))
                for lazy in (False, True)}  # fmt: skip
        root = Path(tempfile.mkdtemp(prefix="dmltrain-bench-ranks-"))
        try:
            ranks = spawn(saves, world, str(root), values, repeats)
            checkpoint = root / "full.pt"
            model = {f"w{i}": torch.randn(values // 64) for i in range(64)}
            torch.save({"model": model, "format_version": 1}, checkpoint)
            loaded = spawn(resumes, world, str(checkpoint))
            size = checkpoint.stat().st_size
        finally:
            shutil.rmtree(root, ignore_errors=True)
        blocked = {
            name: statistics.median(
                max(ranks[r][name][i] for r in ranks) for i in range(repeats)
            )  # the loop waits for the slowest rank
            for name in ranks[0]
        }
        old, sync, later = blocked.values()
        resume = {  # ranks that opened the file, the slowest rank's seconds
            name: (sum(loaded[r][name][0] for r in loaded), max(loaded[r][name][1] for r in loaded))
            for name in loaded[0]
        }
        slower = max(resume["one read"][1], resume["hand_out, read before"][1])
        staged = resume["hand_out"][1] / slower
        ratios = {
            "sharded save: async / sync blocking": later / sync,
            "connections a rank: lazy / full mesh": held[True] / held[False],
            "full resume: ranks that open the file, hand-out / every rank": (
                resume["hand_out"][0] / resume["torch.load"][0]
            ),
            "full resume: hand-out / one read (s)": resume["hand_out"][1] / resume["one read"][1],
            "full resume: hand-out / the slower of the read and the rest (s)": staged,
        }  # at the most ranks measured
        lines.append(f"| {world} | {held[False]} | {held[True]} | {old:.3f} | {sync:.3f} | "
                     f"{later:.3f} | {later / sync:.2f}x | "
                     + " | ".join(f"{n} ({t:.2f})" for n, t in resume.values())
                     + f" | {resume['hand_out'][1] / resume['one read'][1]:.2f}x | "
                     + f"{staged:.2f}x |")  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="dmltrain-bench-ranks-"))
    try:
        part = spawn(rank_part, 1, str(root), weights, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = part[0]
    part_ratio = seconds["dmltrain async save"] / seconds["dmltrain sync save"]
    ratios["one rank's part at 1,024: async / sync blocking"] = part_ratio
    lines += [
        "",
        f"One rank's part of a sharded save at 1,024 ranks ({part['bytes'] / 2**20:.0f} MiB "
        f"in {3 * weights} shards, one process, median of {repeats} after the first):",
        "",
        "| " + " | ".join(f"{name} (ms)" for name in seconds) + " | async / sync |",
        "|" + "---|" * (len(seconds) + 1),
        "| " + " | ".join(f"{t * 1e3:.1f}" for t in seconds.values()) + f" | {part_ratio:.2f}x |",
    ]
    head = (f"sharded state: {values / 1e6:.0f}M values over the ranks; median of {repeats} "
            "saves after the first, the slowest rank's, interleaved; full resume: a "
            f"{size / 2**20:.0f} MiB checkpoint, cold before each way")  # fmt: skip
    text = "\n".join([head, "", *lines])
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios}


if __name__ == "__main__":
    main()

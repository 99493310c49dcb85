"""How long a checkpoint save blocks training: straight to the run directory against the
node-local tier (``--local-checkpoint-dir``), and how fast the tier drains.

    python benchmarks/checkpoint_tiers.py            # 1 GiB and 10 GiB states
    python benchmarks/checkpoint_tiers.py --quick    # 64 MiB

Here the run directory is on the machine's disk and the local tier in /dev/shm (memory),
as a node's NVMe stands before a shared file system. Both kinds of checkpoint: a full one
(one file, rank 0's) and a sharded one (torch.distributed.checkpoint's files, one process
here). The state's tensors are mapped from a sparse file, so a 10 GiB state costs page
cache, not the process's memory.

Contenders for each size and kind, one after the other: ``dd`` to the run directory's
disk (fsync: the disk's rate), dmltrain's save straight there (fsync, rename, links), and
the save through the tier (the loop waits for the local write; the drain runs after).
"""

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dmltrain.checkpoint.storage import CheckpointDir
from dmltrain.checkpoint.tiers import TieredDir

CHUNK = 256 << 20  # bytes a tensor of the state


def make_state(backing: Path, size: int) -> dict:
    """``size`` bytes of float32 tensors mapped from ``backing`` (sparse: no disk read)."""
    with open(backing, "wb") as handle:
        handle.truncate(size)
    whole = torch.from_file(str(backing), shared=False, size=size // 4, dtype=torch.float32)
    chunk = min(CHUNK, size)
    per = chunk // 4
    return {"model": {f"w{i}": whole[i * per : (i + 1) * per] for i in range(size // chunk)}}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save(store: CheckpointDir, state: dict, sharded: bool) -> None:
    if sharded:
        store.save_sharded(state, {"step": 1}, 1, 1, False, lambda: None)
    else:
        store.save(state, 1, 1, best=False)


def measure(size: int, shared: Path, local: Path, sharded: bool) -> dict[str, float]:
    state = make_state(shared / "backing.bin", size)
    dd = timed(
        lambda: subprocess.run(
            ["dd", "if=/dev/zero", f"of={shared / 'dd.bin'}", "bs=16M",
             f"count={size // (16 << 20)}", "conv=fsync"],
            check=True, capture_output=True,
        )
    )  # fmt: skip
    (shared / "dd.bin").unlink()
    straight = CheckpointDir(shared / "straight", keep_last=1)
    blocked_straight = timed(lambda: save(straight, state, sharded))
    shutil.rmtree(shared / "straight")
    tier = TieredDir(shared / "tiered", local, keep_last=1, warn=print)
    began = time.perf_counter()
    blocked_tier = timed(lambda: save(tier, state, sharded))
    tier.settle()
    drained = time.perf_counter() - began - blocked_tier
    shutil.rmtree(shared / "tiered")
    (shared / "backing.bin").unlink()
    return {"dd": dd, "straight": blocked_straight, "tier": blocked_tier, "drain": drained}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 64 MiB state")
    parser.add_argument("--dir", default=None, help="the run directory's disk (a temp dir)")
    parser.add_argument("--local", default="/dev/shm", help="the node-local tier's folder")
    args = parser.parse_args(argv)
    sizes = [64 << 20] if args.quick else [1 << 30, 10 << 30]
    shared = Path(tempfile.mkdtemp(prefix="dmltrain-tiers-", dir=args.dir))
    local = Path(tempfile.mkdtemp(prefix="dmltrain-tiers-", dir=args.local))
    lines = [
        "checkpoint tiers: one full checkpoint; the run directory on the disk, the local "
        f"tier in {args.local}",
        "| state | checkpoint | dd to the disk (s) | save straight (s) | save through the "
        "tier: blocking (s) | its drain (s) | drain vs dd rate | blocking vs straight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    try:
        for size in sizes:
            for sharded in (False, True):
                t = measure(size, shared, local, sharded)
                gib, kind = size / 2**30, "sharded" if sharded else "full"
                lines.append(
                    f"| {gib:g} GiB | {kind} | {t['dd']:.2f} | {t['straight']:.2f} | "
                    f"{t['tier']:.2f} | {t['drain']:.2f} | {t['dd'] / t['drain']:.2f}x | "
                    f"{t['tier'] / t['straight']:.2f}x |"
                )
                ratios[f"checkpoint tiers {gib:g} GiB {kind}: blocking, tier / straight"] = (
                    t["tier"] / t["straight"]
                )
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios}


if __name__ == "__main__":
    main()

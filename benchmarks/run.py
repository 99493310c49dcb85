"""Run every benchmark and write RESULTS.md and results.png.

    python -m benchmarks.run            # full mode (about 13 minutes on 2 CPU cores)
    python -m benchmarks.run --quick    # quick mode (minutes)
    python -m benchmarks.run --smoke    # each at its smallest: the scripts run (the tests)
    python -m benchmarks.run --quick --out /tmp/bench --only overhead,startup
    python -m benchmarks.run --only collectives --update   # re-run one; keep the others

RESULTS.md: the machine, versions and date, the targets with what was measured, each
benchmark's table, and the hand-written findings (benchmarks/findings.md: what was slow,
why, and the numbers before and after the fix). results.json: the raw numbers.
results.png: every ratio as a bar.
"""

import argparse
import datetime
import importlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.common import machine  # noqa: E402

# Those whose quick mode still takes tens of seconds, and that have a smaller size (--smoke).
SMOKE_SIZES = (
    "overhead", "startup", "scaling", "threads", "big_models", "ranks", "user_runs",
    "search_pruning", "archive_read",
)  # fmt: skip
BENCHMARKS = [
    "overhead",
    "startup",
    "checkpoint",
    "checkpoint_tiers",
    "scaling",
    "nan_check",
    "threads",
    "data_pipeline",
    "collectives",
    "ema",
    "monitor",
    "streaming",
    "archive_read",
    "big_models",
    "ranks",
    "step_counts",
    "user_runs",
    "search_pruning",
]


def versions() -> str:
    names = ["dmltrain", "torch", "lightning", "accelerate", "dmlcloud"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def targets(reports: dict) -> list[tuple[str, str, str, bool]]:
    """(target, measured, goal, met) for each target this run measured."""
    rows = []
    over = reports.get("overhead", {}).get("ratios", {})
    if "cnn: dmltrain" in over:
        ratio = over["cnn: dmltrain"]
        goal = 1.03 if "cuda" in str(reports["overhead"].get("device")) else 1.01
        rows.append(("MNIST CNN step time vs plain loop", f"{ratio:.3f}x", f"<= {goal}x",
                     ratio <= goal))  # fmt: skip
    for model, title in (("cnn", "MNIST CNN"), ("tiny", "tiny model (the frameworks' own work)")):
        if f"{model}: dmltrain" not in over:
            continue
        ratio = over[f"{model}: dmltrain"]
        peers = {k.split(": ")[1]: v for k, v in over.items() if k.startswith(f"{model}: ")}
        peers = {k: v for k, v in peers.items() if k not in ("plain", "plain-twin", "dmltrain")}
        if not peers:
            continue
        # Lower counts only by more than two identical plain loops landed apart.
        low, high = reports["overhead"]["twin_range"][model]
        margin = (high - low) / 2
        best = min(peers, key=lambda k: peers[k])
        rows.append((f"{title}: below every peer", f"{ratio:.3f}x vs {best} {peers[best]:.3f}x "
                     f"(identical loops: {low:.3f}-{high:.3f}x)", f"lower by > {margin:.3f}",
                     all(ratio < v - margin for v in peers.values())))  # fmt: skip
    tiny_us = reports.get("overhead", {}).get("extra_us", {}).get("tiny")
    if tiny_us is not None and reports["overhead"].get("device") == "cpu":  # a CPU's goal
        low, high = reports["overhead"]["twin_range"]["tiny"]
        rows.append(("tiny model: dmltrain's time per step over the plain loop (monitoring on)",
                     f"{tiny_us:+.0f} us ({over['tiny: dmltrain']:.3f}x; identical loops: "
                     f"{low:.3f}-{high:.3f}x)", "<= +20 us", tiny_us <= 20))  # fmt: skip
    extra = reports.get("startup", {}).get("seconds_over_torch", {})
    walls = reports.get("startup", {}).get("wall_seconds_over_torch", {})
    for name in ("import dmltrain", "dmltrain --help"):
        if name in extra:
            rows.append((f"`{name}` over `import torch` (after it, in one process)",
                         f"{extra[name]:+.2f} s (fresh processes: {walls[name]:+.2f} s)",
                         "<= 0.3 s", extra[name] <= 0.3))  # fmt: skip
    start = reports.get("startup", {}).get("ratios", {})
    if "first step dmltrain / plain" in start:
        r = start["first step dmltrain / plain"]
        rows.append(("time to first step vs plain loop", f"{r:.2f}x", "<= 1.2x", r <= 1.2))
    ck = reports.get("checkpoint", {}).get("ratios", {})
    if ck:
        r = ck["checkpoint: async / sync blocking"]
        rows.append(("async checkpoint blocking vs sync save", f"{r:.2f}x", "<= 0.10x", r <= 0.1))
    ranks = reports.get("ranks", {}).get("ratios", {})
    if ranks:
        r = ranks["sharded save: async / sync blocking"]
        rows.append(("async sharded checkpoint blocking vs sync save", f"{r:.2f}x", "<= 0.10x",
                     r <= 0.1))  # fmt: skip
        r = ranks.get("one rank's part at 1,024: async / sync blocking")
        if r is not None:  # results written before this row existed have none
            rows.append(("async sharded checkpoint blocking vs sync save, one rank's part at "
                         "1,024 ranks", f"{r:.2f}x", "<= 0.10x", r <= 0.1))  # fmt: skip
    counts = reports.get("step_counts", {}).get("counts", {})
    if counts:
        base = counts["plain"]["reads"]
        own = ("plain", "plain-unfused", "log-every", "nan-log-every", "unfused", "nan-unfused")
        over = {k: v["reads"] - base for k, v in counts.items() if k not in own}
        most = max(over.values())
        worst = [k for k, v in over.items() if v == most]
        rest = max([0.0] + [v for k, v in over.items() if k not in worst])
        said = (f"{most:+.2f} in each of {len(over)}" if len(worst) == len(over) else
                f"{most:+.2f} ({', '.join(worst)}; the others {rest:+.2f})")  # fmt: skip
        rows.append(("host reads a step beyond the plain loop, every configuration", said,
                     "+0", most <= 0))  # fmt: skip
    if "vit: dmltrain" in reports.get("overhead", {}).get("ratios", {}):
        r = reports["overhead"]["ratios"]["vit: dmltrain"]
        rows.append(("ViT-Base in bf16 step time vs plain loop", f"{r:.3f}x", "<= 1.01x",
                     r <= 1.01))  # fmt: skip
    runs = reports.get("user_runs", {})
    if runs:
        failed = runs["failed"]
        rows.append(("`dmltrain mnist` in each precision, checked, compiled, DDP and FSDP: "
                     "every run exits 0", f"{len(runs['runs']) - len(failed)} of "
                     f"{len(runs['runs'])}" + (f" (failed: {', '.join(failed)})" if failed else ""),
                     "all", not failed))  # fmt: skip
        first, second = runs["compile_first_job_s"], runs["compile_next_job_s"]
        rows.append(("--compile: the next job (as many steps, the compiled code loaded) vs the "
                     "first, wall time",
                     f"{second:.1f} s vs {first:.1f} s", "shorter", second < first))  # fmt: skip
    nan = reports.get("nan_check", {}).get("ratios", {})
    if nan:
        r = nan["nan-check: on / off"]
        low, high = reports["nan_check"]["twin_range"]
        rows.append(("step time with --check-nans", f"{r:.3f}x (identical runs: {low:.3f}-"
                     f"{high:.3f}x)", "<= 1.02x", r <= 1.02))  # fmt: skip
    sc = reports.get("scaling", {}).get("ratios", {})
    if sc:
        r = sc["dmltrain: 2 processes / 1 (samples/s)"]
        p = sc["plain: 2 processes / 1 (samples/s)"]
        alone = sc.get("independent: 2 processes / 1 (samples/s)")
        without = f"{alone:.2f}x" if alone is not None else "not run"
        rows.append(("2 processes vs 1 (samples/s)", f"{r:.2f}x (hand-written DDP: {p:.2f}x; "
                     f"2 processes without communication: {without})", ">= 1.7x",
                     r >= 1.7))  # fmt: skip
    th = reports.get("threads", {}).get("ratios", {})
    if th:
        r = th["mnist --nprocs 2 epoch: after / before"]
        rows.append(("`dmltrain mnist --nprocs 2` epoch: each process's share of the cores vs "
                     "every core each", f"{r:.2f}x", "< 1.0x", r < 1.0))  # fmt: skip
    dp = reports.get("data_pipeline", {}).get("us_per_sample", {})
    if dp:
        us = dp["augmented, 0 workers"]
        rows.append(("per-sample seeds in the training process (augmented MNIST, 0 workers)",
                     f"{us:+.1f} us a sample", "<= 15 us", us <= 15))  # fmt: skip
    st = reports.get("streaming", {})
    if st:
        worst = max(v for k, v in st["ratios"].items() if "stream / map-style" in k)
        rows.append(("a stream vs map-style data through dmltrain's loaders (MNIST digits, 0 "
                     "and 2 workers)", f"{worst:.2f}x the time (the slower)", "<= 1.10x",
                     worst <= 1.1))  # fmt: skip
        r = st["ratios"]["streaming in training: place kept / not"]
        rows.append(("keeping a stream's place in every batch (StatefulDataLoader vs torch's), "
                     "the MNIST CNN's step time, 2 workers", f"{r:.3f}x", "<= 1.01x",
                     r <= 1.01))  # fmt: skip
    ar = reports.get("archive_read", {}).get("ratios", {})
    if ar:
        r = ar["archive, shuffled, 0 workers: MB/s / sequential"]
        best = max(v for k, v in ar.items() if "shuffled" in k and " 0 workers" not in k)
        rows.append(("a climate archive read in shuffled windows (ZarrWindows, in the training "
                     "process) vs decoding its arrays in order, MB/s of distinct data",
                     f"{r:.2f}x (with workers: {best:.2f}x)", ">= 0.80x", r >= 0.8))  # fmt: skip
    ema = reports.get("ema", {})
    if "extra_ms" in ema:
        low, high = ema["twin_range"]
        noise = (high - low) / 2 * ema["ms"]["off"]  # how far identical runs land apart, ms
        rows.append(("--ema-decay: extra time a step vs one _foreach_lerp_ of the weights",
                     f"{ema['extra_ms']:+.3f} ms vs {ema['lerp_ms']:.3f} ms (identical runs: "
                     f"+-{noise:.3f} ms)", "<= one lerp + noise",
                     ema["extra_ms"] <= ema["lerp_ms"] + noise))  # fmt: skip
    mo = reports.get("monitor", {}).get("ratios", {})
    if mo:
        r = mo["monitor: cnn on / off"]
        low, high = reports["monitor"]["twin_range"]
        rows.append(("monitoring on by default (throughput, stragglers, hangs): MNIST CNN step "
                     "time vs all of it off", f"{r:.3f}x (identical runs: {low:.3f}-{high:.3f}x;"
                     f" tiny model {reports['monitor']['extra_us']:+.1f} us a step)", "<= 1.01x",
                     r <= 1.01))  # fmt: skip
    se = reports.get("search_pruning", {})
    for pruner, found in se.get("pruners", {}).items():
        low, high = se["spread"]
        rows.append((f"`dmltrain sweep mnist --search tpe --pruner {pruner}`, {se['trials']} "
                     "trials: steps trained vs no pruner", f"{found['share']:.2f}x", "<= 0.50x",
                     found["share"] <= 0.5))  # fmt: skip
        rows.append((f"... --pruner {pruner}: its best val_loss (mean over {found['seeds']} "
                     "seeds) vs the unpruned searches' spread", f"{found['mean_best']:.4f} vs "
                     f"{low:.4f}-{high:.4f} ({found['inside']} of {found['seeds']} seeds inside)",
                     "within", found["within_spread"]))  # fmt: skip
    co = reports.get("collectives", {}).get("model_1024_ranks_20us")
    if co:
        share, interval = co["pairwise_share"], co["pairwise_interval"]
        rows.append(("preemption agreement at 1,024 ranks (pairwise exchanges, 20 us a hop and "
                     "this machine's round): share of training time",
                     f"{share:.2%} (interval {interval:.1f} s; the ring all-reduce before: "
                     f"{co['scaled_share']:.2%}, interval {co['scaled_interval']:.1f} s)",
                     "<= 1%", share <= 0.01 + 1e-9))  # fmt: skip
    return rows


def plot(reports: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # a GPU machine with its own packages (gpu_proof.py)
        print(f"{path.name} not drawn: matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = {k: v for r in reports.values() for k, v in r.get("ratios", {}).items()}
    labels = list(ratios)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(labels) + 1.2))
    ax.barh(range(len(labels)), [ratios[k] for k in labels], color="#4c72b0")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio (see RESULTS.md for what each is relative to)")
    ax.set_title("dmltrain benchmarks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of each")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="quick, and each benchmark at its smallest size: the scripts run and write their "
        "results (the test suite); the figures mean nothing",
    )
    parser.add_argument("--out", default=str(HERE), help="where RESULTS.md and results.png go")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the other benchmarks' sections of OUT/results.json (each says when it ran)",
    )
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else BENCHMARKS
    unknown = set(chosen) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.quick = args.quick or args.smoke
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    reports, started = {}, time.monotonic()
    if args.update and (out / "results.json").is_file():
        kept = json.loads((out / "results.json").read_text())
        reports = {name: kept[name] for name in BENCHMARKS if name in kept}
    for name in chosen:
        print(f"== {name}", flush=True)
        began = time.monotonic()
        module = importlib.import_module(f"benchmarks.{name}")
        flags = ["--quick"] if args.quick else []
        if args.smoke and name in SMOKE_SIZES:
            flags.append("--smoke")
        reports[name] = module.main(flags)
        reports[name]["written"] = f"{datetime.date.today()}, {mode} mode"
        print(f"== {name}: {time.monotonic() - began:.0f} s", flush=True)
    reports = {name: reports[name] for name in BENCHMARKS if name in reports}
    rerun = (
        f"; re-run: {', '.join(chosen)}, the other sections kept from earlier runs (each "
        "section says when it ran)."
    )
    lines = [
        "# Benchmark results",
        "",
        f"Written by `python -m benchmarks.run{'' if mode == 'full' else ' --' + mode}` on "
        f"{datetime.date.today()} ({mode} mode, {time.monotonic() - started:.0f} s)"
        + (rerun if args.update else "."),
        f"Machine: {machine()}.",
        f"Versions: {versions()}.",
        "",
        "Each table comes from one run with its contenders interleaved (A B C, A B C, ...): "
        "the overhead contenders take turns within each process (see its heading), the "
        "others in fresh processes; ratios are to the row named in the table.",
        "",
        "## Targets",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
        *(f"| {t} | {m} | {g} | {'yes' if ok else 'NO'} |" for t, m, g, ok in targets(reports)),
    ]
    for name, report in reports.items():
        when = f"Run on {report['written']}.\n\n" if "written" in report else ""
        lines += ["", f"## {name}", "", when + report["markdown"]]
    findings = HERE / "findings.md"
    if findings.is_file():
        lines += ["", findings.read_text().rstrip()]
    (out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(reports, indent=1) + "\n")
    plot(reports, out / "results.png")
    print(f"wrote {out / 'RESULTS.md'}, results.json and results.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

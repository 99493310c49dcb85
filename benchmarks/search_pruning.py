"""What pruning saves in a search, and what it costs in the best trial found: the same
TPE search of the bundled MNIST with ASHA and without a pruner, over 5 seeds.

    python benchmarks/search_pruning.py            # 16 trials a search, 5 seeds each
    python benchmarks/search_pruning.py --quick    # 16 trials, 1 seed each

Each search is the command a user types: ``dmltrain sweep mnist --search tpe --pruner asha
--trials 16``, as a Slurm job array of 2 tasks at once when a Slurm cluster answers here
(``sinfo``), else ``--local --parallel 2``. A trial trains 3 epochs of the bundled
5,000-digit sample and reports val_loss every 21 steps (9 reports). The steps trained are
the trials' global steps at their end; a search without pruning trains every step
planned. The spread is that of the unpruned searches' best val_loss over the seeds; the
pruned searches' best is their mean over the same seeds.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPACE = "lr: {low: 0.0001, high: 0.3, log: true}\noptimizer: [adam, sgd]\n"
MNIST = ["mnist", "--no-download", "--val-every-steps", "21", "--progress", "off", "--threads", "1"]


def slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    done = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True)
    return done.returncode == 0 and "up" in done.stdout


def search(
    cwd: Path, name: str, pruner: str, seed: int, trials: int, epochs: int, slurm: bool
) -> dict:
    """One search, run to its end; its steps, best value and wall time."""
    args = [sys.executable, "-m", "dmltrain", "sweep", *MNIST, "--epochs", str(epochs),
            "--space", "space.yaml",
            "--search", "tpe", "--pruner", pruner, "--trials", str(trials), "--space-seed",
            str(seed), "--name", name]  # fmt: skip
    where = ["--max-parallel", "2", "--cpus-per-task", "1", "--time", "00:30:00"]
    start = time.perf_counter()
    done = subprocess.run(
        [*args, *(where if slurm else ["--local", "--parallel", "2"])],
        cwd=cwd, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
    if slurm:
        job = done.stdout.split("submitted job array ")[1].split()[0]
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                             text=True).stdout.strip():  # fmt: skip
            time.sleep(2)
    seconds = time.perf_counter() - start
    sweep = cwd / "runs" / name
    import optuna
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(
        study_name=name,
        storage=optuna.storages.JournalStorage(JournalFileBackend(str(sweep / "study.journal"))),
    )
    states = [t.state.name for t in study.trials]
    if len(states) != trials or not set(states) <= {"COMPLETE", "PRUNED"}:
        raise RuntimeError(f"{name}: the study's trials ended {states}")
    steps = planned = 0
    for slot in range(trials):
        outcome = json.loads((sweep / f"trial-{slot}" / "outcome.json").read_text())
        steps += outcome["global_step"]
    for trial in study.trials:
        planned += trial.user_attrs["planned_steps"]
    return {
        "steps": steps,
        "planned": planned,
        "best": study.best_value,
        "pruned": states.count("PRUNED"),
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed a pruner")
    parser.add_argument("--smoke", action="store_true", help="4 trials of 1 epoch, one seed, here")
    args = parser.parse_args(argv)
    seeds = [0] if args.quick or args.smoke else [0, 1, 2, 3, 4]
    trials, epochs = (4, 1) if args.smoke else (16, 3)
    slurm = slurm_up() and not args.smoke
    cwd = Path(tempfile.mkdtemp(prefix="dmltrain-search-"))
    (cwd / "space.yaml").write_text(SPACE)
    found: dict[str, dict] = {}
    try:
        for seed in seeds:
            for pruner in ("none", "asha"):
                name = f"{pruner}-{seed}"
                found[name] = search(cwd, name, pruner, seed, trials, epochs, slurm)
                print(name, found[name], flush=True)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    where = "a Slurm job array, 2 tasks at once" if slurm else "--local --parallel 2"
    lines = [
        f"search pruning: `dmltrain sweep mnist --search tpe --trials {trials}` ({where}); "
        f"{epochs} epoch(s) a trial, val_loss every 21 steps",
        "| seed | pruner | steps trained | of planned | trials pruned | best val_loss | wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in found.items():
        pruner, seed = name.rsplit("-", 1)
        lines.append(
            f"| {seed} | {pruner} | {r['steps']} | {r['steps'] / r['planned']:.0%} | "
            f"{r['pruned']} | {r['best']:.4f} | {r['seconds']} |"
        )
    unpruned = [r for name, r in found.items() if name.startswith("none")]
    low, high = min(r["best"] for r in unpruned), max(r["best"] for r in unpruned)
    lines.append("")
    report: dict = {"spread": [low, high], "trials": trials, "where": where, "pruners": {}}
    ratios = {}
    for pruner in ("asha",):
        runs = [r for name, r in found.items() if name.startswith(pruner)]
        share = sum(r["steps"] for r in runs) / sum(r["steps"] for r in unpruned)
        mean = sum(r["best"] for r in runs) / len(runs)
        inside = sum(low <= r["best"] <= high for r in runs)
        ratios[f"search: steps trained, {pruner} / no pruner"] = share
        report["pruners"][pruner] = {
            "share": share,
            "mean_best": mean,
            "inside": inside,
            "seeds": len(runs),
            "within_spread": low <= mean <= high,
        }
        lines.append(
            f"{pruner}: {share:.0%} of the steps of the searches without a pruner. Its best "
            f"val_loss is {mean:.4f} on average over the seeds, within the unpruned searches' "
            f"{low:.4f}-{high:.4f} in {inside} of {len(runs)} seeds."
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return {"markdown": text, "ratios": ratios, **report}


if __name__ == "__main__":
    main()

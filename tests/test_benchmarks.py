"""The benchmarks run end to end in quick mode (a smoke test: the numbers of a quick run
on a shared 2-core machine are not asserted; benchmarks/RESULTS.md holds a full run's)."""

import subprocess
import sys

from conftest import REQUIRE_ALL, ROOT


def test_quick_mode_writes_results_and_plot(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = (tmp_path / "RESULTS.md").read_text()
    for section in ("## Targets", "## overhead", "## startup", "## checkpoint", "## scaling",
                    "## nan_check"):  # fmt: skip
        assert section in results, section
    targets = results.split("## Targets", 1)[1].split("## overhead", 1)[0]
    assert targets.count("| yes |") + targets.count("| NO |") >= 8
    for contender in ("plain", "dmltrain", "lightning", "fabric", "accelerate", "dmlcloud"):
        assert f"| {contender} |" in results, contender
    if REQUIRE_ALL:  # tests/run.sh installs benchmarks/requirements.txt
        assert "not installed" not in results
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

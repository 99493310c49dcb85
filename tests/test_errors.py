"""dmltrain.errors: how a failure or a Ctrl-C becomes one line and an exit status."""

import subprocess
import sys

from helpers import cli_env

INTERRUPTED_IN_EXEC = """
import sys
from dmltrain.errors import run_reporting_errors

def fn():
    exec("raise KeyboardInterrupt", {})  # as dataclasses build their methods, at import

sys.exit(run_reporting_errors(fn, 0, 1))
"""


def test_a_ctrl_c_caught_after_an_exec_exits_130_under_python_m(tmp_path):
    """CPython marks a KeyboardInterrupt leaving ``exec`` of a string as unhandled even when
    it is caught, and under ``python -m`` then ends the process by SIGINT (-2) instead of
    with the status returned: the status a scheduler reads must be dmltrain's."""
    (tmp_path / "interrupted.py").write_text(INTERRUPTED_IN_EXEC)
    out = subprocess.run([sys.executable, "-m", "interrupted"], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 130, (out.returncode, out.stderr)
    assert out.stderr == "dmltrain: interrupted\n"

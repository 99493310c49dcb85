"""Fixtures: a local HTTP server, the Slurm cluster, the cluster tests' reference run.
The helpers the tests import are in helpers.py."""

import functools
import http.server
import subprocess
import threading

import pytest
from helpers import (
    REQUIRE_ALL,
    TESTS,
    TINY_RUN,
    require,
    run_cli,
)


@pytest.fixture
def http_dir(tmp_path):
    """Serve a directory on 127.0.0.1; yields (directory, base_url)."""
    root = tmp_path / "served"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _slurm_up() -> bool:
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state in out for state in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="session")
def slurm():
    """A running single-node Slurm cluster (started here if it is installed but down)."""
    require("sbatch")
    if not _slurm_up():
        subprocess.run(["bash", str(TESTS / "cluster" / "start_local_slurm.sh")], timeout=120)
    if not _slurm_up():
        message = "the local Slurm cluster did not come up; see /var/log/slurm"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """TINY_RUN uninterrupted with 2 processes: what each cluster run must end equal to."""
    run = tmp_path_factory.mktemp("tiny-reference") / "run"
    done = run_cli(*TINY_RUN, "--nprocs", "2", "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr
    return run

#!/usr/bin/env bash
# Install what the test suite needs, then run it:
#
#   bash tests/run.sh [pytest args]            # the whole suite (CI runs this)
#   bash tests/run.sh --quick [pytest args]    # the quick tier: minutes, no cluster
#
# The whole suite installs (as root, on Debian/Ubuntu): OpenMPI, Slurm + munge, dmltrain
# with its dev extra, Horovod 0.28.1 built against the installed torch (cached), torchvision
# in build/torchvision (the ported scripts' tests/test_ports.py), and starts a single-node
# Slurm cluster and a two-node one made of network namespaces. Its modules
# run side by side (pytest-xdist): much of it waits on Slurm, timeouts and signals while
# the cores idle. The quick tier installs dmltrain with its dev extra only and runs the
# tests marked `quick` (the mechanics of every module, with no Slurm, MPI or second node).
# Both end with the slowest tests and exit non-zero when a test fails and when no test ran
# (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

quick=0
if [ "${1:-}" = "--quick" ]; then
    quick=1
    shift
fi

python3 -m pip install --quiet --disable-pip-version-check -e ".[dev]" || exit 1
# The suite starts hundreds of processes that import dmltrain and the tests' experiments;
# where PYTHONDONTWRITEBYTECODE is set none of them writes its bytecode, and each would
# compile every module again.
python3 -m compileall -q dmltrain experiments tests >/dev/null || exit 1
# The workers run side by side, each starting processes sized for the whole machine: torch's
# OpenMP threads that wait by spinning would burn the cores the others need. Waiting asleep
# changes how an idle thread waits, not a result (CONTRIBUTING.md).
export OMP_WAIT_POLICY=PASSIVE
if [ "$quick" = 1 ]; then
    python3 -m pytest -p no:benchmark -m quick -n 2 --dist loadfile --durations=60 "$@"
    status=$?
else
    need_apt=0
    for tool in mpirun mpicc sbatch slurmctld slurmd munged shellcheck ip nsenter; do
        command -v "$tool" >/dev/null || need_apt=1
    done
    if [ "$need_apt" = 1 ]; then
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev \
            slurm-wlm munge cmake shellcheck iproute2 util-linux >/dev/null; }; then
            echo "tests/run.sh: apt-get install failed" >&2
            exit 1
        fi
    fi
    # The peers the benchmarks compare with (their quick mode is part of the suite).
    python3 -m pip install --quiet --disable-pip-version-check -r benchmarks/requirements.txt \
        || exit 1
    # torchvision for the published scripts the ports are compared with (tests/test_ports.py),
    # in a folder of its own: PyPI's wheels are built for CUDA torch, and installed beside
    # the CPU build their import fails, which breaks torchmetrics (it imports torchvision
    # where one is installed). tests/ports/vision.py imports it for the ports alone.
    if [ ! -d build/torchvision/torchvision ]; then
        python3 -m pip install --quiet --disable-pip-version-check --no-deps \
            --target build/torchvision torchvision==0.28.0 || exit 1
    fi
    bash environment/install_horovod.sh || exit 1
    bash tests/cluster/start_local_slurm.sh || exit 1
    bash tests/cluster/two_node_slurm.sh up || exit 1

    # OpenMPI refuses root without these; the tests run as root on CI machines.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export DMLTRAIN_TEST_REQUIRE_ALL=1  # a missing component fails the suite, not skips
    # A module's tests share a worker (its module-scoped runs are made once); the longest
    # modules start first (tests/conftest.py). Workers: CONTRIBUTING.md.
    python3 -m pytest -p no:benchmark -n "${DMLTRAIN_TEST_WORKERS:-4}" --dist loadfile \
        --no-loadscope-reorder --durations=60 "$@"
    status=$?
fi
if [ "$status" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"

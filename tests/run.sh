#!/usr/bin/env bash
# Install what the test suite needs, then run all of it: bash tests/run.sh [pytest args]
#
# Installs (as root, on Debian/Ubuntu): OpenMPI, Slurm + munge, dmltrain with its dev
# extra, Horovod 0.28.1 built against the installed torch (cached), and starts a
# single-node Slurm cluster and a two-node one made of network namespaces. Exits non-zero
# when a test fails and when no test ran (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

need_apt=0
for tool in mpirun mpicc sbatch slurmctld slurmd munged shellcheck ip nsenter; do
    command -v "$tool" >/dev/null || need_apt=1
done
if [ "$need_apt" = 1 ]; then
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev slurm-wlm \
        munge cmake shellcheck iproute2 util-linux >/dev/null; }; then
        echo "tests/run.sh: apt-get install failed" >&2
        exit 1
    fi
fi

python3 -m pip install --quiet --disable-pip-version-check -e ".[dev]" || exit 1
# The peers the benchmarks compare with (their quick mode is part of the suite).
python3 -m pip install --quiet --disable-pip-version-check -r benchmarks/requirements.txt || exit 1
bash environment/install_horovod.sh || exit 1
bash tests/cluster/start_local_slurm.sh || exit 1
bash tests/cluster/two_node_slurm.sh up || exit 1

# OpenMPI refuses root without these; the tests run as root on CI machines.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export DMLTRAIN_TEST_REQUIRE_ALL=1  # a missing component fails the suite instead of skipping

python3 -m pytest --durations=15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"

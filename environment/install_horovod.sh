#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 for the torch in this Python environment.
#
#   bash environment/install_horovod.sh            # CPU: Gloo + MPI controllers
#   HOROVOD_GPU_OPERATIONS=NCCL bash environment/install_horovod.sh   # GPU clusters
#
# Horovod 0.28.1 compiles with C++14 but torch >= 2.x headers need C++17: a compiler
# wrapper adds -std=c++17. CMake >= 4 refuses Gloo's old cmake_minimum_required unless
# CMAKE_POLICY_VERSION_MINIMUM is set. The wheel is cached per torch version in
# ${DMLTRAIN_WHEEL_CACHE:-~/.cache/dmltrain/wheels}, so later installs take seconds.
set -euo pipefail
python=${PYTHON:-python3}
if "$python" -c "import horovod.torch" 2>/dev/null; then
    echo "install_horovod.sh: horovod.torch already imports; nothing to do"
    exit 0
fi
command -v mpicc >/dev/null || { echo "install_horovod.sh: no MPI compiler (mpicc): install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) or load your site's MPI module" >&2; exit 1; }
command -v g++ >/dev/null || { echo "install_horovod.sh: no C++ compiler (g++): install build-essential" >&2; exit 1; }
torch_version=$("$python" -c "import torch; print(torch.__version__.split('+')[0])")
cache=${DMLTRAIN_WHEEL_CACHE:-$HOME/.cache/dmltrain/wheels}/torch-$torch_version${HOROVOD_GPU_OPERATIONS:+-$HOROVOD_GPU_OPERATIONS}
mkdir -p "$cache"
if ! ls "$cache"/horovod-0.28.1-*.whl >/dev/null 2>&1; then
    echo "install_horovod.sh: building Horovod 0.28.1 against torch $torch_version (several minutes)"
    wrap_dir=$(mktemp -d)
    printf '#!/bin/sh\nexec g++ "$@" -std=c++17\n' > "$wrap_dir/gxx17"
    chmod +x "$wrap_dir/gxx17"
    "$python" -m pip install --quiet cmake wheel setuptools packaging
    CXX="$wrap_dir/gxx17" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-gloo} \
    MAKEFLAGS=${MAKEFLAGS:--j$(nproc)} \
        "$python" -m pip wheel --quiet --no-deps --no-build-isolation horovod==0.28.1 -w "$cache"
    rm -rf "$wrap_dir"
fi
"$python" -m pip install --quiet --no-deps "$cache"/horovod-0.28.1-*.whl
"$python" -m pip install --quiet cloudpickle psutil pyyaml packaging  # horovodrun's needs
"$python" -c "import sys; from horovod.runner.launch import run_commandline; sys.argv = ['horovodrun', '--check-build']; run_commandline()"

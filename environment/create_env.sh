#!/usr/bin/env bash
# Create (or repair) a Python environment that trains with dmltrain on this machine:
# PyTorch, MPI, Horovod built against that PyTorch, and dmltrain from this checkout.
usage() {
    cat <<'HELP'
usage: bash environment/create_env.sh [--venv] [--no-horovod] [--python PY] NAME

With conda, mamba or micromamba on PATH: creates the conda env NAME from
environment/environment.yml (Python, PyTorch - the CUDA build where an NVIDIA driver is
present -, OpenMPI, mpi4py, CMake, compilers); on a GPU machine also the CUDA compiler and
NCCL. Without conda, or with --venv: a Python venv in the directory NAME, with PyTorch
from pip (the system's MPI and compiler are used: apt-get install openmpi-bin
libopenmpi-dev g++ cmake).

Then, in the new environment: builds Horovod 0.28.1 (NCCL GPU operations on a GPU machine,
PyTorch, MPI and Gloo; environment/install_horovod.sh), installs dmltrain from this
checkout (editable), and checks the result with 'horovodrun --check-build' and
'dmltrain doctor'.

Running it again on the same NAME repairs the environment (installs what is missing, keeps
what is there). Everything the build prints goes to create_env-<name>.log.

options:
  --venv          a Python venv even where conda exists
  --no-horovod    skip Horovod (no MPI or compiler needed)
  --python PY     the Python a venv is made from (default: python3)
  -h, --help      this text

environment:
  DMLTRAIN_TORCH         the PyTorch requirement for a venv (default: torch==2.13.0)
  DMLTRAIN_WHEEL_CACHE   where built Horovod wheels are kept (default ~/.cache/dmltrain/wheels)
  CONDA_OVERRIDE_CUDA    conda: the CUDA version to build for on a machine without a GPU

Afterwards: source NAME/bin/activate (venv) or conda activate NAME, then dmltrain mnist.
In batch jobs: DMLTRAIN_ENV=NAME sbatch slurm/run.sh mnist (a venv: its full path).
HELP
}

set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=0
horovod=1
python=python3
name=""
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --venv) venv=1 ;;
        --no-horovod) horovod=0 ;;
        --python) python=${2:?--python needs a value}; shift ;;
        -*) echo "create_env.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) [ -z "$name" ] || { echo "create_env.sh: one NAME only (got '$name' and '$1')" >&2; exit 2; }
           name=$1 ;;
    esac
    shift
done
[ -n "$name" ] || { usage >&2; exit 2; }

die() { echo "create_env.sh: $*" >&2; exit 1; }
started=$SECONDS
log="$PWD/create_env-$(basename "$name").log"
: > "$log" || die "cannot write the log file $log"
# Run a step with its output in the log; on failure show the log's end and stop.
step() {
    local what=$1
    shift
    echo "create_env.sh: $what"
    echo "=== $what: $*" >> "$log"
    if ! "$@" >> "$log" 2>&1; then
        tail -n 25 "$log" | sed 's/^/    /' >&2
        die "$what failed; the whole output is in $log"
    fi
}

gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
conda=""
if [ "$venv" = 0 ]; then
    for tool in micromamba mamba conda; do
        if command -v "$tool" >/dev/null; then conda=$tool; break; fi
    done
    [ -n "$conda" ] || echo "create_env.sh: no conda, mamba or micromamba found: making a venv instead (--venv)"
fi
if [ "$horovod" = 1 ] && [ -z "$conda" ]; then  # a venv builds with the system's tools
    command -v mpicc >/dev/null || die "no MPI compiler (mpicc): apt-get install openmpi-bin libopenmpi-dev (or load your site's MPI module), or add --no-horovod"
    command -v g++ >/dev/null || die "no C++ compiler (g++): apt-get install g++ (or load a compiler module), or add --no-horovod"
fi

marker=".dmltrain-env"  # in every environment this script made: safe to repair
if [ -n "$conda" ]; then
    prefix=$("$conda" env list 2>/dev/null | awk -v n="$name" '$1 == n {print $NF}')
    if [ -n "$prefix" ] && [ ! -f "$prefix/$marker" ]; then
        die "a conda env named $name exists and was not made by this script: choose another NAME, or remove it ($conda env remove -n $name)"
    fi
    if [ -n "$prefix" ]; then
        step "updating conda env $name" "$conda" env update -n "$name" -f "$repo/environment/environment.yml"
    else
        step "creating conda env $name (several minutes)" "$conda" env create -y -n "$name" -f "$repo/environment/environment.yml"
        prefix=$("$conda" env list | awk -v n="$name" '$1 == n {print $NF}')
    fi
    [ -d "$prefix" ] || die "$conda made no env named $name; see $log"
    if [ "$gpu" = 1 ]; then
        step "adding the CUDA compiler and NCCL" "$conda" install -y -n "$name" -c conda-forge cuda-nvcc cuda-cudart-dev nccl
    fi
    env_python="$prefix/bin/python"
    export HOROVOD_NCCL_HOME=$prefix HOROVOD_CUDA_HOME=$prefix
else
    prefix=$name
    if [ -e "$prefix" ] && [ ! -f "$prefix/$marker" ]; then
        die "$prefix exists and is not a venv made by this script: choose another NAME, or remove it"
    fi
    command -v "$python" >/dev/null || die "no $python: install Python 3.10 or newer, or pass --python"
    if [ ! -x "$prefix/bin/python" ]; then
        step "creating venv $prefix" "$python" -m venv "$prefix"
    fi
    env_python="$prefix/bin/python"
    step "installing PyTorch (${DMLTRAIN_TORCH:-torch==2.13.0})" "$env_python" -m pip install --disable-pip-version-check "${DMLTRAIN_TORCH:-torch==2.13.0}"
fi
touch "$prefix/$marker"
prefix=$(cd "$prefix" && pwd)
export PATH="$prefix/bin:$PATH"  # horovodrun, dmltrain and mpicc of the env first

step "installing dmltrain from $repo" "$env_python" -m pip install --disable-pip-version-check -e "$repo"
if [ "$horovod" = 1 ]; then
    [ "$gpu" = 1 ] && export HOROVOD_GPU_OPERATIONS=NCCL
    step "building and installing Horovod (minutes on the first build; cached after)" \
        env PYTHON="$env_python" bash "$repo/environment/install_horovod.sh"
    step "checking Horovod: horovodrun --check-build" "$prefix/bin/horovodrun" --check-build
    grep -A11 "Available Frameworks" "$log" | sed 's/^/    /'
fi
echo "create_env.sh: checking the environment: dmltrain doctor"
doctor=(doctor)
[ "$horovod" = 1 ] && doctor+=(--horovod)
[ "$gpu" = 1 ] && doctor+=(--gpu)
if ! "$prefix/bin/dmltrain" "${doctor[@]}" 2>&1 | tee -a "$log"; then
    die "dmltrain doctor found a problem (above); the build output is in $log"
fi

activate="source $prefix/bin/activate"
[ -n "$conda" ] && activate="$conda activate $name"
echo "create_env.sh: done in $((SECONDS - started)) s; log: $log"
echo "create_env.sh: use it with: $activate"

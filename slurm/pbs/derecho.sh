#!/bin/bash
# Multi-node training on a PBS Pro machine like NCAR's Derecho (Cray EX, 4 A100 per node,
# Cray MPICH with PALS): mpiexec starts one training process per GPU; ranks come from
# PMI_RANK/PALS_LOCAL_RANKID, the rendezvous is the first node of $PBS_NODEFILE. Usage:
#
#   qsub -v DMLTRAIN_ARGS="mnist --epochs 10" slurm/pbs/derecho.sh
#   qsub -l select=4:ncpus=64:ngpus=4:mpiprocs=4 -v DMLTRAIN_ARGS="mnist" slurm/pbs/derecho.sh
#   bash slurm/pbs/derecho.sh mnist --epochs 10     # inside an interactive job (qsub -I)
#
# qsub passes no arguments to a script: the experiment and its flags come in DMLTRAIN_ARGS
# (split on spaces) unless given as arguments. DMLTRAIN_ENV: conda env name or venv path to
# activate. `dmltrain submit pbs` writes a copy of this script with the flags filled in.
#
# Every #PBS line below is a default; the same option on the qsub command line wins.
#PBS -N dmltrain
# Your project code (qsub fails without one on NCAR machines): qsub -A PROJECT, or edit.
# #PBS -A PROJECT
#PBS -q main
# Nodes, and per node: CPU cores, GPUs, MPI ranks (one rank per GPU). Here two whole
# Derecho GPU nodes: 64 cores and 4 A100s each, so 16 cores for each rank and its loader workers.
#PBS -l select=2:ncpus=64:ngpus=4:mpiprocs=4
#PBS -l walltime=01:00:00
# stdout and stderr into one log.
#PBS -j oe
# Not rerunnable by PBS itself: after a checkpoint this script resubmits the job.
#PBS -r n

set -uo pipefail
# >>> dmltrain block: settings.sh (edit slurm/blocks/settings.sh, then run sync.py)
# The DMLTRAIN_* settings that hold numbers, checked once here: a bad value is one line and
# exit status 2, not a test that fails later in every requeued job.
for setting in DMLTRAIN_LOST_GRACE DMLTRAIN_SRUN_WAIT DMLTRAIN_MAX_LOST_REQUEUES \
    DMLTRAIN_NPROC_PER_NODE DMLTRAIN_RDZV_PORT; do
    if ! [[ "${!setting:-0}" =~ ^[0-9]+$ ]]; then
        echo "dmltrain: $setting=${!setting} is not a whole number; set a number or unset it (exit status 2)" >&2
        exit 2
    fi
done
for setting in DMLTRAIN_REQUEUE DMLTRAIN_RESUBMIT; do
    if ! [[ "${!setting:-1}" =~ ^[01]$ ]]; then
        echo "dmltrain: $setting=${!setting} must be 0 or 1; set one or unset it (exit status 2)" >&2
        exit 2
    fi
done
# <<< dmltrain block: settings.sh
# The file to submit again (qsub runs a copy of it).
script=${DMLTRAIN_SCRIPT:-${PBS_O_WORKDIR:-$PWD}/slurm/pbs/derecho.sh}
# >>> dmltrain block: pbs-args.sh (edit slurm/blocks/pbs-args.sh, then run sync.py)
cd "${PBS_O_WORKDIR:-.}" || exit 1
# qsub passes no arguments to a script: the experiment and its flags come in DMLTRAIN_ARGS
# (split on spaces) unless given as arguments.
if [ $# -eq 0 ]; then
    read -r -a args <<< "${DMLTRAIN_ARGS:-}"
    set -- "${args[@]}"
fi
[ $# -gt 0 ] || { echo "dmltrain: no experiment: qsub -v DMLTRAIN_ARGS=\"mnist --epochs 10\" $script" >&2; exit 2; }
# <<< dmltrain block: pbs-args.sh

# >>> dmltrain block: activate.sh (edit slurm/blocks/activate.sh, then run sync.py)
# The environment to train in: DMLTRAIN_ENV is a venv directory or a conda env name.
if [ -n "${DMLTRAIN_ENV:-}" ]; then
    if [ -f "$DMLTRAIN_ENV/bin/activate" ]; then
        # shellcheck disable=SC1091
        source "$DMLTRAIN_ENV/bin/activate"
    elif [[ "$DMLTRAIN_ENV" =~ ^[A-Za-z0-9_.+-]+$ ]] || [ -d "$DMLTRAIN_ENV/conda-meta" ]; then
        eval "$(conda shell.bash hook)" && conda activate "$DMLTRAIN_ENV" || exit 1
    else
        echo "dmltrain: DMLTRAIN_ENV=$DMLTRAIN_ENV is neither a venv's directory, a conda env's directory nor a conda env's name; set one (exit status 2)" >&2
        exit 2
    fi
fi
# <<< dmltrain block: activate.sh

job=${PBS_JOBID:?run this script inside a PBS job (qsub)}
nodefile=${PBS_NODEFILE:?PBS_NODEFILE is not set}
ranks=$(wc -l < "$nodefile")                 # one line per MPI rank (mpiprocs per node)
nodes=$(sort -u "$nodefile" | wc -l)
ppn=$(( ranks / nodes ))
export MASTER_ADDR=${MASTER_ADDR:-$(head -n 1 "$nodefile")}
export MASTER_PORT=${MASTER_PORT:-29500}

# NCCL over Derecho's Slingshot network (HPE's libfabric CXI provider through the AWS
# OFI NCCL plugin), as NCAR recommends; each value is kept when already set.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn}
export NCCL_NET=${NCCL_NET:-AWS Libfabric}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PBH}
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
export MPICH_GPU_SUPPORT_ENABLED=${MPICH_GPU_SUPPORT_ENABLED:-1}
echo "dmltrain: PBS job $job, $nodes node(s) x $ppn rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
env | grep -E '^(NCCL_|FI_|MPICH_GPU)' | sort | sed 's/^/dmltrain: /'

# Cray MPICH (PALS) takes --ppn; OpenMPI names it --npernode.
case "$(mpiexec --version 2>&1)" in
    *"Open MPI"* | *OpenRTE* | *open-mpi.org*) per_node=(--npernode "$ppn") ;;
    *) per_node=(--ppn "$ppn" --cpu-bind none) ;;
esac
# A fixed run directory, so a resubmitted job resumes this one's checkpoint (a --run-dir
# among the flags, coming later, wins).
experiment=$1
shift
run_dir=${DMLTRAIN_RUN_DIR:-runs/$experiment-${job%%.*}}
mpiexec -n "$ranks" "${per_node[@]}" dmltrain "$experiment" --run-dir "$run_dir" "$@"
status=$?

# >>> dmltrain block: pbs-resubmit.sh (edit slurm/blocks/pbs-resubmit.sh, then run sync.py)
# Exit status 3: a checkpoint was saved and there is more to do; 5: a rank or node was
# lost, the checkpoints are intact. Both submit the job again, which resumes the newest
# checkpoint. In a chain of jobs (`dmltrain submit pbs --chain N` sets DMLTRAIN_RESUBMIT=0)
# the next job of the chain goes on instead.
why="checkpoint saved"
if [ "$status" -eq 5 ]; then
    why="a rank or node was lost, the checkpoints are intact"
    status=3
fi
if [ "$status" -eq 3 ]; then
    if [ "${DMLTRAIN_RESUBMIT:-1}" = 1 ] && command -v qsub >/dev/null; then
        echo "dmltrain: $why; resubmitting $script"
        qsub -v "DMLTRAIN_RUN_DIR=$run_dir,DMLTRAIN_ENV=${DMLTRAIN_ENV:-},DMLTRAIN_ARGS=$experiment $*" "$script"
    else
        echo "dmltrain: $why; the next job of the chain goes on, if any; else go on with: qsub -v DMLTRAIN_RUN_DIR=$run_dir,DMLTRAIN_ARGS=\"$experiment $*\" $script"
    fi
    exit 0
fi
exit "$status"
# <<< dmltrain block: pbs-resubmit.sh

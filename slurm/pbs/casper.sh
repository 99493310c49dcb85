#!/bin/bash
# Single-node training on a PBS Pro machine like NCAR's Casper (nodes with 1 to 8 GPUs):
# one torchrun on the node starts one training process per GPU. Usage:
#
#   qsub -v DMLTRAIN_ARGS="mnist --epochs 10" slurm/pbs/casper.sh
#   qsub -l select=1:ncpus=16:ngpus=4:mem=128GB -v DMLTRAIN_ARGS="mnist" slurm/pbs/casper.sh
#   bash slurm/pbs/casper.sh mnist --epochs 10      # inside an interactive job (qsub -I)
#
# qsub passes no arguments to a script: the experiment and its flags come in DMLTRAIN_ARGS
# (split on spaces) unless given as arguments. DMLTRAIN_ENV: conda env name or venv path to
# activate. DMLTRAIN_NPROC_PER_NODE: training processes (default: the job's GPUs, $NGPUS).
# `dmltrain submit pbs --script casper` writes a copy with the flags filled in.
#
# Every #PBS line below is a default; the same option on the qsub command line wins.
#PBS -N dmltrain
# Your project code (qsub fails without one on NCAR machines): qsub -A PROJECT, or edit.
# #PBS -A PROJECT
#PBS -q casper
# One node: CPU cores, GPUs and memory for the whole job.
#PBS -l select=1:ncpus=8:ngpus=2:mem=64GB
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
script=${DMLTRAIN_SCRIPT:-${PBS_O_WORKDIR:-$PWD}/slurm/pbs/casper.sh}
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
nproc=${DMLTRAIN_NPROC_PER_NODE:-${NGPUS:-1}}
echo "dmltrain: PBS job $job on $(hostname), $nproc process(es) (torchrun --standalone)"

experiment=$1
shift
run_dir=${DMLTRAIN_RUN_DIR:-runs/$experiment-${job%%.*}}
# Rank 0 writes its exit status here (torchrun reports any failure as 1).
status_file="$run_dir.status"
mkdir -p "$(dirname "$run_dir")"
rm -f "$status_file"
torchrun --standalone --nproc-per-node="$nproc" -m dmltrain "$experiment" \
    --run-dir "$run_dir" "$@" --status-file "$status_file"
status=$?
# >>> dmltrain block: status-file.sh (edit slurm/blocks/status-file.sh, then run sync.py)
# The launcher's status is not the job's: torchrun reports any worker's failure as 1, and
# srun the highest status of any task (a rank that lost a failed rank 0 says 5). Rank 0
# wrote the real one, and how many checkpoints this job saved. The file is in a shared
# folder: anything but digits there is not rank 0's, and is not used.
# shellcheck disable=SC2034  # saved: read by slurm-requeue.sh, where it follows
saved=""
# shellcheck disable=SC2034
if [ -s "$status_file" ]; then
    written=$(sed -n 1p "$status_file")
    saved=$(sed -n 2p "$status_file")
    rm -f "$status_file"
    if [[ "$written" =~ ^[0-9]{1,3}$ ]] && [[ "$saved" =~ ^[0-9]*$ ]]; then
        status=$written
    else
        echo "dmltrain: $status_file held no status (not digits); keeping the launcher's, $status" >&2
        saved=""
    fi
fi
# <<< dmltrain block: status-file.sh

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

#!/bin/bash
# A chain of Slurm jobs for runs longer than a job may last: JOBS jobs of slurm/run.sh, each
# starting when the one before it ended well (--dependency=afterok), all in one run
# directory, so each resumes the checkpoint the one before it left. With --epochs-per-job
# each job trains that many epochs and ends with a checkpoint; a preempted job ends the
# same way. Run it on the login node (not with sbatch):
#
#   bash slurm/chain.sh 4 mnist --epochs 20 --epochs-per-job 5
#   DMLTRAIN_SBATCH="--partition=gpu --gpus-per-node=4 --ntasks-per-node=4" \
#       bash slurm/chain.sh 4 mnist --epochs 20 --epochs-per-job 5
#
# DMLTRAIN_SBATCH: sbatch options for every job (split on spaces). DMLTRAIN_ENV: the
# environment to activate (see slurm/run.sh). When a job fails, the jobs after it are
# cancelled (--kill-on-invalid-dep). Jobs started after the run has finished its --epochs
# resume, see nothing left to do and end at once. The alternative to a chain is
# slurm/run.sh alone: it requeues itself after each --epochs-per-job part.
set -euo pipefail
usage="usage: bash slurm/chain.sh JOBS EXPERIMENT [dmltrain flags]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
jobs=$1
shift
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "chain.sh: JOBS must be a positive number (got '$jobs'); $usage" >&2; exit 2; }
command -v sbatch >/dev/null || { echo "chain.sh: sbatch not found: run this on a Slurm login node" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
experiment=$1
shift
# One run directory for the whole chain (a --run-dir among the flags, coming later, wins).
run_dir="runs/$experiment-chain-$(date +%Y%m%d-%H%M%S)"
read -r -a options <<< "${DMLTRAIN_SBATCH:-}"

dependency=()
for i in $(seq 1 "$jobs"); do
    id=$(DMLTRAIN_REQUEUE=0 sbatch --parsable --kill-on-invalid-dep=yes "${options[@]}" \
        "${dependency[@]}" "$here/run.sh" "$experiment" --run-dir "$run_dir" "$@")
    id=${id%%;*}
    echo "chain.sh: job $i/$jobs: $id"
    dependency=(--dependency="afterok:$id")
done
echo "chain.sh: run directory $run_dir"

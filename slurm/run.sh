#!/bin/bash
# dmltrain's generic Slurm batch script. Usage (any dmltrain flags pass through):
#
#   sbatch slurm/run.sh mnist --epochs 10
#   sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 slurm/run.sh mnist --epochs 10
#   DMLTRAIN_ENV=myenv sbatch slurm/run.sh mnist    # conda env name, or the path of a venv
#
# Every #SBATCH line below is a default; the same option on the sbatch command line wins.
#SBATCH --job-name=dmltrain
# One node by default; multi-node jobs just ask for more.
#SBATCH --nodes=1
# One task (= one training process) per GPU; on CPU nodes, one per process you want.
#SBATCH --ntasks-per-node=1
# CPU cores per task: Slurm's default (1) unless sbatch --cpus-per-task N asks for more (the
# training process plus its --num-workers loader workers). A default above what a node has
# would leave the plain "sbatch slurm/run.sh" pending for ever (PartitionConfig).
#SBATCH --time=01:00:00
# Let Slurm (and dmltrain, after a preemption checkpoint) put the job back in the queue.
#SBATCH --requeue
# Keep appending to one log file across requeues instead of truncating it.
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
# USR1 to the job steps (the training processes; no "B:") 5 minutes before the time
# limit: dmltrain checkpoints at a step boundary soon after and requeues the job.
#SBATCH --signal=USR1@300

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

# >>> dmltrain block: slurm-job.sh (edit slurm/blocks/slurm-job.sh, then run sync.py)
job=${SLURM_JOB_ID:?run this script with sbatch}
if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
    job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"  # requeue this task, not the array
fi
# <<< dmltrain block: slurm-job.sh
echo "dmltrain: job $job, restart ${SLURM_RESTART_COUNT:-0}, nodes ${SLURM_JOB_NODELIST:-?}"

# The default run directory (runs/<experiment>-<job id>) is the same after a requeue,
# so the job resumes its own latest checkpoint with no extra flag. --no-requeue: this
# script requeues (below) once srun has returned, so that a requeue never cancels the
# job while its steps are still exiting. No --kill-on-bad-exit: ranks leaving with status
# 3 must not be killed while they finish; a rank that fails stops the others anyway
# (--dist-timeout). --wait: once a rank has exited, srun waits this long for the others,
# then ends the step: a node whose link is down never reports its ranks' exit, and the job
# would stay RUNNING. DMLTRAIN_SRUN_WAIT (seconds) must stay above --dist-timeout + 20.
# >>> dmltrain block: run-step.sh (edit slurm/blocks/run-step.sh, then run sync.py)
# A lost peer ends the step at once. The survivors of a lost rank or node write status 5
# to the status file once they have named it (a rank that only waits for a busy rank 0
# writes nothing: rank 0 reports itself). The ranks that cannot answer (a node whose link
# is down) would hold srun for its --wait: the step is ended DMLTRAIN_LOST_GRACE seconds
# (10) after the 5, then the job is requeued. A status of 3 (a checkpoint being saved)
# never ends it early.
# A signal to the batch shell alone (scancel --signal=USR1 --batch, #SBATCH
# --signal=B:USR1@300, or SIGTERM) goes on to every process of the job's steps as USR1: they
# checkpoint at the next step boundary and stop with status 3, and the job requeues below.
# shellcheck disable=SC2317  # called by the traps in run_step
forward_signal() {
    echo "dmltrain: the batch script received SIG$1; passing SIGUSR1 to the training processes"
    scancel --signal=USR1 "${SLURM_JOB_ID}" 2>/dev/null || kill -USR1 "$step" 2>/dev/null
}
run_step() {
    "$@" &
    step=$!
    local waited=0 status
    trap 'forward_signal USR1' USR1
    trap 'forward_signal TERM' TERM
    while kill -0 "$step" 2>/dev/null; do
        if [ "$(sed -n 1p "$status_file" 2>/dev/null)" = 5 ]; then
            while kill -0 "$step" 2>/dev/null && [ "$waited" -lt "${DMLTRAIN_LOST_GRACE:-10}" ]; do
                sleep 1
                waited=$((waited + 1))
            done
            if kill -0 "$step" 2>/dev/null; then
                echo "dmltrain: a rank or node was lost and the others have stopped; ending the step"
                kill -INT "$step" 2>/dev/null  # twice within a second: srun ends the step
                sleep 0.5
                kill -INT "$step" 2>/dev/null
                sleep 5
                kill -KILL "$step" 2>/dev/null  # a node that cannot answer may still hold it
            fi
            break
        fi
        sleep 2
    done
    wait "$step"
    status=$?
    while kill -0 "$step" 2>/dev/null; do  # a trapped signal ends a wait early
        wait "$step"
        status=$?
    done
    trap - USR1 TERM
    return "$status"
}
# <<< dmltrain block: run-step.sh
status_file="${SLURM_SUBMIT_DIR:-$PWD}/.dmltrain-status-$job"
rm -f "$status_file"
run_step srun --wait="${DMLTRAIN_SRUN_WAIT:-330}" dmltrain "$@" --no-requeue --status-file "$status_file"
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

# >>> dmltrain block: slurm-requeue.sh (edit slurm/blocks/slurm-requeue.sh, then run sync.py)
# Exit status 3: a checkpoint was saved and there is more to do (a preemption, the time
# limit coming, or --epochs-per-job); 5: a rank or node was lost, the checkpoints are
# intact. Both requeue the job, which resumes the newest checkpoint. In a chain of jobs
# (slurm/chain.sh sets DMLTRAIN_REQUEUE=0) the next job of the chain goes on instead.
# Losses with no checkpoint saved in between (a node that fails again and again) requeue
# DMLTRAIN_MAX_LOST_REQUEUES times (3) in a row, then the job ends with status 5.
why="checkpoint saved"
lost_file="${SLURM_SUBMIT_DIR:-$PWD}/.dmltrain-lost-$job"
if [ "$status" -eq 5 ]; then
    why="a rank or node was lost, the checkpoints are intact"
    lost=1
    if [ "${saved:-0}" = 0 ] && [ -s "$lost_file" ]; then
        before=$(head -c 16 "$lost_file")
        if [[ "$before" =~ ^[0-9]{1,6}$ ]]; then  # anything else is not this script's count
            lost=$((10#$before + 1))
        else
            echo "dmltrain: $lost_file holds no count (not digits); counting from 1" >&2
        fi
    fi
    if [ "$lost" -gt "${DMLTRAIN_MAX_LOST_REQUEUES:-3}" ]; then
        rm -f "$lost_file"
        echo "dmltrain: a rank or node was lost $lost times in a row with no checkpoint saved in between; not requeueing: check the nodes and this job's output, then resubmit (exit status 5)"
        exit 5
    fi
    echo "$lost" > "$lost_file"
    status=3
else
    rm -f "$lost_file"
fi
if [ "$status" -eq 3 ] && [ "${DMLTRAIN_REQUEUE:-1}" = 0 ]; then
    echo "dmltrain: $why; the next job of the chain goes on"
    exit 0
fi
if [ "$status" -eq 3 ]; then
    # Slurm ends the running script to requeue it, and its step daemon logs that as
    # "error: *** JOB N ... CANCELLED ... DUE TO JOB REQUEUE ***": say that it is this.
    echo "dmltrain: $why, requeueing job $job (Slurm may log this as CANCELLED DUE TO JOB REQUEUE)"
    if ! scontrol requeue "$job"; then
        # Under sbatch, $0 is slurmd's copy of the script: name the file that was submitted
        # (Slurm's Command= is that file, then its arguments).
        submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
        echo "dmltrain: requeue failed; resubmit with: sbatch ${DMLTRAIN_SCRIPT:-${submitted:-$0}} $*"
    fi
    exit 0
fi
exit "$status"
# <<< dmltrain block: slurm-requeue.sh

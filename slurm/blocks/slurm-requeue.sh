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

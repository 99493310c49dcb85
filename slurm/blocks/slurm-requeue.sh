# Exit status 3: a checkpoint was saved and there is more to do (a preemption, the time
# limit coming, or --epochs-per-job); 5: a rank or node was lost, the checkpoints are
# intact. Both requeue the job, which resumes the newest checkpoint. In a chain of jobs
# (slurm/chain.sh sets DMLTRAIN_REQUEUE=0) the next job of the chain goes on instead.
why="checkpoint saved"
if [ "$status" -eq 5 ]; then
    why="a rank or node was lost, the checkpoints are intact"
    status=3
fi
if [ "$status" -eq 3 ] && [ "${DMLTRAIN_REQUEUE:-1}" = 0 ]; then
    echo "dmltrain: $why; the next job of the chain goes on"
    exit 0
fi
if [ "$status" -eq 3 ]; then
    echo "dmltrain: $why, requeueing job $job"
    if ! scontrol requeue "$job"; then
        # Under sbatch, $0 is slurmd's copy of the script: name the file that was submitted
        # (Slurm's Command= is that file, then its arguments).
        submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
        echo "dmltrain: requeue failed; resubmit with: sbatch ${DMLTRAIN_SCRIPT:-${submitted:-$0}} $*"
    fi
    exit 0
fi
exit "$status"

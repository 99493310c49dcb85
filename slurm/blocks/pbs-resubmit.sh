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

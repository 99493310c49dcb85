# Exit status 3: a checkpoint was saved and there is more to do: submit the job again
# (DMLTRAIN_RESUBMIT=0: only print how).
if [ "$status" -eq 3 ]; then
    if [ "${DMLTRAIN_RESUBMIT:-1}" = 1 ] && command -v qsub >/dev/null; then
        echo "dmltrain: checkpoint saved; resubmitting $script"
        qsub -v "DMLTRAIN_RUN_DIR=$run_dir,DMLTRAIN_ENV=${DMLTRAIN_ENV:-},DMLTRAIN_ARGS=$experiment $*" "$script"
    else
        echo "dmltrain: checkpoint saved; go on with: qsub -v DMLTRAIN_RUN_DIR=$run_dir,DMLTRAIN_ARGS=\"$experiment $*\" $script"
    fi
    exit 0
fi
exit "$status"

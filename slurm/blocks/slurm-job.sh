job=${SLURM_JOB_ID:?run this script with sbatch}
if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
    job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"  # requeue this task, not the array
fi

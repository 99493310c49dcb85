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

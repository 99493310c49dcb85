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

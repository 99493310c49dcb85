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

# The environment to train in: DMLTRAIN_ENV is a venv directory or a conda env name.
if [ -n "${DMLTRAIN_ENV:-}" ]; then
    if [ -f "$DMLTRAIN_ENV/bin/activate" ]; then
        # shellcheck disable=SC1091
        source "$DMLTRAIN_ENV/bin/activate"
    else
        eval "$(conda shell.bash hook)" && conda activate "$DMLTRAIN_ENV" || exit 1
    fi
fi

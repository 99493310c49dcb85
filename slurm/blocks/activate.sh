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

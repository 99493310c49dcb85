cd "${PBS_O_WORKDIR:-.}" || exit 1
# qsub passes no arguments to a script: the experiment and its flags come in DMLTRAIN_ARGS
# (split on spaces) unless given as arguments.
if [ $# -eq 0 ]; then
    read -r -a args <<< "${DMLTRAIN_ARGS:-}"
    set -- "${args[@]}"
fi
[ $# -gt 0 ] || { echo "dmltrain: no experiment: qsub -v DMLTRAIN_ARGS=\"mnist --epochs 10\" $script" >&2; exit 2; }

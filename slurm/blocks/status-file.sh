# torchrun reports any worker's failure as exit status 1: rank 0 wrote the real status.
if [ -s "$status_file" ]; then
    status=$(cat "$status_file")
    rm -f "$status_file"
fi

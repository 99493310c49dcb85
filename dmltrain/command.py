"""The ``dmltrain`` command and ``python -m dmltrain``: ``dmltrain.cli.entry`` in a process of
its own, with Ctrl-C before it starts (while torch is imported) one line, not a traceback."""

import os
import sys


def entry() -> int:
    try:
        from dmltrain.runtime.preemption import StartupSignals

        with StartupSignals.install().deferring():
            from dmltrain.cli import entry as run
    except KeyboardInterrupt:
        print("dmltrain: interrupted while starting", file=sys.stderr, flush=True)
        # no interpreter teardown: half-imported modules may raise there again
        os._exit(130)
    return run()

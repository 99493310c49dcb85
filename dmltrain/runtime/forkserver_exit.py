"""Makes the ``--nprocs`` fork server leave at once when it is told to end; imported there
only (``FORKSERVER_PRELOAD``).

The server ends when the process that started it has gone (its "alive" pipe closes), by
``SystemExit``, and the interpreter's teardown with torch loaded is slow. Its workers
learn that their parent died from the signal that comes when the server has gone, so
until then they train on, and may end the run without its checkpoint. The server writes
nothing and its workers leave by ``os._exit``: nothing of the teardown is needed.
"""

import atexit
import os

atexit.register(os._exit, 0)  # the last registered runs first: before torch's handlers

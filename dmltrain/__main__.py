"""``python -m dmltrain``: the same as the ``dmltrain`` command."""

import sys

from dmltrain.command import entry

sys.exit(entry())

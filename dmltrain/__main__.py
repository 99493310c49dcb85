"""``python -m dmltrain``: the same as the ``dmltrain`` command."""

import sys

from dmltrain.cli import entry

sys.exit(entry())

"""``python -m hypertrain``: the same as the ``hypertrain`` command."""

import sys

from hypertrain.cli import main

sys.exit(main())

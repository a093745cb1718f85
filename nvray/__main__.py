"""``python -m nvray``: the ``nvray`` command (nvray/cli.py)."""

import sys

from nvray.cli import main

sys.exit(main())

"""``python -m nvray``: the ``nvray`` command (nvray/cli.py)."""

import sys

from nvray.cli import main

if __name__ == "__main__":
    sys.exit(main())

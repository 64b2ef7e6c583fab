"""``python -m ragserve``: the ``ragserve`` command."""

import sys

from ragserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

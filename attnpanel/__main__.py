"""``python -m attnpanel``: the command line (see :mod:`attnpanel.cli`)."""

import sys

from attnpanel.cli import main

if __name__ == "__main__":
    sys.exit(main())

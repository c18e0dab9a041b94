"""The ``attnpanel`` command line: serve, export, info, trace and train.

Every subcommand has ``--help``. Bad input (a missing file, wrong dims, a corrupted trace,
a layer or sample the trace does not have) prints one line ``attnpanel: error: ...`` and
exits with status 2, never a traceback. A reader that closes the output early
(``attnpanel info t.nc | head -1``) ends the command quietly, with status 0. Also run as
``python -m attnpanel``.

One module per command (``serve``, ``export``, ``info``, ``trace``, ``overviews``,
``train``), each adding its own subcommand to the parser (:mod:`attnpanel.cli.main`).
"""

from attnpanel.cli.main import build_parser, main

__all__ = ["build_parser", "main"]

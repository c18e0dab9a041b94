"""The ``attnpanel`` command line: the parser every command adds itself to, and ``main``."""

from __future__ import annotations

import argparse
import os
import sys

from attnpanel.cli import (
    circuits,
    compare,
    evaluate,
    export,
    figure,
    importance,
    info,
    overviews,
    patch,
    serve,
    survey,
    trace,
    train,
    why,
)
from attnpanel.cli.common import EXIT_BAD_INPUT, CommandError, cli_text, say

COMMANDS = (
    serve,
    export,
    figure,
    info,
    trace,
    importance,
    patch,
    evaluate,
    compare,
    circuits,
    why,
    survey,
    overviews,
    train,
)  # in the order --help lists them


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose refusal of a flag is one line (``attnpanel: error: figure: argument
    --stage: invalid choice ...``) where argparse printed the whole usage above it; exit 2."""

    def error(self, message: str):
        command = self.prog.removeprefix("attnpanel").strip()
        where = f"{command}: " if command else ""
        help_ = f"attnpanel {command} --help" if command else "attnpanel --help"
        self.exit(EXIT_BAD_INPUT, f"attnpanel: error: {where}{message} (see {help_})\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``attnpanel``: each command module adds its own subcommand."""
    parser = OneLineParser(
        prog="attnpanel", description="Explore multi-head self-attention at full resolution."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.rest = extra  # the trainer parses its own options, --help included
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    except CommandError as error:
        say(f"attnpanel: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # one line for the user; ATTNPANEL_DEBUG=1 shows the traceback
        if os.environ.get("ATTNPANEL_DEBUG"):
            raise
        say(f"attnpanel: error: {type(error).__name__}: {cli_text(error)}", file=sys.stderr)
        return 1
    return 0


def _closed_pipe() -> int:
    """The reader of stdout went away (``attnpanel info t.nc | head -1``): end quietly.

    stdout is pointed at /dev/null so that the interpreter's final flush of what is left in
    its buffer does not fail again (see the Python docs on SIGPIPE).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (a test's capture)
        pass
    return 0

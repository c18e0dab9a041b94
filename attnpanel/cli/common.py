"""What every command shares: one-line errors, safe printing, reading a trace, option types."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def say(text: str, file=None) -> None:
    """Print a line that may hold a trace's or a model's strings, safe for a terminal."""
    from attnpanel.util.untrusted import terminal

    print(terminal(text), file=file or sys.stdout)


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message, for a one-line report (in the
    command line's words where the error has them: ``--force``, not ``overwrite=True``)."""
    lines = [line.strip() for line in cli_text(error).splitlines() if line.strip()]
    return lines[0].rstrip(":") if lines else type(error).__name__


def cli_text(error: BaseException) -> str:
    """An error's message as the command line says it."""
    return getattr(error, "cli_words", None) or str(error)


def load_trace(path: str, sample: int | None = None):
    """The trace at ``path``; with ``sample``, that sample alone (its data only is read)."""
    from attnpanel.traces.io import load

    try:
        return load(path, samples=None if sample is None else [sample])
    except IndexError as error:  # "sample 9 is out of range: the trace has 2 samples, ..."
        raise CommandError(f"--{first_line(error)}") from error
    except (FileNotFoundError, ValueError) as error:
        raise CommandError(str(error).splitlines()[0]) from error


def check_sample(capture, sample: int) -> None:
    from attnpanel.traces.io import check_samples
    from attnpanel.traces.layers import groups

    try:
        check_samples(groups(capture), [sample])
    except IndexError as error:  # "sample 9 is out of range: the trace has 2 samples, ..."
        raise CommandError(f"--{first_line(error)}") from error


def check_output(path: str, overwrite: bool) -> None:
    from attnpanel.traces.io import FORMATS
    from attnpanel.util.files import check_target

    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise CommandError(
            f"-o {path}: a trace is written as .nc or .zarr, not {suffix or 'no suffix'!r}"
        )
    try:
        check_target(path, FORMATS[suffix], overwrite)
    except OSError as error:
        raise CommandError(first_line(error)) from error


def port(text: str) -> int:
    """A TCP port number from the command line, refused by argparse when out of range."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: ports are 1-65535")
    return port


def whole(text: str, minimum: int, what: str, hint: str) -> int:
    """An integer option of at least ``minimum``, or a usage error naming it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value}: give {hint}")
    return value


def procs(text: str) -> int:
    """A ``--num-procs`` value: 0 (one per core) or more."""
    return whole(text, 0, "number of processes", "0 (one per core) or more")


def positive(text: str) -> int:
    """A count of at least 1 (workers, pixels)."""
    return whole(text, 1, "whole number", "1 or more")


def overviews_folder(path: str | Path, group: str = "") -> Path:
    """Where the overviews of one group of the trace file ``path`` are stored (a Dataset
    is the one group ``""``): ``TRACE.overviews``, one subfolder per named group."""
    from attnpanel.traces.overviews import folder_for

    name = group.strip("/")
    return folder_for(path) / name if name else folder_for(path)


def stored_overviews(capture, path: str | Path, group: str = ""):
    """The overviews of one group of a virtual trace file: those stored beside it, read
    once (and new ones stored there); None for a dense trace. The Overviews holds the
    whole group, stacked layers included (an entry names its layer)."""
    from attnpanel.traces.layers import groups
    from attnpanel.traces.overviews import Overviews
    from attnpanel.traces.virtual import is_virtual

    ds = groups(capture)[group]
    return Overviews(ds, overviews_folder(path, group)) if is_virtual(ds) else None

"""``attnpanel info``: the shape table and what each head attends to; a head ranking
(``attnpanel importance``) most important first."""

from __future__ import annotations

import argparse

from attnpanel.cli.common import check_sample, load_trace, say


def _heading(layer) -> str:
    return f"== layer {layer.name}" + (f" (group {layer.group})" if layer.group else "")


def run(args: argparse.Namespace) -> None:
    """Print the shape table and per-head summary of every layer of a saved trace."""
    from attnpanel.cli.importance import ranking_lines
    from attnpanel.readouts.summary import describe
    from attnpanel.traces.layers import layers, select
    from attnpanel.traces.rankings import load_ranking

    try:
        ranking = load_ranking(args.trace)
    except (ValueError, FileNotFoundError):
        ranking = None  # not a ranking: a trace, or an error load_trace words
    if ranking is not None:
        for line in ranking_lines(ranking):
            say(line)
        return
    capture = load_trace(args.trace)
    check_sample(capture, args.sample)
    every = layers(capture)
    for index, layer in enumerate(every):
        if len(every) > 1 or layer.name:
            say(_heading(layer))
        one = select(capture, index)
        say(describe(one, batch=args.sample, positions=args.positions))


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    info = sub.add_parser("info", help="print the shape table and what each head attends to")
    info.add_argument(
        "trace", help="a saved trace (.nc or .zarr), or a head ranking (attnpanel importance)"
    )
    info.add_argument("--sample", type=int, default=0, help="which sample to summarise")
    info.add_argument(
        "--positions",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="list, per position, the key each head attends to most (default: up to 64 positions)",
    )
    info.set_defaults(func=run)

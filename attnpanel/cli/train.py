"""``attnpanel train``: retrain the demo model."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> None:
    """Train the demo model on synthetic household power."""
    from attnpanel.nilm import training

    training.main(args.rest)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    train = sub.add_parser(
        "train", help="train the demo model (see attnpanel train --help)", add_help=False
    )
    train.set_defaults(func=run)

"""``attnpanel figure``: one view of a saved trace (or a head ranking) as a figure for a
paper, SVG, PDF or PNG (:mod:`attnpanel.render.paper`)."""

from __future__ import annotations

import argparse

from attnpanel.cli.common import CommandError, first_line, load_trace, say
from attnpanel.traces.schema import FIGURE_VIEWS, HEAD_SCALES, STAGES


def run(args: argparse.Namespace) -> None:
    """Write the view as a figure."""
    from attnpanel.readouts import core
    from attnpanel.render import paper
    from attnpanel.traces.layers import find, groups, layers, select
    from attnpanel.traces.rankings import load_ranking

    if args.view == "importance":
        try:
            ranking = load_ranking(args.trace)
        except (ValueError, FileNotFoundError) as error:
            message = f"--view importance takes a head ranking: {first_line(error)}"
            raise CommandError(message) from error
        element = paper.importance(ranking)
        shown = "head importance"
    else:
        capture = load_trace(args.trace, sample=args.sample)  # that sample alone
        try:
            entry = find(capture, args.layer)
        except ValueError as error:
            raise CommandError(first_line(error)) from error
        ds = select(capture, layers(capture).index(entry))
        head = args.head if args.head == "mean" else int(args.head)
        if head != "mean" and not 0 <= head < ds.sizes["head"]:
            raise CommandError(
                f"--head {head} is out of range: the layer has {ds.sizes['head']} heads"
            )
        mask = args.mask or ds.attrs.get("mask", "none")
        sel = core.Selection(sample=0, head=head, mask=mask, stage=args.stage)
        group = groups(capture)[entry.group]
        stacked = group if "layer" in group.dims else None
        try:
            element = paper.view_of(
                args.view, ds, sel, stacked, scale=args.scale, number=args.sample
            )
        except (ValueError, KeyError) as error:
            raise CommandError(first_line(error)) from error
        shown = f"layer {entry.name or 0}, sample {args.sample}"
    try:
        written = paper.write_figure(element, args.output, overwrite=args.force)
    except (ValueError, OSError) as error:
        raise CommandError(first_line(error)) from error
    say(f"wrote {written}: {args.view}, {shown}")


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    figure = sub.add_parser(
        "figure",
        help="write one view as a figure for a paper (.svg, .pdf or .png)",
        description="One view of a saved trace, as the page draws it for the same state, "
        "written by matplotlib at one paper column's width: .svg and .pdf are vector "
        "figures, .png is 300 dpi.",
    )
    figure.add_argument("trace", help="a saved trace (.nc, .zarr); a head ranking for importance")
    figure.add_argument("--view", choices=FIGURE_VIEWS, default="matrix", help="what to draw")
    figure.add_argument("-o", "--output", required=True, help="the figure: .svg, .pdf or .png")
    figure.add_argument("--sample", type=int, default=0)
    figure.add_argument("--head", default="0", help="a head, or mean")
    figure.add_argument("--layer", help="a layer by name or index (default: the first)")
    figure.add_argument("--mask", choices=("none", "diagonal", "causal"), help="default: its own")
    figure.add_argument("--stage", choices=STAGES, default="softmax")
    figure.add_argument(
        "--scale",
        choices=HEAD_SCALES,
        default="own",
        help="heads: each head on its own colour scale (default), or one shared by every head",
    )
    figure.add_argument("--force", action="store_true", help="replace an existing figure")
    figure.set_defaults(func=run)

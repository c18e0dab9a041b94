"""``attnpanel overviews``: the overview levels of every map of a long trace, stored beside it."""

from __future__ import annotations

import argparse

from attnpanel.cli.common import CommandError, load_trace, overviews_folder, positive, say


def run(args: argparse.Namespace) -> None:
    """Build the overview levels of every map of a saved trace and store them beside it."""
    import time

    from attnpanel.traces.layers import groups
    from attnpanel.traces.overviews import Overviews

    capture = load_trace(args.trace)
    folder = overviews_folder(args.trace)
    start = time.perf_counter()
    built = total = 0
    for group, ds in groups(capture).items():
        if "q" not in ds or "k" not in ds:
            raise CommandError(
                f"the trace{f' (group {group})' if group else ''} holds no q and k, from "
                "which overviews are computed"
            )
        masks = args.masks or [ds.attrs.get("mask", "none")]
        if ds.attrs.get("attention") == "cross" and set(masks) - {"none"}:
            raise CommandError("a cross-attention trace has overviews only under --masks none")
        store = Overviews(ds, overviews_folder(args.trace, group))
        entries = store.entries(masks=masks, pixels=tuple(args.pixels))
        total += len(entries)
        built += len(
            store.build(entries, scheduler=args.scheduler, workers=args.workers, progress=True)
        )
    say(
        f"{built} overview{'s' if built != 1 else ''} built, {total - built} already stored, "
        f"in {time.perf_counter() - start:.1f} s: {folder}"
    )


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    overviews = sub.add_parser(
        "overviews",
        help="build the overview levels of every map of a trace (for long sequences)",
        description="Reduce every (sample, layer, head, mask) map of a trace to display "
        "resolution (per-pixel max, mean and blocked share) on dask.distributed and store "
        "them in zarr beside the trace (TRACE.overviews), so that the explorer paints a long "
        "trace at once. Maps already stored are skipped; an interrupted build keeps what "
        "it finished.",
    )
    overviews.add_argument("trace", help="a saved trace (.nc or .zarr)")
    overviews.add_argument(
        "--masks",
        nargs="+",
        choices=["none", "diagonal", "causal"],
        help="the mask modes to build (default: the trace's own)",
    )
    overviews.add_argument(
        "--pixels",
        type=positive,
        nargs=2,
        default=[480, 480],
        metavar=("ROWS", "COLS"),
        help="the overview's size (default 480 480)",
    )
    overviews.add_argument(
        "--scheduler", help="the address of a running dask scheduler (default: a LocalCluster)"
    )
    overviews.add_argument(
        "--workers", type=positive, default=2, help="LocalCluster worker processes (default 2)"
    )
    overviews.set_defaults(func=run)

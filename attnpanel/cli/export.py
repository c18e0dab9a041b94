"""``attnpanel export``: a standalone offline HTML page of one layer and one sample."""

from __future__ import annotations

import argparse

from attnpanel.cli.common import CommandError, first_line, load_trace, say, stored_overviews


def _pick_layer(capture, layer: str | None):
    """One layer of a capture by index or module name, with the valid choices on a miss."""
    from attnpanel.traces.layers import layers

    every = layers(capture)
    if layer is None:
        return every[0]
    if layer.lstrip("-").isdigit():
        index = int(layer)
        if not -len(every) <= index < len(every):
            raise CommandError(
                f"--layer {index} is out of range: the trace has {len(every)} "
                f"layer{'s' if len(every) != 1 else ''}, 0 to {len(every) - 1}"
            )
        return every[index]
    for entry in every:
        if entry.name == layer:
            return entry
    names = ", ".join(entry.name for entry in every[:12] if entry.name)
    more = f" and {len(every) - 12} more" if len(every) > 12 else ""
    known = f"the layers are {names}{more}" if names else "the trace has one unnamed layer"
    raise CommandError(
        f"--layer {layer!r} is not a layer of the trace: {known} (or 0 to {len(every) - 1})"
    )


def run(args: argparse.Namespace) -> None:
    """Write a standalone, offline HTML file of one layer and one sample of a trace."""
    from attnpanel.render.export import export_html
    from attnpanel.traces.layers import groups, layers, select
    from attnpanel.traces.virtual import densified, is_virtual
    from attnpanel.util.untrusted import page_title

    capture = load_trace(args.trace)
    entry = _pick_layer(capture, args.layer)
    index = layers(capture).index(entry)
    ds = select(capture, index)
    n = ds.sizes["batch"]
    if not 0 <= args.sample < n:
        raise CommandError(
            f"--sample {args.sample} is out of range: the trace has {n} "
            f"sample{'s' if n != 1 else ''}, 0 to {n - 1}"
        )
    source = str(capture.attrs.get("source", "") or ds.attrs.get("source", ""))
    title = page_title(source)
    shown = f"layer {entry.name}" if entry.name else f"layer {index}"
    if entry.group:
        shown += f" (group {entry.group})"
    # a virtual trace is drawn from its overviews, read from (and stored in) TRACE.overviews;
    # one whose maps fit in memory (attnpanel trace --demo's) as a dense one
    ds = densified(ds)
    dense = not is_virtual(ds)
    overviews = None if dense else stored_overviews(capture, args.trace, entry.group)
    stacked = "layer" in groups(capture)[entry.group].dims
    try:
        path = export_html(
            ds,
            args.output,
            sample=args.sample,
            title=title,
            subtitle=shown,
            overwrite=args.force,
            query=args.query,
            masks=args.masks,
            overviews=overviews,
            layer=entry.index if overviews is not None and stacked else None,
        )
    except (ValueError, OSError) as error:
        raise CommandError(first_line(error)) from error
    say(f"wrote {path}: {shown}, sample {args.sample}")


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    export = sub.add_parser(
        "export", help="write a standalone offline HTML file of one layer and one sample"
    )
    export.add_argument("trace", help="a saved trace (.nc or .zarr)")
    export.add_argument("-o", "--output", required=True, help="the HTML file to write")
    export.add_argument(
        "--force", action="store_true", help="replace an existing HTML page at --output"
    )
    export.add_argument(
        "--layer",
        help="the layer to show: its module name (see attnpanel info) or its index among all "
        "layers, every group included (default: the first)",
    )
    export.add_argument("--sample", type=int, default=0, help="which sample to show (default 0)")
    export.add_argument(
        "--query", type=int, default=0, help="the query selected when the page opens (default 0)"
    )
    export.add_argument(
        "--masks",
        nargs="+",
        metavar="MASK",
        help="the mask modes to show (default: every mode for a dense trace; the trace's own "
        "for a virtual one, drawn from its overviews in TRACE.overviews: another mode "
        "computes and stores its overviews, about 10 s a head at L = 65,536)",
    )
    export.set_defaults(func=run)

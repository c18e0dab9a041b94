"""``attnpanel compare``: how far apart two captures of the same inputs attend, head by head."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from attnpanel.cli.common import (
    CommandError,
    check_output,
    check_sample,
    first_line,
    load_trace,
    positive,
    say,
)

LISTED_HEADS = 20  # heads the ranking prints before "... and N more"
HEAD_NUMBERS = ("js", "max_abs", "rows")  # what the report keeps without --difference


def _head_rows(comparison) -> list[tuple[str, int, float, float]]:
    """``(layer, head, js, max_abs)`` of every head of a comparison (a Dataset or a
    DataTree of them), most different first; heads without a real query row last."""
    import xarray as xr

    if isinstance(comparison, xr.DataTree):
        found = [node.to_dataset(inherit=False) for node in comparison.subtree]
        found = [ds for ds in found if "js" in ds.data_vars]
    else:
        found = [comparison]
    rows = []
    for ds in found:
        stacked = ds[["js", "max_abs"]]
        if "layer" not in stacked.dims:
            name = str(ds["layer"].values) if "layer" in ds.coords else ""
            stacked = stacked.drop_vars("layer", errors="ignore").expand_dims(layer=[name])
        for layer in stacked["layer"].values:
            for head in stacked["head"].values:
                cell = stacked.sel(layer=layer, head=head)
                rows.append((str(layer), int(head), float(cell["js"]), float(cell["max_abs"])))
    return sorted(rows, key=lambda row: (math.isnan(row[2]), -row[2] if row[2] >= 0 else 0.0))


def divergence_lines(comparison) -> list[str]:
    """The heads ranked by divergence, as ``attnpanel compare`` prints them."""
    rows = _head_rows(comparison)
    lines = [
        f"a: {comparison.attrs.get('a', 'a')}",
        f"b: {comparison.attrs.get('b', 'b')}",
        "heads by Jensen-Shannon divergence of their query rows (nats, mean over real "
        "queries; at most ln 2 = 0.693), most different first:",
    ]
    width = max((len(layer) for layer, *_ in rows[:LISTED_HEADS]), default=0)
    for rank, (layer, head, js, gap) in enumerate(rows[:LISTED_HEADS], start=1):
        lines.append(
            f"  {rank:3d}. {layer:<{width}}  head {head:<3d} js {js:.4g}  max|b-a| {gap:.4g}"
        )
    if len(rows) > LISTED_HEADS:
        lines.append(f"  ... and {len(rows) - LISTED_HEADS} more")
    return lines


def _without_difference(comparison):
    import xarray as xr

    if isinstance(comparison, xr.DataTree):
        kept = xr.DataTree.from_dict(
            {
                node.path: node.to_dataset(inherit=False)[list(HEAD_NUMBERS)]
                for node in comparison.subtree
                if "js" in node.data_vars
            }
        )
        kept.attrs = dict(comparison.attrs)
        return kept
    return comparison[list(HEAD_NUMBERS)]


def _save(comparison, path: str, overwrite: bool) -> Path:
    """Write the comparison as netCDF (a DataTree as groups), never half-written."""
    from attnpanel.util.files import write_safely

    def write(target: Path) -> None:
        comparison.to_netcdf(target, engine="h5netcdf")

    return write_safely(path, "netcdf", write, overwrite)


def _html_report(args: argparse.Namespace, a, b, comparison) -> Path:
    """Write the offline HTML report of two Datasets (the ranking and the top heads' maps)."""
    import xarray as xr

    from attnpanel.readouts.compare import ranked_heads
    from attnpanel.render.compare_report import compare_html

    if not (isinstance(a, xr.Dataset) and isinstance(b, xr.Dataset)):
        raise CommandError(
            f"{args.a} and {args.b} hold several groups: an HTML report draws the maps of one "
            "group; write the comparison as .nc, or save each group as a trace of its own"
        )
    check_sample(a, args.sample)
    labels = (comparison.attrs["a"], comparison.attrs["b"])
    try:
        return compare_html(
            a,
            b,
            ranked_heads(comparison),
            args.output,
            sample=args.sample,
            heads=args.heads,
            labels=labels,
            overwrite=args.force,
        )
    except ValueError as error:
        raise CommandError(first_line(error)) from error


def run(args: argparse.Namespace) -> None:
    """Compare two saved captures of the same inputs and save the comparison: netCDF
    (``.nc``), or a standalone HTML page (``.html``)."""
    from attnpanel.readouts.compare import compare
    from attnpanel.util.files import check_target

    page = args.output.lower().endswith(".html")
    if not page and not args.output.lower().endswith(".nc"):
        raise CommandError(
            f"a comparison is saved as netCDF (.nc) or as an HTML page (.html): {args.output} "
            "does not end in .nc or .html"
        )
    if page and args.difference:
        raise CommandError("--difference goes with a .nc comparison, not an HTML page")
    if page:
        try:
            check_target(args.output, "html", args.force)
        except OSError as error:
            raise CommandError(first_line(error)) from error
    else:
        check_output(args.output, args.force)
    a, b = load_trace(args.a), load_trace(args.b)
    try:
        comparison = compare(a, b)
    except ValueError as error:
        raise CommandError(f"{args.a} and {args.b}: {first_line(error)}") from error
    comparison.attrs.update(a_file=str(args.a), b_file=str(args.b))
    heads = len(_head_rows(comparison))
    if page:
        written = _html_report(args, a, b, comparison)
        drawn = min(args.heads, heads)
        say(f"wrote {written}: {heads} heads compared, the maps of the {drawn} most different")
    else:
        report = comparison if args.difference else _without_difference(comparison)
        written = _save(report, args.output, args.force)
        kept = "with" if args.difference else "without"
        say(f"wrote {written}: {heads} heads compared ({kept} the difference maps)")
    for line in divergence_lines(comparison):
        say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    compare = sub.add_parser(
        "compare",
        help="compare the attention of two captures of the same inputs, head by head",
        description="Compare two saved captures of the same inputs (two checkpoints, float32 "
        "and bfloat16, before and after fine-tuning): the Jensen-Shannon divergence of every "
        "head's query rows and the largest |b - a|, saved (.nc) and printed most different "
        "first.",
    )
    compare.add_argument("a", help="the first capture (.nc or .zarr)")
    compare.add_argument("b", help="the second capture, of the same inputs")
    compare.add_argument(
        "-o",
        "--output",
        required=True,
        help="the comparison file: .nc (the numbers), or .html (a standalone page that works "
        "offline: the ranking, and A, B and B - A of the most different heads)",
    )
    compare.add_argument(
        "--difference",
        action="store_true",
        help="also save the b - a weights of every cell (as large as a capture's weights; .nc)",
    )
    compare.add_argument(
        "--sample",
        type=int,
        default=0,
        help="the sample whose maps an .html page draws (default 0)",
    )
    compare.add_argument(
        "--heads",
        type=positive,
        default=8,
        help="how many of the most different heads an .html page draws (default 8)",
    )
    compare.add_argument("--force", action="store_true", help="replace an existing file")
    compare.set_defaults(func=run)

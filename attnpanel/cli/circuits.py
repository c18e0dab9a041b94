"""``attnpanel circuits``: every head's QK and OV circuits and every pair's composition
scores, read from a saved trace's projection matrices, saved (.nc) and the strongest
printed beside what random matrices score."""

from __future__ import annotations

import argparse

from attnpanel.cli.common import CommandError, first_line, load_trace, say

LISTED = 8  # pairs of each mode (and copying heads) the summary prints


def circuit_lines(result) -> list[str]:
    """The strongest compositions of each mode and the most copying heads of a
    :func:`attnpanel.circuits` result (a Dataset, or a DataTree of groups)."""
    import xarray as xr

    if isinstance(result, xr.DataTree):
        streams = [n.to_dataset(inherit=False) for n in result.subtree if "composition" in n.ds]
    else:
        streams = [result]
    lines = [f"circuits from the weights of {result.attrs.get('source') or 'a trace'}"]
    for ds in streams:
        lines.extend(_stream_lines(ds))
    return lines


def _stream_lines(ds) -> list[str]:
    import numpy as np

    group = ds.attrs.get("group")
    lines = [f"== group {group}"] if group else []
    lines.append(
        f"{ds.sizes['layer']} layers x {ds.sizes['head']} heads, d_model {ds.attrs['d_model']}, "
        f"head_dim {ds.attrs['head_dim']} ({ds.attrs['note']})"
    )
    layers = [str(name) for name in ds["layer"].values]
    for mode in ds["mode"].values:
        scores = ds["composition"].sel(mode=mode).values
        chance = float(ds["composition_baseline"].sel(mode=mode))
        p95 = float(ds["composition_baseline_p95"].sel(mode=mode))
        found = np.argwhere(np.isfinite(scores))
        if not len(found):
            lines.append(f"{mode}-composition: one layer, no pair of layers to compose")
            continue
        order = np.argsort(-scores[tuple(found.T)], kind="stable")[:LISTED]
        lines.append(
            f"{mode}-composition, strongest first (random matrices of these shapes: mean "
            f"{chance:.3f}, p95 {p95:.3f}):"
        )
        for a, h, b, g in found[order]:
            score = scores[a, h, b, g]
            lines.append(
                f"  {layers[a]} head {h} -> {layers[b]} head {g}  {score:.3f}"
                f"  ({score / chance:.1f}x random)"
            )
    copying = ds["ov_copying"].values
    order = np.argsort(-copying, axis=None, kind="stable")[:LISTED]
    lines.append("OV copying score (share of positive eigenvalue mass; 0.5: none), highest first:")
    for flat in order:
        layer, head = np.unravel_index(flat, copying.shape)
        lines.append(f"  {layers[layer]} head {head}  {copying[layer, head]:.3f}")
    return lines


def run(args: argparse.Namespace) -> None:
    """Read every head's circuits from a saved trace's weights and save them (``.nc``)."""
    from attnpanel.readouts.circuits import circuits, save_circuits
    from attnpanel.util.files import check_target

    if not args.output.lower().endswith(".nc"):
        raise CommandError(f"circuits are saved as netCDF (.nc): {args.output} does not end in .nc")
    try:
        check_target(args.output, "netcdf", args.force)
    except OSError as error:
        raise CommandError(first_line(error)) from error
    trace = load_trace(args.trace)
    try:
        result = circuits(trace)
    except ValueError as error:
        raise CommandError(f"{args.trace}: {first_line(error)}") from error
    result.attrs["trace_file"] = str(args.trace)
    written = save_circuits(result, args.output, args.force)
    say(f"wrote {written}")
    for line in circuit_lines(result):
        say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    command = sub.add_parser(
        "circuits",
        help="every head's QK and OV circuits and their composition, from a trace's weights",
        description="Read every head's QK and OV circuits from a saved trace's projection "
        "matrices (w_q, w_k, w_v, w_o): their singular values, the OV copying score, and the "
        "Q-, K- and V-composition score of every head into every head of a later layer, "
        "beside what random matrices of the same shapes score (docs/why.md). Saved as "
        "netCDF; `attnpanel info` prints it again.",
    )
    command.add_argument("trace", help="a saved trace with projection matrices (.nc or .zarr)")
    command.add_argument("-o", "--output", required=True, help="the circuits file (.nc)")
    command.add_argument("--force", action="store_true", help="replace an existing file")
    command.set_defaults(func=run)

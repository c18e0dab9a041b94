"""``attnpanel why``: one cell's score split over the input's channels and positions, the
query side and the key side apart (``attnpanel.score_attribution``), saved (.nc) and its
largest shares printed."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, first_line, positive, say

TOP_SHARES = 8  # channels (and positions) of each side the summary prints


def why_lines(found) -> list[str]:
    """The cell, its score's change and each side's largest channels and positions."""
    a = found.attrs
    change = a["score"] - a["baseline_score"]
    if a["query"] < 0:
        what = "attends over its whole map (scores weighted by its weights)"
    elif a["key"] < 0:
        what = f"attends from query {a['query']} over its row (scores weighted by its weights)"
    else:
        what = f"attends from query {a['query']} to key {a['key']}"
    explained = a.get("explains", "score")
    lines = [
        f"why {a['layer']} head {a['head']} {what}: "
        f"{explained} {a['score']:.4g} (from {a['baseline_score']:.4g} at the {a['baseline']} "
        f"baseline: a change of {change:.4g})",
        f"integrated gradients at {a['attributed_at']}, {a['steps']} steps: the shares add "
        f"up to the change within {abs(a['completeness_error']):.2g}",
    ]
    for side in found["side"].values:
        shares = found.sel(side=side)
        total = float(shares.sum())
        channels = shares.sum("position").to_series()
        top = channels.abs().sort_values(ascending=False).index[:TOP_SHARES]
        lines.append(f"{side} side: {total:.4g} of it; channels by |share|:")
        for name in top:
            lines.append(f"  {name:<24} {channels[name]:+.4g}")
        positions = shares.sum("channel").to_series()
        best = positions.abs().sort_values(ascending=False).index[:TOP_SHARES]
        listed = ", ".join(f"{p} ({positions[p]:+.3g})" for p in best)
        lines.append(f"  positions by |share|: {listed}")
    return lines


def parts_lines(parts) -> list[str]:
    """The score's largest parts through the query and through the key."""
    a = parts.attrs
    lines = [f"the score q . k * scale = {a['product']:.4g} split over the earlier parts "
             "that wrote the layer's input (layer norms frozen at this run):"]  # fmt: skip
    for side, other in (("query", "key_part"), ("key", "query_part")):
        shares = parts.sum(other).to_series()
        lines.append(f"through the {side}:")
        for name in shares.abs().sort_values(ascending=False).index[:TOP_SHARES]:
            lines.append(f"  {name:<40} {shares[name]:+.4g}")
    return lines


def run(args: argparse.Namespace) -> None:
    """Attribute one cell's score of a model and save the attribution (``.nc``)."""
    from attnpanel.cli.models import checkpoint_run, hugging_face_run
    from attnpanel.interventions.attribution import AttributionError, score_attribution
    from attnpanel.nilm.nilmformer import TIME_FEATURE_NAMES
    from attnpanel.util.files import check_target, write_safely

    if (args.model is None) == (args.checkpoint is None):
        raise CommandError("give either --checkpoint or --model with --text")
    if args.parts and args.key is None:
        raise CommandError("--parts splits one cell: give --key")
    if args.query is None and args.key is not None:
        raise CommandError("--key needs --query (or give neither: the whole map)")
    if args.weight and args.key is None:
        raise CommandError("--weight explains one cell's weight: give --query and --key")
    if not args.output.lower().endswith(".nc"):
        raise CommandError(f"an attribution is saved as netCDF: {args.output} does not end in .nc")
    try:
        check_target(args.output, "netcdf", args.force)
    except OSError as error:
        raise CommandError(first_line(error)) from error
    if args.model is not None:
        if not args.text:
            raise CommandError("--model needs --text")
        model, _, inputs = hugging_face_run(Path(args.model), args.text)
        channels = None  # the word embedding's dims
    else:
        model, inputs, _ = checkpoint_run(Path(args.checkpoint), args.sample + 1)
        channels = ["aggregate power", *TIME_FEATURE_NAMES]
    try:
        found = score_attribution(
            model, inputs, layer=args.layer, head=args.head, query=args.query, key=args.key,
            sample=args.sample, baseline=args.baseline, steps=args.steps, channels=channels,
            of="weight" if args.weight else "score",
        )  # fmt: skip
    except AttributionError as error:
        raise CommandError(first_line(error)) from error
    written = write_safely(
        args.output, "netcdf", lambda t: found.to_netcdf(t, engine="h5netcdf"), args.force
    )
    say(f"wrote {written}")
    for line in why_lines(found):
        say(line)
    if args.parts:
        from attnpanel.interventions.components import component_attribution

        try:
            parts = component_attribution(
                model, inputs, layer=args.layer, head=args.head, query=args.query,
                key=args.key, sample=args.sample,
            )  # fmt: skip
        except AttributionError as error:
            raise CommandError(first_line(error)) from error
        for line in parts_lines(parts):
            say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    why = sub.add_parser(
        "why",
        help="why a head's query attends to a key: its score split over the input's channels",
        description="Split one cell's score (a head, a query, a key of a layer) over the "
        "model's input channels and positions, the query side and the key side apart, by "
        "integrated gradients (docs/why.md); saved as netCDF, the largest shares printed.",
    )
    why.add_argument("--checkpoint", help="a NILMFormer model file, on the demo's held-out windows")
    why.add_argument("--model", help="a local Hugging Face model directory (with --text)")
    why.add_argument("--text", nargs="+", help="the sentence(s) a --model reads")
    why.add_argument("--layer", required=True, help="the layer, as a capture names it")
    why.add_argument("--head", type=int, required=True)
    why.add_argument(
        "--query",
        type=int,
        help="the query (default, with no --key: the whole map, its scores weighted by the "
        "model's own weights)",
    )
    why.add_argument(
        "--key",
        type=int,
        help="the key (default: the query's whole row, its scores weighted "
        "by the model's own weights)",
    )
    why.add_argument(
        "--weight",
        action="store_true",
        help="explain the cell's weight (after the softmax) instead of its score",
    )
    why.add_argument("--sample", type=int, default=0, help="the window or text (default 0)")
    why.add_argument(
        "--baseline", choices=("zeros", "mean"), default="zeros", help="where the path starts"
    )
    why.add_argument("--steps", type=positive, default=128, help="steps of the path (128)")
    why.add_argument(
        "--parts",
        action="store_true",
        help="also split the score over the earlier parts that wrote the layer's input "
        "(the embedding, each earlier head, each MLP) and print the largest",
    )
    why.add_argument("-o", "--output", required=True, help="the attribution file (.nc)")
    why.add_argument("--force", action="store_true", help="replace an existing file")
    why.set_defaults(func=run)

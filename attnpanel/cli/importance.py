"""``attnpanel importance``: rank every head of a model by switching it off."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, check_output, first_line, say
from attnpanel.cli.models import checkpoint_run, hugging_face_run
from attnpanel.cli.recording import (
    add_recording_options,
    first_windows,
    recording_model,
    wants_recording,
)

TOP = 20  # heads the ranking lists before "... and N more"


def ranking_lines(importance) -> list[str]:
    """The ranking as ``attnpanel importance`` and ``attnpanel info`` print it."""
    from attnpanel.traces.rankings import ranked

    rows = ranked(importance)
    attrs = importance.attrs
    lines = [
        f"head importance ({attrs['method']}, how={attrs['how']}: {attrs['measure']}), "
        "most important first:"
    ]
    width = max((len(layer) for layer, _, _ in rows[:TOP]), default=0)
    for rank, (layer, head, value) in enumerate(rows[:TOP], start=1):
        lines.append(f"  {rank:3d}. {layer:<{width}}  head {head:<3d} {value:.4g}")
    if len(rows) > TOP:
        lines.append(f"  ... and {len(rows) - TOP} more")
    return lines


def run(args: argparse.Namespace) -> None:
    """Rank the heads of a model and save the ranking (``.nc``)."""
    from attnpanel.interventions.gate import AblationError
    from attnpanel.interventions.importance import head_importance
    from attnpanel.traces.rankings import save_ranking

    recorded = wants_recording(args)
    if not recorded and (args.model is None) == (args.checkpoint is None):
        raise CommandError("give either --checkpoint or --model with --text")
    if not args.output.lower().endswith(".nc"):
        raise CommandError(f"a ranking is saved as netCDF: {args.output} does not end in .nc")
    check_output(args.output, args.force)
    if recorded:
        shown = first_windows(recording_model(args), args.windows)
        model, (inputs, kwargs) = shown.model, shown.inputs()
    elif args.model is not None:
        if not args.text:
            raise CommandError("--model needs --text")
        model, inputs, kwargs = hugging_face_run(Path(args.model), args.text)
    else:
        model, inputs, kwargs = checkpoint_run(Path(args.checkpoint), args.windows)
    try:
        importance = head_importance(model, *inputs, how=args.how, method=args.method, **kwargs)
    except (AblationError, RuntimeError, TypeError) as error:
        raise CommandError(f"{type(model).__name__}: {first_line(error)}") from error
    written = save_ranking(importance, args.output, overwrite=args.force)
    say(f"wrote {written}: {importance.sizes['layer']} layers x {importance.sizes['head']} heads")
    for line in ranking_lines(importance):
        say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    importance = sub.add_parser(
        "importance",
        help="rank every head by what switching it off does to the model's output",
        description="Switch each attention head off alone inside the model (or take the "
        "gradient estimate) and save the ranking (.nc); `attnpanel info` prints it.",
    )
    importance.add_argument(
        "--checkpoint",
        help="a NILMFormer model file (as `attnpanel train` writes), run on "
        "the demo's held-out windows; with --model SPEC, that model's weights",
    )
    importance.add_argument(
        "--windows", type=int, default=8, help="held-out (or the recording's first) windows (8)"
    )
    importance.add_argument(
        "--model",
        help="a local Hugging Face model directory with its tokenizer (offline), or "
        "FILE.py:FUNCTION / package.module:FUNCTION returning your model (with --recording)",
    )
    importance.add_argument("--text", action="append", help="a text; repeat for a batch")
    importance.add_argument("--how", choices=("zero", "mean"), default="zero")
    importance.add_argument("--method", choices=("ablation", "gradient"), default="ablation")
    importance.add_argument("-o", "--output", required=True, help="the ranking file (.nc)")
    importance.add_argument("--force", action="store_true", help="replace an existing ranking")
    add_recording_options(importance, shared=True)
    importance.set_defaults(func=run)

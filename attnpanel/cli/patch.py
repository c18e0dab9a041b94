"""``attnpanel patch``: which heads carry the difference between a clean and a corrupted
input (activation patching, attribution patching)."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, check_output, first_line, say
from attnpanel.cli.importance import TOP
from attnpanel.cli.models import checkpoint_run, hugging_face_model, model_inputs
from attnpanel.cli.recording import (
    add_recording_options,
    first_windows,
    recording_model,
    wants_recording,
)


def effect_lines(effect) -> list[str]:
    """A patching effect as ``attnpanel patch`` and ``attnpanel info`` print it."""
    from attnpanel.traces.rankings import ranked

    rows = ranked(effect)
    attrs = effect.attrs
    lines = [
        f"patching effect ({attrs['method']}, {attrs['direction']}, what={attrs['what']}: "
        f"{attrs['measure']}), largest first:",
        f"  score clean {attrs.get('score_clean', float('nan')):.6g}, corrupted "
        f"{attrs.get('score_corrupted', float('nan')):.6g}",
    ]
    width = max((len(row[0]) for row in rows[:TOP]), default=0)
    for rank, row in enumerate(rows[:TOP], start=1):
        where = f"head {row[1]:<3d}" + (f" position {row[2]:<4d}" if len(row) == 4 else "")
        lines.append(f"  {rank:3d}. {row[0]:<{width}}  {where} {row[-1]:+.4g}")
    if len(rows) > TOP:
        lines.append(f"  ... and {len(rows) - TOP} more")
    return lines


def _demo_inputs(args):
    """The checkpoint's model, its clean windows, the corrupted ones and the score: the
    demo's own corrupted inputs (``--without``), or a span replaced."""
    import torch

    from attnpanel.interventions.corruptions import replace_span
    from attnpanel.nilm.demo import demo_model_run

    model, (power, features), _ = checkpoint_run(Path(args.checkpoint), args.windows)
    if args.without is not None:
        run = demo_model_run(args.windows, weights=args.checkpoint)
        named = {c.name: c for c in run.corruptions}
        corruption = named.get(f"without the {args.without}")
        if corruption is None:
            known = ", ".join(name.removeprefix("without the ") for name in named)
            raise CommandError(f"no series {args.without!r} to take out; the demo has {known}")
        parts = [corruption.make(window)[0] for window in range(power.shape[0])]
        corrupted = tuple(torch.cat(column) for column in zip(*parts, strict=True))
        return run.model, (power, features), corrupted, corruption.score
    start, stop = _span(args.span, power.shape[1])
    try:
        corrupted = replace_span(power, start, stop, args.fill)
    except ValueError as error:
        raise CommandError(str(error)) from error
    return model, (power, features), (corrupted, features), None


def _recording_inputs(args):
    """A model of one's own on a recording's first ``--windows`` windows, and the same
    windows without the submeter ``--without`` (aggregate minus its readings); the score
    is the predicted targets' sum."""
    from attnpanel.series import RecipeError, without_channel

    if args.without is None:
        raise CommandError("--recording needs --without NAME: the submeter to take out")
    if args.span is not None:
        raise CommandError("--span is for the demo's windows; with --recording give --without")
    shown = first_windows(recording_model(args), args.windows)
    clean, _ = shown.inputs()
    try:
        corruption = shown.without(args.without)
        corrupted, _ = shown.recipe.inputs(without_channel(shown.windows, args.without))
    except RecipeError as error:
        raise CommandError(first_line(error)) from error
    return shown.model, clean, corrupted, corruption.score


def _text_inputs(args):
    if not args.text or not args.corrupted:
        raise CommandError("--model needs --text and --corrupted (as many of each)")
    if len(args.text) != len(args.corrupted):
        raise CommandError(
            f"{len(args.text)} --text but {len(args.corrupted)} --corrupted: give one "
            "corrupted text per clean text"
        )
    model, tokenizer = hugging_face_model(Path(args.model))
    both = model_inputs(model, tokenizer, list(args.text) + list(args.corrupted))
    half = len(args.text)
    if "attention_mask" in both:  # a head is patched position by position: pairs must align
        lengths = both["attention_mask"].sum(-1).tolist()
        for i, (clean, corrupted) in enumerate(zip(lengths[:half], lengths[half:], strict=True)):
            if clean != corrupted:
                raise CommandError(
                    f"text {i + 1} is {clean} tokens, its corrupted text {corrupted}: a head "
                    "is patched position by position, so each pair must tokenize to the "
                    "same length (change a word for a word)"
                )
    clean = {k: v[:half] for k, v in both.items()}
    corrupted = {k: v[half:] for k, v in both.items()}
    return model, clean, corrupted, None


def _span(text: str | None, length: int) -> tuple[int, int]:
    if text is None:
        raise CommandError("--checkpoint needs --without NAME or --span START:STOP")
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError as error:
        raise CommandError(f"--span {text!r}: write it START:STOP, such as 200:260") from error
    if not 0 <= start < stop <= length:
        raise CommandError(f"--span {text}: not inside the {length} positions")
    return start, stop


def run(args: argparse.Namespace) -> None:
    """Patch every head (or estimate it) and save the effect (``.nc``)."""
    from attnpanel.interventions.effects import patching_effect
    from attnpanel.interventions.patching import PatchingError
    from attnpanel.traces.rankings import EFFECT, save_ranking

    recorded = wants_recording(args)
    if not recorded and (args.model is None) == (args.checkpoint is None):
        raise CommandError("give either --checkpoint or --model with --text and --corrupted")
    if not args.output.lower().endswith(".nc"):
        raise CommandError(f"an effect is saved as netCDF: {args.output} does not end in .nc")
    check_output(args.output, args.force)
    if recorded:
        model, clean, corrupted, score = _recording_inputs(args)
    elif args.checkpoint is not None:
        model, clean, corrupted, score = _demo_inputs(args)
    else:
        model, clean, corrupted, score = _text_inputs(args)
    try:
        effect = patching_effect(
            model,
            clean,
            corrupted,
            score=score,
            by=args.by,
            what=args.what,
            direction=args.direction,
            method=args.method,
        )
    except (PatchingError, RuntimeError, TypeError, ValueError) as error:
        raise CommandError(f"{type(model).__name__}: {first_line(error)}") from error
    written = save_ranking(effect, args.output, overwrite=args.force, kind=EFFECT)
    say(f"wrote {written}: {effect.sizes['layer']} layers x {effect.sizes['head']} heads")
    for line in effect_lines(effect):
        say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    patch = sub.add_parser(
        "patch",
        help="rank every head by how much of a clean-corrupted difference it carries",
        description="Patch each attention head's output (or q, k, v, weights) from one input "
        "into the run on another and save the share of the difference it restores (.nc); "
        "`attnpanel info` prints it.",
    )
    patch.add_argument(
        "--checkpoint",
        help="a NILMFormer model file (as `attnpanel train` writes), run on the demo's "
        "held-out windows; with --model SPEC, that model's weights",
    )
    patch.add_argument(
        "--windows", type=int, default=8, help="held-out (or the recording's first) windows (8)"
    )
    patch.add_argument(
        "--without",
        help="corrupted windows: the same windows without this series (the demo's own "
        "corrupted inputs, from its generator's ground truth; a recording's submeter, "
        "taken out of its mains); the score is the prediction",
    )
    patch.add_argument("--span", help="corrupted windows: positions START:STOP replaced")
    patch.add_argument("--fill", choices=("mean", "zeros"), default="mean", help="for --span")
    patch.add_argument(
        "--model",
        help="a local Hugging Face model directory with its tokenizer (offline), or "
        "FILE.py:FUNCTION / package.module:FUNCTION returning your model (with --recording)",
    )
    patch.add_argument("--text", action="append", help="a clean text; repeat for a batch")
    patch.add_argument("--corrupted", action="append", help="its corrupted text, as many")
    patch.add_argument("--what", choices=("output", "q", "k", "v", "weights"), default="output")
    patch.add_argument("--by", choices=("head", "head_position"), default="head")
    patch.add_argument("--direction", choices=("denoising", "noising"), default="denoising")
    patch.add_argument("--method", choices=("exact", "attribution"), default="exact")
    patch.add_argument("-o", "--output", required=True, help="the effect file (.nc)")
    patch.add_argument("--force", action="store_true", help="replace an existing file")
    add_recording_options(patch, shared=True)
    patch.set_defaults(func=run)

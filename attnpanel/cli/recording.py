"""The options every command that runs a model of one's own on a recording shares
(``--model``, ``--checkpoint``, ``--recording`` ...), and what they build: the model with
its weights, the windows, the recipe, as one :class:`~attnpanel.series.RecordingModel`."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, first_line, positive


def add_recording_options(parser: argparse.ArgumentParser, shared: bool = False) -> None:
    """The flags of a model of one's own on a recording (their names are the contract);
    ``shared``: the command already has ``--model`` and ``--checkpoint`` (its help says both
    meanings)."""
    group = parser.add_argument_group("your model on your recordings")
    if not shared:
        group.add_argument(
            "--model",
            metavar="SPEC",
            help="FILE.py:FUNCTION or package.module:FUNCTION returning the model",
        )
        group.add_argument(
            "--checkpoint",
            help="its weights: a state dict, or a dict holding one "
            "(model_state_dict, state_dict, model); read with weights_only=True",
        )
    group.add_argument(
        "--recording",
        help="a UK-DALE folder, a REFIT or plain CSV, a Parquet file or a NILMTK HDF5 file",
    )
    group.add_argument("--format", help="the recording's format (found from the path if left out)")
    group.add_argument("--house", action="append", help="a house to read (repeat; default all)")
    group.add_argument("--input", default="aggregate", help="the mains channel (default aggregate)")
    group.add_argument("--target", action="append", help="a channel the model predicts (repeat)")
    group.add_argument("--window", type=positive, default=480, help="steps per window (480)")
    group.add_argument("--stride", type=positive, help="steps between windows (default --window)")
    group.add_argument("--freq", default="1min", help="the step, a pandas frequency (1min)")
    group.add_argument(
        "--fill-gaps",
        type=int,
        default=0,
        help="fill gaps of up to N steps forward (default 0: skip a window with a gap)",
    )
    group.add_argument("--tz", help="the zone of a CSV's times that carry none")
    group.add_argument(
        "--from", dest="start", metavar="DATE",
        help="only windows from this date or time on (the test set: UTC unless zoned)",
    )  # fmt: skip
    group.add_argument("--to", dest="end", metavar="DATE",
                       help="only windows that end before this date or time")  # fmt: skip
    group.add_argument(
        "--recipe",
        default="nilmformer",
        help="a recipe's name (nilmformer, generic) or the JSON a recipe wrote",
    )
    group.add_argument("--scale", type=float, help="the scale the model was trained with (W)")
    group.add_argument("--clip", type=float, help="clip the mains at this many W before scaling")
    group.add_argument("--threshold", action="append", metavar="NAME=W",
                       help="a target's on-state threshold in units (repeat)")  # fmt: skip


def wants_recording(args: argparse.Namespace) -> bool:
    """Whether the command is asked about a model of one's own on a recording."""
    if getattr(args, "recording", None):
        return True
    spec = getattr(args, "model", None) or ""
    if ":" in spec and not Path(spec).is_dir():  # FILE.py:FUNCTION, package.module:FUNCTION
        raise CommandError(f"--model {spec} is a model of your own: give --recording PATH too")
    return False


def thresholds(values: list[str] | None) -> dict[str, float]:
    found = {}
    for text in values or ():
        name, _, number = text.rpartition("=")
        try:
            found[name] = float(number)
        except ValueError:
            raise CommandError(f"--threshold {text}: give NAME=W, e.g. kettle=2000") from None
        if not name:
            raise CommandError(f"--threshold {text}: give NAME=W, e.g. kettle=2000")
    return found


def recording_model(args: argparse.Namespace):
    """The :class:`~attnpanel.series.RecordingModel` the options name; every failure a
    :class:`CommandError` of one line."""
    from attnpanel import series

    for flag in ("model", "recording"):
        if not getattr(args, flag):
            raise CommandError(f"--{flag} is needed with a model of your own")
    if not args.target:
        raise CommandError("name what the model predicts: --target NAME")
    try:
        model = series.make_model(args.model)
        if args.checkpoint:
            series.load_checkpoint(model, args.checkpoint)
        options = {"tz": args.tz} if args.tz else {}
        if args.input != "aggregate":
            options["input"] = args.input
        recordings = series.read_recordings(
            args.recording, format=args.format, houses=args.house, **options
        )
        windows = series.windows_of(
            recordings, length=args.window, stride=args.stride, freq=args.freq,
            channels=_channels(recordings, args.target), fill=args.fill_gaps,
        )  # fmt: skip
        if args.start or args.end:
            windows = series.by_date(windows, _date("--from", args.start), _date("--to", args.end))
        recipe = _recipe(args)
        return series.RecordingModel(model, recipe, windows, thresholds(args.threshold))
    except (series.ModelError, series.RecordingError, series.RecipeError) as error:
        raise CommandError(first_line(error)) from error


def first_windows(run_model, count: int):
    """The same model and recipe on the first ``count`` windows (all, where fewer)."""
    return run_model.subset(slice(0, min(count, run_model.windows.sizes["window"])))


def _date(flag: str, text: str | None):
    """A date or time a flag gives, or a one-line refusal naming the flag."""
    import pandas as pd

    if text is None:
        return None
    try:
        return pd.Timestamp(text)
    except ValueError:
        raise CommandError(f"{flag} {text}: not a date or time (such as 2014-06-01)") from None


def _channels(recordings, targets: list[str]) -> list[str]:
    """The targets first, then every other submeter every house has (for "without")."""
    common = None
    for recording in recordings:
        names = [n for n in recording.names if n != recording.input]
        common = names if common is None else [n for n in common if n in names]
    missing = [t for t in targets if t not in (common or [])]
    if missing:
        from attnpanel.series import RecordingError

        raise RecordingError(
            f"no channel {', '.join(map(repr, missing))} in every house; there are "
            f"{', '.join(common or []) or 'none'}"
        )
    return list(dict.fromkeys([*targets, *(common or [])]))


def _recipe(args: argparse.Namespace):
    from attnpanel import series

    options = {"targets": list(args.target)}
    if args.scale is not None:
        options["scale"] = args.scale
    if args.clip is not None:
        options["clip"] = args.clip
    if args.recipe.endswith(".json") or Path(args.recipe).is_file():
        return series.read_recipe(args.recipe, **options)  # the flags over the file's own
    return series.make_recipe(args.recipe, **options)

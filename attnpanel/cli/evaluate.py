"""``attnpanel evaluate``: a model of one's own on a recording's windows, every metric
researchers report, written as a table (``.csv``) or a Dataset (``.nc``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, first_line, say
from attnpanel.cli.recording import add_recording_options, recording_model
from attnpanel.util.files import check_target, write_safely

METRICS_FILES = (".csv", ".nc")


def run(args: argparse.Namespace) -> None:
    out = Path(args.output)
    if out.suffix.lower() not in METRICS_FILES:
        raise CommandError(f"-o {out}: metrics are written as .csv or .nc, not {out.suffix!r}")
    kind = "csv" if out.suffix.lower() == ".csv" else "netcdf"
    _checked(out, kind, args.force)
    run_model = recording_model(args)
    table = run_model.evaluate()

    def write(partial: Path) -> None:
        if kind == "csv":
            table.to_csv(partial, index=False)
        else:
            indexed = table.set_index(["target", "house", "window", "scope", "metric"])
            indexed.to_xarray().to_netcdf(partial, engine="h5netcdf")

    write_safely(out, kind, write, overwrite=args.force)  # never a half-written file
    windows = run_model.windows
    overall = table[(table["house"] == "all") & (table["scope"] == "set")]
    say(
        f"{windows.sizes['window']} windows of {windows.attrs['length']} x "
        f"{windows.attrs['freq']} from {len(set(windows['house'].values))} house(s) "
        f"({windows.attrs['skipped']} skipped for gaps) -> {out}"
    )
    for _, row in overall[overall["metric"].isin(["MAE", "NDE", "F1", "TECA"])].iterrows():
        say(f"  {row['target']}: {row['metric']} {row['value']:.4g}")


def _checked(out: Path, kind: str, overwrite: bool) -> None:
    """Refused before the model runs: an existing file without --force, another kind's."""
    try:
        check_target(out, kind, overwrite)
    except OSError as error:
        raise CommandError(first_line(error)) from error


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    evaluate = sub.add_parser(
        "evaluate", help="a model of your own on a recording: the metrics researchers report"
    )
    add_recording_options(evaluate)
    evaluate.add_argument("-o", "--output", required=True, help="metrics.csv or metrics.nc")
    evaluate.add_argument("--force", action="store_true", help="overwrite -o")
    evaluate.set_defaults(func=run)

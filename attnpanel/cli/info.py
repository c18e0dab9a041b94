"""``attnpanel info``: the shape table and what each head attends to; a head ranking
(``attnpanel importance``) most important first; a survey (``attnpanel survey``), a
comparison report (``attnpanel compare -o report.nc``), circuits (``attnpanel circuits``)
or a score attribution (``attnpanel why``) summarised."""

from __future__ import annotations

import argparse

from attnpanel.cli.common import CommandError, check_sample, load_trace, say


def _heading(layer) -> str:
    return f"== layer {layer.name}" + (f" (group {layer.group})" if layer.group else "")


def _summary_lines(path: str) -> list[str] | None:
    """A survey store's or a comparison report's summary; None for anything else."""
    from pathlib import Path

    import xarray as xr

    from attnpanel.cli.compare import divergence_lines
    from attnpanel.cli.survey import survey_lines
    from attnpanel.surveys.store import FORMAT, SurveyStore, SurveyStoreError
    from attnpanel.traces import screening

    target = Path(path)
    if target.suffix.lower() == ".zarr" and target.is_dir():
        store = SurveyStore(target)
        try:
            attrs = store.attrs()
        except SurveyStoreError:
            return None
        if attrs is None or attrs.get("format") != FORMAT:
            return None
        try:
            return survey_lines(store.read())
        except (SurveyStoreError, ValueError) as error:
            raise CommandError(str(error)) from error
    if target.suffix.lower() == ".nc" and target.is_file():
        found = _circuits(target) or _why(target)
        if found is not None:
            return found
        try:
            screening.refuse_unsafe_storage(target, "netcdf")
            with xr.open_dataset(target, engine="h5netcdf") as ds:
                if not {"js", "max_abs"} <= set(ds.data_vars):
                    return None
                comparison = ds.load()
        except Exception:  # not a report: the trace reader words what is wrong
            return None
        return divergence_lines(comparison)
    return None


def _circuits(target) -> list[str] | None:
    """The summary of a saved ``attnpanel circuits`` result; None for another file."""
    from attnpanel.cli.circuits import circuit_lines
    from attnpanel.readouts.circuits import load_circuits

    try:
        found = load_circuits(target)
    except Exception:  # not circuits: the other readers word what is wrong
        return None
    return None if found is None else circuit_lines(found)


def _why(target) -> list[str] | None:
    """The summary of a saved ``attnpanel why`` attribution; None for another file."""
    import xarray as xr

    from attnpanel.cli.why import why_lines
    from attnpanel.traces import screening

    try:
        screening.refuse_unsafe_storage(target, "netcdf")
        with xr.open_dataset(target, engine="h5netcdf") as ds:
            if "score_attribution" not in ds.data_vars:
                return None
            found = ds["score_attribution"].load()
    except Exception:  # not an attribution: the other readers word what is wrong
        return None
    return why_lines(found)


def run(args: argparse.Namespace) -> None:
    """Print the shape table and per-head summary of every layer of a saved trace."""
    from attnpanel.cli.importance import ranking_lines
    from attnpanel.cli.patch import effect_lines
    from attnpanel.readouts.summary import describe
    from attnpanel.traces.layers import layers, select
    from attnpanel.traces.rankings import EFFECT, load_ranking

    try:
        ranking = load_ranking(args.trace)
    except (ValueError, FileNotFoundError):
        ranking = None  # not a ranking: a trace, or an error load_trace words
    if ranking is not None:
        for line in ranking_lines(ranking):
            say(line)
        return
    try:
        effect = load_ranking(args.trace, EFFECT)
    except (ValueError, FileNotFoundError):
        effect = None
    if effect is not None:
        for line in effect_lines(effect):
            say(line)
        return
    summary = _summary_lines(args.trace)
    if summary is not None:
        for line in summary:
            say(line)
        return
    capture = load_trace(args.trace)
    check_sample(capture, args.sample)
    every = layers(capture)
    for index, layer in enumerate(every):
        if len(every) > 1 or layer.name:
            say(_heading(layer))
        one = select(capture, index)
        say(describe(one, batch=args.sample, positions=args.positions))


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    info = sub.add_parser("info", help="print the shape table and what each head attends to")
    info.add_argument(
        "trace",
        help="a saved trace (.nc or .zarr), a head ranking (attnpanel importance), a "
        "patching effect (attnpanel patch), a survey store (attnpanel survey, with the "
        "heads' roles) or a comparison report (attnpanel compare -o report.nc)",
    )
    info.add_argument("--sample", type=int, default=0, help="which sample to summarise")
    info.add_argument(
        "--positions",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="list, per position, the key each head attends to most (default: up to 64 positions)",
    )
    info.set_defaults(func=run)

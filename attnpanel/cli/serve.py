"""``attnpanel serve``: the explorer on a saved trace, or on the demo."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from attnpanel.cli.common import (
    CommandError,
    first_line,
    load_trace,
    port,
    positive,
    procs,
    say,
    stored_overviews,
)
from attnpanel.cli.recording import (
    add_recording_options,
    first_windows,
    recording_model,
    wants_recording,
)


def served_capture(args: argparse.Namespace) -> tuple:
    """``(path or None, capture, explorer options)`` of what ``serve`` is asked to show: a
    saved trace, the long demo, a NILMFormer checkpoint (its trace and its model at hand) or
    the demo (with its model)."""
    from attnpanel.nilm.demo import demo, demo_model_run

    if wants_recording(args):
        return None, *recording_page(args)
    given = [name for name in ("trace", "demo", "checkpoint") if getattr(args, name, None)]
    if len(given) > 1:
        raise CommandError(
            f"give one of a trace, --demo or --checkpoint, not {' and '.join(given)}"
        )
    if args.demo == "long":
        from attnpanel.nilm.demo import stored_long_demo

        path = stored_long_demo(days=args.days, folder=args.cache, progress=say)
        return path, load_trace(str(path)), {}
    if args.trace:
        return args.trace, load_trace(args.trace), {}
    weights = args.checkpoint
    if weights is not None and not Path(weights).exists():
        raise CommandError(f"no checkpoint at {weights}")
    try:
        capture = demo(weights=weights, on_demand=True)  # as apps/main.py: no map held
        model = demo_model_run(weights=weights)  # head toggles re-run the model
    except (ValueError, RuntimeError, KeyError, OSError) as error:
        raise CommandError(
            f"cannot read {weights} as a NILMFormer model: {first_line(error)}"
        ) from error
    return None, capture, {"model": model}


def recording_page(args: argparse.Namespace) -> tuple:
    """``(capture, explorer options)`` of a model of one's own on a recording: the trace of
    the first ``--windows`` windows (every attention, the times in the house's zone,
    the named tokens named, the reference series in units) and the model at hand."""
    run_model = recording_model(args)
    shown = first_windows(run_model, args.windows)
    say(f"tracing {shown.windows.sizes['window']} windows of {run_model.windows.sizes['window']}")
    try:
        capture = shown.trace()
    except ValueError as error:  # CaptureError: a model whose attention cannot be traced
        raise CommandError(f"--model {args.model}: {first_line(error)}") from error
    layers = [str(n) for n in capture["layer"].values] if "layer" in capture.coords else []
    return capture, {"model": shown.model_run(layers)}


def compared_page(args: argparse.Namespace, capture):
    """``--compare B``: the comparison page's builder, B loaded and the heads' divergence
    computed once for every session."""
    from attnpanel.app import serving
    from attnpanel.app.compare_explorer import CompareExplorer, compared_capture
    from attnpanel.readouts.compare import compare

    try:
        first = compared_capture(capture, args.trace)
        second = compared_capture(load_trace(args.compare), args.compare)
        numbers = compare(first, second)
    except ValueError as error:
        raise CommandError(f"{args.trace} and {args.compare}: {first_line(error)}") from error
    serving.settle(serving.freeze(second))
    page = partial(
        CompareExplorer.built, first, compare=second, comparison=numbers[["js", "max_abs", "rows"]]
    )
    return partial(serving.built_ahead, "serve", page)


def run(args: argparse.Namespace) -> None:
    """Serve the explorer on a saved trace (a Dataset or a DataTree of groups), or the demo;
    with ``--compare``, the comparison page of two traces."""
    import panel as pn
    import xarray as xr

    from attnpanel.app import serving
    from attnpanel.app.explore import explore
    from attnpanel.app.explorer import AttentionExplorer, notify_errors
    from attnpanel.traces import virtual

    compared = getattr(args, "compare", None)
    if compared and not args.trace:
        raise CommandError("--compare B compares a saved trace A with B: serve A.nc --compare B.nc")
    path, capture, options = served_capture(args)
    capture = virtual.densified(capture)  # a short virtual trace: its maps once, for every session
    if path is not None and isinstance(capture, xr.Dataset):
        # a virtual trace's overviews, stored beside it, read once and shared by every session
        overviews = stored_overviews(capture, path)
        if overviews is not None:
            options["overviews"] = overviews
    serving.settle(serving.freeze(capture))  # loaded once, read by every session, written by none

    if compared:
        build = compared_page(args, capture)
    elif isinstance(capture, xr.Dataset) and not virtual.is_virtual(capture):
        # built while the server is idle (the explorers of a virtual trace or of groups
        # draw their maps on worker threads of their own)
        explorer = partial(AttentionExplorer.built, capture, **options)
        build = partial(serving.built_ahead, "serve", explorer)
    else:
        build = partial(explore, capture, **options)

    def session():
        serving.release_memory()
        return build()  # returned, not also .servable(): one explorer per page

    pn.extension(inline=True, notifications=True, exception_handler=notify_errors)
    serving.skip_document_validation()  # the page is validated once, by the tests
    if args.num_procs != 1:
        # forked after the trace is loaded: the workers share its pages until one writes
        serving.workers_die_with_parent()
    pn.serve(
        {"attnpanel": session},
        port=args.port,
        address=args.address,
        show=False,
        title="attnpanel",
        num_procs=args.num_procs,
        # one page built before the server listens (as ``panel serve --warm``): the first
        # visitor's page is not the one that compiles the kernels and opens the stores,
        # and the explorer built ahead for it is started then. Not before forking workers:
        # a thread building ahead does not survive the fork, and its explorer would never come
        warm=args.num_procs == 1,
    )


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    serve = sub.add_parser("serve", help="serve the explorer on a trace (or the demo)")
    serve.add_argument("trace", nargs="?", help="a saved trace (.nc or .zarr); default: the demo")
    serve.add_argument("--port", type=port, default=5006, help="port, 1-65535 (default 5006)")
    serve.add_argument("--address", default="localhost", help="address to bind (default localhost)")
    serve.add_argument(
        "--num-procs",
        type=procs,
        default=1,
        help="worker processes on the one port (0: one per core; default 1); they stop "
        "with the server",
    )
    serve.add_argument(
        "--compare",
        metavar="B",
        help="a second trace of the same inputs (another checkpoint, another dtype): the "
        "comparison page, A, B and B - A of each head and the heads ranked by divergence",
    )
    serve.add_argument(
        "--demo",
        choices=("short", "long"),
        help="short: 32 windows of 8 hours (the default without a trace); long: one "
        "household over --days days at one minute (L = 64,800 at 45), a virtual trace built "
        "once (about 4 minutes on 2 cores) and stored with its overviews in --cache",
    )
    serve.add_argument(
        "--days", type=positive, default=45, help="days of the long demo (default 45)"
    )
    serve.add_argument(
        "--checkpoint",
        help="a NILMFormer model file (as `attnpanel train` writes): its layer on the demo's "
        "held-out windows, with the model at hand (head toggles re-run it); with --model "
        "SPEC, that model's weights",
    )
    serve.add_argument(
        "--model",
        metavar="SPEC",
        help="FILE.py:FUNCTION or package.module:FUNCTION returning your model: the page "
        "of it on --recording's windows",
    )
    serve.add_argument(
        "--cache",
        default=None,
        help="folder of the stored long demo (default $ATTNPANEL_CACHE or ~/.cache/attnpanel)",
    )
    serve.add_argument(
        "--windows",
        type=positive,
        default=8,
        help="with --recording: the windows the page shows, the first of the houses read "
        "(default 8)",
    )
    add_recording_options(serve, shared=True)
    serve.set_defaults(func=run)

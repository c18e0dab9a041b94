"""The ``attnpanel`` command line: serve, export, info, trace and train.

Every subcommand has ``--help``. Bad input (a missing file, wrong dims, a corrupted trace,
a layer or sample the trace does not have) prints one line ``attnpanel: error: ...`` and
exits with status 2, never a traceback. A reader that closes the output early
(``attnpanel info t.nc | head -1``) ends the command quietly, with status 0. Also run as
``python -m attnpanel``.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

EXIT_BAD_INPUT = 2


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _say(text: str, file=None) -> None:
    """Print a line that may hold a trace's or a model's strings, safe for a terminal."""
    from attnpanel.util.untrusted import terminal

    print(terminal(text), file=file or sys.stdout)


def _first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message, for a one-line report."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0].rstrip(":") if lines else type(error).__name__


def _load_trace(path: str):
    from attnpanel.traces.io import load

    try:
        return load(path)
    except (FileNotFoundError, ValueError) as error:
        raise CommandError(str(error).splitlines()[0]) from error


def _check_sample(capture, sample: int) -> None:
    from attnpanel.traces.layers import groups

    for group, ds in groups(capture).items():
        n = ds.sizes["batch"]
        if not 0 <= sample < n:
            where = f" (group {group})" if group else ""
            raise CommandError(
                f"--sample {sample} is out of range: the trace{where} has {n} "
                f"sample{'s' if n != 1 else ''}, 0 to {n - 1}"
            )


def _heading(layer) -> str:
    return f"== layer {layer.name}" + (f" (group {layer.group})" if layer.group else "")


def cmd_info(args: argparse.Namespace) -> None:
    """Print the shape table and per-head summary of every layer of a saved trace."""
    from attnpanel.readouts.summary import describe
    from attnpanel.traces.layers import layers, select

    capture = _load_trace(args.trace)
    _check_sample(capture, args.sample)
    every = layers(capture)
    for index, layer in enumerate(every):
        if len(every) > 1 or layer.name:
            _say(_heading(layer))
        one = select(capture, index)
        _say(describe(one, batch=args.sample, positions=args.positions))


def _overviews_folder(path: str | Path, group: str = "") -> Path:
    """Where the overviews of one group of the trace file ``path`` are stored (a Dataset
    is the one group ``""``): ``TRACE.overviews``, one subfolder per named group."""
    from attnpanel.traces.overviews import folder_for

    name = group.strip("/")
    return folder_for(path) / name if name else folder_for(path)


def _stored_overviews(capture, path: str | Path, group: str = ""):
    """The overviews of one group of a virtual trace file: those stored beside it, read
    once (and new ones stored there); None for a dense trace. The Overviews holds the
    whole group, stacked layers included (an entry names its layer)."""
    from attnpanel.traces.layers import groups
    from attnpanel.traces.overviews import Overviews
    from attnpanel.traces.virtual import is_virtual

    ds = groups(capture)[group]
    return Overviews(ds, _overviews_folder(path, group)) if is_virtual(ds) else None


def cmd_overviews(args: argparse.Namespace) -> None:
    """Build the overview levels of every map of a saved trace and store them beside it."""
    import time

    from attnpanel.traces.layers import groups
    from attnpanel.traces.overviews import Overviews

    capture = _load_trace(args.trace)
    folder = _overviews_folder(args.trace)
    start = time.perf_counter()
    built = total = 0
    for group, ds in groups(capture).items():
        if "q" not in ds or "k" not in ds:
            raise CommandError(
                f"the trace{f' (group {group})' if group else ''} holds no q and k, from "
                "which overviews are computed"
            )
        masks = args.masks or [ds.attrs.get("mask", "none")]
        if ds.attrs.get("attention") == "cross" and set(masks) - {"none"}:
            raise CommandError("a cross-attention trace has overviews only under --masks none")
        store = Overviews(ds, _overviews_folder(args.trace, group))
        entries = store.entries(masks=masks, pixels=tuple(args.pixels))
        total += len(entries)
        built += len(
            store.build(entries, scheduler=args.scheduler, workers=args.workers, progress=True)
        )
    _say(
        f"{built} overview{'s' if built != 1 else ''} built, {total - built} already stored, "
        f"in {time.perf_counter() - start:.1f} s: {folder}"
    )


def _read_array(path: Path):
    import numpy as np
    import torch

    if not path.exists():
        raise CommandError(f"no input file at {path}")
    if path.suffix == ".npy":
        try:
            return torch.from_numpy(np.load(path, allow_pickle=False))
        except ValueError as error:
            raise CommandError(f"cannot read {path} as a numpy array: {error}") from error
    if path.suffix == ".pt":
        try:
            value = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as error:
            raise CommandError(f"cannot read {path} as a tensor file: {error}") from error
        if not isinstance(value, torch.Tensor):
            raise CommandError(f"{path} holds a {type(value).__name__}, not a tensor")
        return value
    raise CommandError(f"unknown input format {path.suffix!r}: use .npy or .pt")


def _read_layer(path: Path, n_heads: int | None, mask: str | None):
    import torch

    from attnpanel.kernels.attention import MultiHeadSelfAttention

    if not path.exists():
        raise CommandError(f"no checkpoint at {path}")
    try:
        checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        raise CommandError(f"cannot read {path} as a weights-only checkpoint: {error}") from error
    if not isinstance(checkpoint, dict):
        raise CommandError(f"{path} holds a {type(checkpoint).__name__}, not a state dict")
    config = dict(checkpoint.get("config", {}))
    state = checkpoint.get("state_dict", checkpoint)
    if "wq.weight" not in state:
        keys = ", ".join(list(state)[:6])
        raise CommandError(
            f"{path} has no 'wq.weight' (keys: {keys}); "
            "expected a MultiHeadSelfAttention state dict"
        )
    config.setdefault("d_model", state["wq.weight"].shape[1])
    config["bias"] = "wq.bias" in state
    if n_heads is not None:
        config["n_heads"] = n_heads
    if "n_heads" not in config:
        raise CommandError(f"{path} does not record n_heads: pass --heads")
    if mask is not None:
        config["mask"] = mask
    try:
        layer = MultiHeadSelfAttention(**config)
        layer.load_state_dict(state)
    except (ValueError, RuntimeError, TypeError) as error:
        raise CommandError(
            f"cannot build the layer from {path}: {str(error).splitlines()[0]}"
        ) from error
    return layer


def _model_inputs(model, tokenizer, texts: list[str]) -> dict:
    """The tokenized texts as the keyword inputs ``model.forward`` takes.

    A batch of several texts is padded on the right. An encoder-decoder model also gets
    the same token ids (and padding mask) as its decoder input.
    """
    import inspect

    if len(texts) > 1 and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "right"  # no fully masked query row under a causal mask
    try:
        encoded = dict(tokenizer(texts, return_tensors="pt", padding=len(texts) > 1))
    except (ValueError, TypeError) as error:
        raise CommandError(f"cannot tokenize the text: {_first_line(error)}") from error
    parameters = inspect.signature(model.forward).parameters
    named = {
        name
        for name, p in parameters.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    if "input_ids" not in named:
        raise CommandError(
            f"{type(model).__name__} takes no input_ids: --text works for text models only"
        )
    inputs = {key: value for key, value in encoded.items() if key in named}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"]
        if "attention_mask" in inputs and "decoder_attention_mask" in named:
            inputs["decoder_attention_mask"] = inputs["attention_mask"]
    return inputs


def _trace_hugging_face(model_dir: Path, texts: list[str]):
    """Capture every attention computation of a local Hugging Face model on some texts."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory, never the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    from attnpanel.capturing.capture import capture

    if not model_dir.is_dir():
        raise CommandError(f"no model directory at {model_dir}")
    try:
        model = AutoModel.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CommandError(
            f"cannot load a Hugging Face model from {model_dir}: {_first_line(error)}"
        ) from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CommandError(
            f"cannot load a tokenizer from {model_dir} (--text needs one saved beside the "
            f"model): {_first_line(error)}"
        ) from error
    inputs = _model_inputs(model, tokenizer, texts)
    try:
        return capture(model, **inputs, tokens=tokenizer)
    except ValueError as error:  # CaptureError included
        raise CommandError(_first_line(error)) from error
    except (RuntimeError, TypeError, IndexError) as error:
        raise CommandError(
            f"{type(model).__name__} failed on the text: {_first_line(error)}"
        ) from error


def _written(capture) -> list[str]:
    """What a saved capture holds: its shape, or each group's layer count and shape."""
    import xarray as xr

    from attnpanel.traces.layers import groups

    if isinstance(capture, xr.Dataset):
        return [str(dict(capture["weights"].sizes))]
    found = groups(capture)
    lines = [f"{len(found)} groups"]
    for group, ds in found.items():
        count = ds.sizes.get("layer", 1)
        sizes = {d: n for d, n in ds["weights"].sizes.items() if d != "layer"}
        lines.append(f"  {group}: {count} layer{'s' if count != 1 else ''} {sizes}")
    return lines


def cmd_trace(args: argparse.Namespace) -> None:
    """Compute a trace (a layer checkpoint on an input array, or a model on a text) and save it."""
    from tqdm import tqdm

    from attnpanel.traces.build import trace
    from attnpanel.traces.io import save

    if (args.model is None) == (args.checkpoint is None):
        raise CommandError("give either --checkpoint and --input, or --model and --text")
    _check_output(args.output, args.force)  # refused before minutes of work, not after
    with tqdm(total=2, desc="trace", unit="step", disable=None) as progress:
        if args.model is not None:
            if not args.text:
                raise CommandError("--model needs --text")
            capture = _trace_hugging_face(Path(args.model), args.text)
        else:
            if args.input is None:
                raise CommandError("--checkpoint needs --input")
            layer = _read_layer(Path(args.checkpoint), args.heads, args.mask)
            x = _read_array(Path(args.input))
            if x.dim() == 2:
                x = x[None]
            try:
                capture = trace(layer, x, source=f"{args.checkpoint} on {args.input}")
            except ValueError as error:
                raise CommandError(str(error).splitlines()[0]) from error
        progress.update()
        try:
            written = save(capture, args.output, overwrite=args.force)
        except (ValueError, OSError) as error:
            raise CommandError(_first_line(error)) from error
        progress.update()
    lines = _written(capture)
    _say(f"wrote {written}: {lines[0]}")
    for line in lines[1:]:
        _say(line)


def _check_output(path: str, overwrite: bool) -> None:
    from attnpanel.traces.io import FORMATS
    from attnpanel.util.files import check_target

    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise CommandError(
            f"-o {path}: a trace is written as .nc or .zarr, not {suffix or 'no suffix'!r}"
        )
    try:
        check_target(path, FORMATS[suffix], overwrite)
    except OSError as error:
        raise CommandError(_first_line(error)) from error


def _port(text: str) -> int:
    """A TCP port number from the command line, refused by argparse when out of range."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: ports are 1-65535")
    return port


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve the explorer on a saved trace (a Dataset or a DataTree of groups), or the demo."""
    import panel as pn
    import xarray as xr

    from attnpanel.app import serving
    from attnpanel.app.explore import explore
    from attnpanel.app.explorer import AttentionExplorer, notify_errors
    from attnpanel.traces import virtual

    options = {}
    if args.trace and args.demo:
        raise CommandError("give a trace or --demo, not both")
    if args.demo == "long":
        from attnpanel.nilm.demo import stored_long_demo

        path = stored_long_demo(days=args.days, folder=args.cache, progress=_say)
        capture = _load_trace(str(path))
    elif args.trace:
        path = args.trace
        capture = _load_trace(path)
    else:
        from attnpanel.nilm.demo import demo

        path, capture = None, demo()
    if path is not None and isinstance(capture, xr.Dataset):
        # a virtual trace's overviews, stored beside it, read once and shared by every session
        overviews = _stored_overviews(capture, path)
        if overviews is not None:
            options["overviews"] = overviews
    serving.settle(serving.freeze(capture))  # loaded once, read by every session, written by none

    if isinstance(capture, xr.Dataset) and not virtual.is_virtual(capture):
        # built while the server is idle (the explorers of a virtual trace or of groups
        # draw their maps on worker threads of their own)
        explorer = partial(AttentionExplorer.built, capture, **options)
        build = partial(serving.built_ahead, "serve", explorer)
    else:
        build = partial(explore, capture, **options)

    def session():
        serving.release_on_close()
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
    )


def _whole(text: str, minimum: int, what: str, hint: str) -> int:
    """An integer option of at least ``minimum``, or a usage error naming it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value}: give {hint}")
    return value


def _procs(text: str) -> int:
    """A ``--num-procs`` value: 0 (one per core) or more."""
    return _whole(text, 0, "number of processes", "0 (one per core) or more")


def _positive(text: str) -> int:
    """A count of at least 1 (workers, pixels)."""
    return _whole(text, 1, "whole number", "1 or more")


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


def cmd_export(args: argparse.Namespace) -> None:
    """Write a standalone, offline HTML file of one layer and one sample of a trace."""
    from attnpanel.render.export import export_html
    from attnpanel.traces.layers import groups, layers, select

    capture = _load_trace(args.trace)
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
    title = "attnpanel" + (f" · {source.splitlines()[0][:80]}" if source.strip() else "")
    shown = f"layer {entry.name}" if entry.name else f"layer {index}"
    if entry.group:
        shown += f" (group {entry.group})"
    # a virtual trace is drawn from its overviews, read from (and stored in) TRACE.overviews
    overviews = _stored_overviews(capture, args.trace, entry.group)
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
        raise CommandError(_first_line(error)) from error
    _say(f"wrote {path}: {shown}, sample {args.sample}")


def cmd_train(args: argparse.Namespace) -> None:
    """Train the demo model on synthetic household power."""
    from attnpanel.nilm import nilmformer

    nilmformer.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``attnpanel``."""
    parser = argparse.ArgumentParser(
        prog="attnpanel", description="Explore multi-head self-attention at full resolution."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the explorer on a trace (or the demo)")
    serve.add_argument("trace", nargs="?", help="a saved trace (.nc or .zarr); default: the demo")
    serve.add_argument("--port", type=_port, default=5006, help="port, 1-65535 (default 5006)")
    serve.add_argument("--address", default="localhost", help="address to bind (default localhost)")
    serve.add_argument(
        "--num-procs",
        type=_procs,
        default=1,
        help="worker processes on the one port (0: one per core; default 1); they stop "
        "with the server",
    )
    serve.add_argument(
        "--demo",
        choices=("short", "long"),
        help="short: 32 windows of 8 hours (the default without a trace); long: one "
        "household over --days days at one minute (L = 64,800 at 45), a virtual trace built "
        "once (about 4 minutes on 2 cores) and stored with its overviews in --cache",
    )
    serve.add_argument(
        "--days", type=_positive, default=45, help="days of the long demo (default 45)"
    )
    serve.add_argument(
        "--cache",
        default=None,
        help="folder of the stored long demo (default $ATTNPANEL_CACHE or ~/.cache/attnpanel)",
    )
    serve.set_defaults(func=cmd_serve)

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
    export.set_defaults(func=cmd_export)

    info = sub.add_parser("info", help="print the shape table and what each head attends to")
    info.add_argument("trace", help="a saved trace (.nc or .zarr)")
    info.add_argument("--sample", type=int, default=0, help="which sample to summarise")
    info.add_argument(
        "--positions",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="list, per position, the key each head attends to most (default: up to 64 positions)",
    )
    info.set_defaults(func=cmd_info)

    trace = sub.add_parser(
        "trace",
        help="compute a trace: a layer checkpoint on an input, or a model on a text",
        description="Compute a trace and save it (.nc or .zarr). A Hugging Face model whose "
        "attention has several kinds or shapes (an encoder-decoder such as BART or T5) is "
        "saved as one group per kind, a DataTree.",
    )
    trace.add_argument("--checkpoint", help="MultiHeadSelfAttention state dict (.pt)")
    trace.add_argument("--input", help="input array (batch, length, d_model): .npy or .pt")
    trace.add_argument(
        "--model",
        help="a local Hugging Face model directory with its tokenizer (instead of --checkpoint); "
        "read offline, never from the hub",
    )
    trace.add_argument(
        "--text",
        action="append",
        help="the text to run the Hugging Face model on; repeat for a batch (padded on the "
        "right). An encoder-decoder model (config.is_encoder_decoder) gets the same token ids "
        "as decoder_input_ids",
    )
    trace.add_argument(
        "-o", "--output", required=True, help="where to save the trace (.nc or .zarr)"
    )
    trace.add_argument("--force", action="store_true", help="replace an existing trace at --output")
    trace.add_argument("--heads", type=int, help="number of heads, if the checkpoint lacks it")
    trace.add_argument("--mask", choices=["none", "diagonal", "causal"], help="override the mask")
    trace.set_defaults(func=cmd_trace)

    overviews = sub.add_parser(
        "overviews",
        help="build the overview levels of every map of a trace (for long sequences)",
        description="Reduce every (sample, layer, head, mask) map of a trace to display "
        "resolution (per-pixel max, mean and blocked share) on dask.distributed and store "
        "them in zarr beside the trace (TRACE.overviews), so that the explorer paints a long "
        "trace at once. Maps already stored are skipped; an interrupted build keeps what "
        "it finished.",
    )
    overviews.add_argument("trace", help="a saved trace (.nc or .zarr)")
    overviews.add_argument(
        "--masks",
        nargs="+",
        choices=["none", "diagonal", "causal"],
        help="the mask modes to build (default: the trace's own)",
    )
    overviews.add_argument(
        "--pixels",
        type=_positive,
        nargs=2,
        default=[480, 480],
        metavar=("ROWS", "COLS"),
        help="the overview's size (default 480 480)",
    )
    overviews.add_argument(
        "--scheduler", help="the address of a running dask scheduler (default: a LocalCluster)"
    )
    overviews.add_argument(
        "--workers", type=_positive, default=2, help="LocalCluster worker processes (default 2)"
    )
    overviews.set_defaults(func=cmd_overviews)

    train = sub.add_parser(
        "train", help="train the demo model (see attnpanel train --help)", add_help=False
    )
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.rest = extra  # the trainer parses its own options, --help included
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    except CommandError as error:
        _say(f"attnpanel: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # one line for the user; ATTNPANEL_DEBUG=1 shows the traceback
        if os.environ.get("ATTNPANEL_DEBUG"):
            raise
        _say(f"attnpanel: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _closed_pipe() -> int:
    """The reader of stdout went away (``attnpanel info t.nc | head -1``): end quietly.

    stdout is pointed at /dev/null so that the interpreter's final flush of what is left in
    its buffer does not fail again (see the Python docs on SIGPIPE).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (a test's capture)
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

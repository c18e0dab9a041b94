"""The ``attnpanel`` command line: serve, export, info, trace and train.

Every subcommand has ``--help``. Bad input (a missing file, wrong dims, a corrupted trace)
prints one line ``attnpanel: error: ...`` and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _load_trace(path: str):
    from attnpanel.io import load

    try:
        return load(path)
    except (FileNotFoundError, ValueError) as error:
        raise CommandError(str(error).splitlines()[0]) from error


def cmd_info(args: argparse.Namespace) -> None:
    """Print the shape table and per-head summary of a saved trace."""
    from attnpanel.summary import describe

    ds = _load_trace(args.trace)
    if not 0 <= args.sample < ds.sizes["batch"]:
        raise CommandError(
            f"--sample {args.sample} is out of range: the trace has {ds.sizes['batch']} samples"
        )
    layers = ds["layer"].values if "layer" in ds.dims else [None]
    for layer in layers:
        one = ds if layer is None else ds.sel(layer=layer)
        if layer is not None:
            print(f"== layer {layer}")
        print(describe(one, batch=args.sample, positions=args.positions))


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

    from attnpanel.attention import MultiHeadSelfAttention

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


def _trace_hugging_face(model_dir: Path, text: str):
    """Capture every attention layer of a local Hugging Face model on one text."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory, never the hub
    from transformers import AutoModel, AutoTokenizer

    from attnpanel.capture import capture

    if not model_dir.is_dir():
        raise CommandError(f"no model directory at {model_dir}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModel.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise CommandError(
            f"cannot load a Hugging Face model from {model_dir}: {str(error).splitlines()[0]}"
        ) from error
    encoded = tokenizer(text, return_tensors="pt")
    return capture(model, **encoded, tokens=tokenizer)


def cmd_trace(args: argparse.Namespace) -> None:
    """Compute a trace (a layer checkpoint on an input array, or a model on a text) and save it."""
    from tqdm import tqdm

    from attnpanel.io import save
    from attnpanel.trace import trace

    if (args.model is None) == (args.checkpoint is None):
        raise CommandError("give either --checkpoint and --input, or --model and --text")
    with tqdm(total=2, desc="trace", unit="step", disable=None) as progress:
        if args.model is not None:
            if args.text is None:
                raise CommandError("--model needs --text")
            ds = _trace_hugging_face(Path(args.model), args.text)
        else:
            if args.input is None:
                raise CommandError("--checkpoint needs --input")
            layer = _read_layer(Path(args.checkpoint), args.heads, args.mask)
            x = _read_array(Path(args.input))
            if x.dim() == 2:
                x = x[None]
            try:
                ds = trace(layer, x, source=f"{args.checkpoint} on {args.input}")
            except ValueError as error:
                raise CommandError(str(error).splitlines()[0]) from error
        progress.update()
        if isinstance(ds, list):
            raise CommandError(
                "the model's layers differ in shape: save them one by one from Python"
            )
        try:
            written = save(ds, args.output)
        except ValueError as error:
            raise CommandError(str(error).splitlines()[0]) from error
        progress.update()
    print(f"wrote {written}: {dict(ds['weights'].sizes)}")


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve the explorer on a saved trace, or on the demo."""
    import panel as pn

    from attnpanel.explorer import AttentionExplorer

    if args.trace:
        ds = _load_trace(args.trace)
    else:
        from attnpanel.demo import demo

        ds = demo()
    pn.extension(inline=True, notifications=True)
    pn.serve(
        {"attnpanel": lambda: AttentionExplorer(ds).servable()},
        port=args.port,
        address=args.address,
        show=False,
        title="attnpanel",
    )


def cmd_export(args: argparse.Namespace) -> None:
    """Write a standalone, offline HTML file of the explorer on a trace."""
    from attnpanel.explorer import AttentionExplorer

    ds = _load_trace(args.trace)
    explorer = AttentionExplorer(ds)
    if not hasattr(explorer, "save"):
        raise CommandError("this version of attnpanel cannot export HTML yet")
    path = explorer.save(args.output)
    print(f"wrote {path}")


def cmd_train(args: argparse.Namespace) -> None:
    """Train the demo model on synthetic household power."""
    from attnpanel import nilmformer

    nilmformer.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``attnpanel``."""
    parser = argparse.ArgumentParser(
        prog="attnpanel", description="Explore multi-head self-attention at full resolution."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the explorer on a trace (or the demo)")
    serve.add_argument("trace", nargs="?", help="a saved trace (.nc or .zarr); default: the demo")
    serve.add_argument("--port", type=int, default=5006, help="port (default 5006)")
    serve.add_argument("--address", default="localhost", help="address to bind (default localhost)")
    serve.set_defaults(func=cmd_serve)

    export = sub.add_parser("export", help="write a standalone offline HTML file")
    export.add_argument("trace", help="a saved trace (.nc or .zarr)")
    export.add_argument("-o", "--output", required=True, help="the HTML file to write")
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
        "trace", help="compute a trace: a layer checkpoint on an input, or a model on a text"
    )
    trace.add_argument("--checkpoint", help="MultiHeadSelfAttention state dict (.pt)")
    trace.add_argument("--input", help="input array (batch, length, d_model): .npy or .pt")
    trace.add_argument(
        "--model", help="a local Hugging Face model directory (instead of --checkpoint)"
    )
    trace.add_argument("--text", help="the text to run the Hugging Face model on")
    trace.add_argument(
        "-o", "--output", required=True, help="where to save the trace (.nc or .zarr)"
    )
    trace.add_argument("--heads", type=int, help="number of heads, if the checkpoint lacks it")
    trace.add_argument("--mask", choices=["none", "diagonal", "causal"], help="override the mask")
    trace.set_defaults(func=cmd_trace)

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
    except CommandError as error:
        print(f"attnpanel: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # one line for the user; ATTNPANEL_DEBUG=1 shows the traceback
        if os.environ.get("ATTNPANEL_DEBUG"):
            raise
        print(f"attnpanel: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

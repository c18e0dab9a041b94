"""``attnpanel trace``: a trace from a layer checkpoint on an input, or from a local
Hugging Face model on a text."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, check_output, first_line, say
from attnpanel.cli.models import hugging_face_model, model_inputs


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


def _trace_hugging_face(model_dir: Path, texts: list[str]):
    """Capture every attention computation of a local Hugging Face model on some texts."""
    from attnpanel.capturing.capture import capture

    model, tokenizer = hugging_face_model(model_dir)
    inputs = model_inputs(model, tokenizer, texts)
    try:
        return capture(model, **inputs, tokens=tokenizer)
    except ValueError as error:  # CaptureError included
        raise CommandError(first_line(error)) from error
    except (RuntimeError, TypeError, IndexError) as error:
        raise CommandError(
            f"{type(model).__name__} failed on the text: {first_line(error)}"
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


def _demo(args: argparse.Namespace):
    """The served demo's trace, as a file: each row's log-sum-exp instead of its maps
    (every map recomputed exactly on opening) unless ``--dense``."""
    from attnpanel.nilm.demo import demo

    if args.windows < 1:
        raise CommandError(f"--windows {args.windows}: at least one window")
    try:
        return demo(layer=args.layer, n_windows=args.windows, dense=args.dense)
    except ValueError as error:
        raise CommandError(first_line(error)) from error


def run(args: argparse.Namespace) -> None:
    """Compute a trace (a layer checkpoint on an input array, or a model on a text) and save it."""
    from tqdm import tqdm

    from attnpanel.traces.build import trace
    from attnpanel.traces.io import save

    sources = [args.model is not None, args.checkpoint is not None, args.demo]
    if sum(sources) != 1:
        raise CommandError("give one of --checkpoint and --input, --model and --text, or --demo")
    check_output(args.output, args.force)  # refused before minutes of work, not after
    with tqdm(total=2, desc="trace", unit="step", disable=None) as progress:
        if args.demo:
            capture = _demo(args)
        elif args.model is not None:
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
            raise CommandError(first_line(error)) from error
        progress.update()
    lines = _written(capture)
    say(f"wrote {written}: {lines[0]}")
    for line in lines[1:]:
        say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    trace = sub.add_parser(
        "trace",
        help="compute a trace: a layer checkpoint on an input, a model on a text, or the demo",
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
    trace.add_argument(
        "--demo",
        action="store_true",
        help="the served demo's trace (the trained NILMFormer on held-out windows), to share "
        "or open offline: q, k, v and each row's log-sum-exp, every map recomputed exactly "
        "on opening (1.1 MB a window)",
    )
    trace.add_argument("--windows", type=int, default=32, help="--demo: windows of 480 steps")
    trace.add_argument("--layer", type=int, default=2, help="--demo: the encoder layer (0-2)")
    trace.add_argument(
        "--dense",
        action="store_true",
        help="--demo: keep every map as well (scores and weights: 15 MB a window)",
    )
    trace.set_defaults(func=run)

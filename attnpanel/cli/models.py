"""The user's own models for the commands that run one: a local Hugging Face model with its
tokenizer (read offline, never from the hub), and the texts as its inputs."""

from __future__ import annotations

import os
from pathlib import Path

from attnpanel.cli.common import CommandError, first_line


def hugging_face_model(model_dir: Path):
    """``(model, tokenizer)`` from a local Hugging Face model directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory, never the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    if not model_dir.is_dir():
        raise CommandError(f"no model directory at {model_dir}")
    try:
        model = AutoModel.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CommandError(
            f"cannot load a Hugging Face model from {model_dir}: {first_line(error)}"
        ) from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CommandError(
            f"cannot load a tokenizer from {model_dir} (--text needs one saved beside the "
            f"model): {first_line(error)}"
        ) from error
    return model, tokenizer


def model_inputs(model, tokenizer, texts: list[str]) -> dict:
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
        raise CommandError(f"cannot tokenize the text: {first_line(error)}") from error
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


def checkpoint_run(path: Path, windows: int):
    """A NILMFormer model file on the demo's held-out windows: (model, inputs)."""
    import torch

    from attnpanel.nilm.demo import demo_windows
    from attnpanel.nilm.nilmformer import load_model, time_features

    if not path.exists():
        raise CommandError(f"no checkpoint at {path}")
    try:
        model = load_model(path)
    except (ValueError, RuntimeError, KeyError, OSError) as error:
        raise CommandError(
            f"cannot read {path} as a NILMFormer model: {first_line(error)}"
        ) from error
    held = demo_windows(windows)
    aggregate = torch.from_numpy(held["aggregate"].values)
    return model, (aggregate, time_features(held["time"].values)), {}


def hugging_face_run(model_dir: Path, texts: list[str]):
    model, tokenizer = hugging_face_model(model_dir)
    return model, (), model_inputs(model, tokenizer, texts)

"""A served page of PatchTST (a Hugging Face model built from its config, offline) on a
series with its clock: its positions are a CLS token and spans of steps, laid out from the
config. ``panel serve tests/patchtst_app.py``."""

from __future__ import annotations

import pandas as pd
import panel as pn
import torch

import attnpanel

LENGTH = 70
STAMPS = pd.date_range("2024-01-01 00:00", periods=LENGTH, freq="1min")


def patchtst():
    """PatchTST with 16-step patches every 8 steps and a CLS token, seeded, eager attention
    (its own weights come back with ``output_attentions``)."""
    from transformers import PatchTSTConfig, PatchTSTModel

    config = PatchTSTConfig(
        num_input_channels=2, context_length=LENGTH, patch_length=16, patch_stride=8,
        d_model=16, num_attention_heads=2, num_hidden_layers=2, ffn_dim=32,
        use_cls_token=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = PatchTSTModel(config).eval()
    values = torch.sin(torch.arange(2 * LENGTH * 2, dtype=torch.float32) / 5).reshape(2, LENGTH, 2)
    return model, values


if __name__.startswith("bokeh"):
    model, values = patchtst()
    trace = attnpanel.capture(model, past_values=values, time=STAMPS)
    pn.extension(inline=True)
    attnpanel.explore(trace).servable()

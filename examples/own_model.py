"""Explore the attention of a model of your own in a few lines.

Demonstrates :func:`attnpanel.capture` on a small PyTorch forecaster built from
``nn.TransformerEncoderLayer``: its ``nn.MultiheadAttention`` layers are found by
themselves, and each comes back with per-head weights (not the head average the module
returns), q, k and v recovered from ``in_proj_weight``, and its causal mask recognised.

Highlights: ``capture(model, inputs)`` -> one Dataset with a ``layer`` dim ->
``attnpanel.save`` -> the explorer. Run::

    python examples/own_model.py own_model_trace.nc           # capture and save (fast)
    python examples/own_model.py own_model_trace.nc --serve   # ... then explore it

``--serve`` opens the explorer on every captured layer (a ``Layer`` selector, the model
view of all layers and heads, the sinusoidal encoding the model adds). In a notebook:
``attnpanel.AttentionExplorer(attnpanel.load("own_model_trace.nc"))``. A Hugging Face model
works the same way: ``capture(model, **tokenizer(text, return_tensors="pt"),
tokens=tokenizer)``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import attnpanel

LENGTH = 48  # time steps per sample


class Forecaster(nn.Module):
    """A univariate series -> linear embedding + sinusoidal positions -> 2 causal layers."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, length: int = LENGTH):
        super().__init__()
        self.embed = nn.Linear(1, d_model)
        encoding = attnpanel.sinusoidal_encoding(length, d_model).values
        self.register_buffer("position", torch.from_numpy(encoding))  # (L, D)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, series: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(series[..., None]) + self.position  # (B, L, D)
        hidden = self.encoder(hidden, mask=self.causal, is_causal=True)  # (B, L, D)
        return self.head(hidden).squeeze(-1)  # (B, L)


def explore(traces):
    """The explorer on every captured layer (imports panel only when asked)."""
    return attnpanel.AttentionExplorer(traces, head="mean", mask="causal")


def main(path: str = "own_model_trace.nc", serve: bool = False, port: int = 5006):
    """Capture the forecaster's attention, save its last layer; serve the explorer if asked."""
    torch.manual_seed(0)
    model = Forecaster()
    steps = torch.linspace(0, 12, LENGTH)
    series = torch.stack([torch.sin(steps), torch.cos(steps)])  # (B=2, L)

    traces = attnpanel.capture(model, series)
    # The explorer shows the encoding at start when the trace says the model adds it.
    traces.attrs["positional_encoding"] = "sinusoidal"
    print(traces)
    last = traces.sel(layer="encoder.layers.1.self_attn")
    attnpanel.save(last, path)
    print(f"saved layer {last['layer'].item()} ({last.attrs['mask']} mask) to {path}")
    if serve:
        import panel as pn

        # one explorer object; every further page gets an explorer of its own
        pn.serve(explore(traces), title="attnpanel · own model", show=False, port=port)
    return traces


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="own_model_trace.nc", help="trace file")
    parser.add_argument("--serve", action="store_true", help="serve the explorer on it")
    parser.add_argument("--port", type=int, default=5006, help="port to serve on (5006)")
    args = parser.parse_args()
    main(args.path, serve=args.serve, port=args.port)

"""Views of text and multi-layer traces, the positional encoding and the head average.

Pure functions ``(trace, selection) -> HoloViews element`` (or the array a rasterized view
draws), like :mod:`attnpanel.render.views`, for what issue 5 adds to the explorer:

- a token strip, the top view of a trace with a ``token`` coordinate: one box per token,
  shaded by the weight the selected query gives it, the selected token outlined;
- tick labels of the attention matrix by token;
- the token each position attends to most, for the selected head;
- the model view: every layer x head map of a multi-layer trace tiled into one image
  (one datashaded raster instead of ``layers x heads`` figures);
- the sinusoidal positional encoding (position x dimension) and the head average of the
  weights (what ``torch.nn.MultiheadAttention`` returns by default).

A multi-layer trace is read one layer at a time by the views of :mod:`attnpanel.render.views`;
:func:`at_layer` picks it. Only the model view reads every layer.
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import xarray as xr

from attnpanel.readouts.core import (
    MAP_TITLE_LINE,
    Selection,
    StageCache,
    attention_values,
    drawn_masked,
    head_words,
    mask_mode,
    selected_weights,
    uses_sinusoidal,
    wrapped_title,
)
from attnpanel.readouts.model_map import model_mosaic, position_labels, tokens
from attnpanel.readouts.positional import head_average, sinusoidal_encoding
from attnpanel.readouts.raster import raster_values
from attnpanel.render.styling import shade
from attnpanel.render.views import FAST_DATATYPE

MAX_TICKS = 64  # more token labels than this on an axis overlap; every n-th is shown


def token_ticks(ds: xr.Dataset, sample: int = 0) -> dict[int, str]:
    """Tick labels of the matrix axes, position -> token (every n-th for long texts).

    Repeated tokens keep their position (``"the·5"`` is not needed: ticks sit at the
    position). Empty for a trace without tokens.
    """
    found = tokens(ds, sample)
    if found is None:
        return {}
    step = max(1, int(np.ceil(len(found) / MAX_TICKS)))
    return {i: found[i] for i in range(0, len(found), step)}


def token_boxes(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """One box per token, shaded by the selected query's weight on it (group ``Tokens``).

    Returns an ``hv.Rectangles`` over positions ``i - 0.48 .. i + 0.48`` (so a click at x
    rounds to the position) with value dimensions ``weight``, ``token`` and ``color``
    (white to dark red relative to the row's largest weight).
    """
    weights = np.asarray(selected_weights(ds, sel, cache), dtype=np.float32)
    labels = position_labels(ds, sel.sample)
    n = len(labels)
    index = np.arange(n, dtype=np.float32)
    head = head_words(sel.head)
    return hv.Rectangles(
        (
            index - 0.48,
            np.zeros(n, np.float32),
            index + 0.48,
            np.ones(n, np.float32),
            np.nan_to_num(weights),
            np.array(labels, dtype=object),
            np.array(shade(weights)),
        ),
        kdims=["x0", "y0", "x1", "y1"],
        vdims=["weight", "token", "color"],
        group="Tokens",
        label=f"sample {sel.sample}: tokens, shaded by the weight of query {sel.query} "
        f"'{labels[sel.query]}' ({head}); click a token to pick the query",
        datatype=FAST_DATATYPE,
    )


def token_labels(ds: xr.Dataset, sel: Selection) -> hv.Labels:
    """The token texts at the centres of the token boxes (group ``Tokens``)."""
    labels = position_labels(ds, sel.sample)
    n = len(labels)
    return hv.Labels(
        (
            np.arange(n, dtype=np.float32),
            np.full(n, 0.5, np.float32),
            np.array(labels, dtype=object),
        ),
        ["x", "y"],
        ["token"],
        group="Tokens",
    )


def selected_token(ds: xr.Dataset, sel: Selection) -> hv.Rectangles:
    """The outline of the selected query's token box (group ``Selected``)."""
    q = float(sel.query)
    return hv.Rectangles(
        ([q - 0.5], [-0.08], [q + 0.5], [1.08]), group="Selected", datatype=FAST_DATATYPE
    )


def top_attended(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> hv.Table:
    """Per position, the token it attends to most and that weight, for the selected head.

    Columns ``position``, ``token``, ``attends most to`` (``"token (position)"``) and
    ``weight``; ``head="mean"`` uses the mean of the enabled heads.
    """
    matrix = np.nan_to_num(attention_values(ds, sel.with_(stage="softmax"), cache))  # (L, S)
    labels = position_labels(ds, sel.sample)
    best = np.argmax(matrix, axis=1)
    rows = np.arange(matrix.shape[0])
    head = head_words(sel.head)
    columns = {
        "position": rows,
        "token": np.array(labels, dtype=object),
        "attends most to": np.array([f"{labels[k]} ({k})" for k in best], dtype=object),
        "weight": np.round(matrix[rows, best].astype(np.float64), 4),
    }
    return hv.Table(
        columns,
        kdims=["position"],
        vdims=["token", "attends most to", "weight"],
        group="TopAttended",
        label=f"most-attended token per position ({head})",
    )


def model_view(ds: xr.Dataset, sel: Selection, width: int = 1200, height: int = 600):
    """The model view: :func:`model_mosaic` rasterized by datashader into an ``hv.Image``.

    x is the head, y the layer (group ``ModelView``); each small map has keys across and
    queries down.
    """
    mosaic = model_mosaic(ds, sel)
    n_layers, n_heads = mosaic.attrs["n_layers"], mosaic.attrs["n_heads"]
    bounds = (-0.5, -0.5, n_heads - 0.5, n_layers - 0.5)
    # The mosaic's rows ascend with y: layer 0 query 0 first. The plot inverts y (layer 0 on
    # top), so each map reads as the large matrix does, query 0 on top, with no flip.
    raster, bounds = raster_values(mosaic.values, bounds, width, height)
    return hv.Image(
        raster[::-1],
        bounds=bounds,
        kdims=["head", "layer"],
        vdims=[hv.Dimension("weight")],
        group="ModelView",
        label=wrapped_title(
            f"model view, sample {sel.sample}: {n_layers} layers x {n_heads} heads (click a "
            "map to open it above)",
            line=max(MAP_TITLE_LINE, width // TITLE_PIXELS_PER_CHARACTER),
        ),
    )


TITLE_PIXELS_PER_CHARACTER = 8  # Bokeh's bold 12 pt title, a character on average


def role_labels(roles, n_layers: int, n_heads: int) -> hv.Labels:
    """Each map's role (:func:`attnpanel.readouts.roles.trace_roles`) written along its top
    edge in the model view (group ``Roles``); none for a trace without weights."""
    xs, ys, texts = [], [], []
    if roles is not None:
        for layer in range(n_layers):
            for head in range(n_heads):
                xs.append(head)
                ys.append(layer - 0.36)  # y runs down the page: the map's top edge
                texts.append(str(roles["role"].values[layer, head]))
    return hv.Labels((xs, ys, texts), kdims=["head", "layer"], vdims=["role"], group="Roles")


def copying_labels(copying, n_layers: int, n_heads: int) -> hv.Labels:
    """Each map's OV copying score (:func:`attnpanel.readouts.circuits.ov_copying`) written
    along its bottom edge in the model view (group ``Copying``); none without weights."""
    xs, ys, texts = [], [], []
    if copying is not None:
        for layer in range(n_layers):
            for head in range(n_heads):
                xs.append(head)
                ys.append(layer + 0.36)  # y runs down the page: the map's bottom edge
                texts.append(f"OV copy {float(copying.values[layer, head]):.2f}")
    return hv.Labels((xs, ys, texts), kdims=["head", "layer"], vdims=["copying"], group="Copying")


def model_view_marker(layer: int, head: int | str, n_heads: int) -> hv.Rectangles:
    """The outline of the selected (layer, head) map in the model view (group ``Selected``).

    ``head="mean"`` outlines the whole layer.
    """
    if head == "mean":
        return hv.Rectangles(
            ([-0.5], [layer - 0.5], [n_heads - 0.5], [layer + 0.5]), group="Selected"
        )
    return hv.Rectangles(
        ([head - 0.5], [layer - 0.5], [head + 0.5], [layer + 0.5]), group="Selected"
    )


def mosaic_cell(x: float, y: float, n_layers: int, n_heads: int) -> tuple[int, int]:
    """The (layer, head) of the model-view map at a clicked point."""
    head = int(np.clip(round(float(x)), 0, n_heads - 1))
    layer = int(np.clip(round(float(y)), 0, n_layers - 1))
    return layer, head


def model_width(ds: xr.Dataset) -> int:
    """``d_model`` of a trace: its attribute, else the width of ``x``, else heads x head_dim."""
    if "d_model" in ds.attrs:
        return int(ds.attrs["d_model"])
    if "feature" in ds.sizes:
        return int(ds.sizes["feature"])
    return int(ds.sizes["head"] * ds.attrs.get("head_dim", 1))


def positional_encoding(ds: xr.Dataset) -> hv.Image:
    """The sinusoidal encoding for the trace's length and ``d_model``, position x dimension
    (:func:`positional_note` says whether the model uses it)."""
    encoding = sinusoidal_encoding(int(ds.sizes["query"]), model_width(ds))
    length, width = encoding.shape
    return hv.Image(
        encoding.values[::-1],
        bounds=(-0.5, -0.5, width - 0.5, length - 0.5),
        kdims=["dimension", "position"],
        vdims=[hv.Dimension("encoding", range=(-1, 1))],
        group="Positional",
        label=f"sinusoidal positional encoding ({length} x {width})",
    )


def positional_note(ds: xr.Dataset) -> str:
    """Whether the trace declares the sinusoidal encoding (``attrs["positional_encoding"]``)
    or it is only what a model of this size would add."""
    if uses_sinusoidal(ds):
        return "Used by this model."
    return "What a model of this size would add: this trace declares no positional encoding."


def head_average_values(
    ds: xr.Dataset, sel: Selection, cache: StageCache | None = None
) -> np.ndarray:
    """The mean over all heads of the softmax weights, ``(query, key)`` float32.

    With the trace's own mask this is :func:`attnpanel.head_average` of its weights (what
    ``nn.MultiheadAttention`` returns by default); with another mask, the mean of the
    recomputed weights. Blocked cells are NaN, as in the matrix.
    """
    if mask_mode(ds, sel) == ds.attrs.get("mask", "none"):
        # one sample first: the mean over the whole batch would hold 32 x 480 x 480 temporaries
        one = ds["weights"].isel(batch=sel.sample)
        values = np.array(head_average(one).values, dtype=np.float32)
        mask = ds.attrs.get("mask", "none")
        if mask != "none" or "sample_mask" in ds or "padding" in ds:
            blocked = drawn_masked(ds, mask, sel.sample, "mean")
            if blocked is not None:
                values[blocked] = np.nan
        return values
    return attention_values(ds, sel.with_(head="mean", stage="softmax", enabled_heads=None), cache)

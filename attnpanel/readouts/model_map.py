"""Data a model view draws, without drawing it: each position's label (its token, where the
trace holds text) and every layer x head map of a sample tiled into one array. Read by the
page (:mod:`attnpanel.render.model_views`) and by the figures
(:mod:`attnpanel.render.paper`), which import no plotting library of the page."""

from __future__ import annotations

import numpy as np
import xarray as xr

from attnpanel.readouts.core import Selection


def tokens(ds: xr.Dataset, sample: int = 0) -> list[str] | None:
    """The token text of each position of a sample, or None for a trace without tokens."""
    if "token" not in ds.coords:
        return None
    token = ds["token"]
    if "batch" in token.dims:
        token = token.isel(batch=sample)
    return [str(t) for t in token.values]


def position_labels(ds: xr.Dataset, sample: int = 0) -> list[str]:
    """A label per position: its token for text, else its integer position."""
    found = tokens(ds, sample)
    return found if found is not None else [str(i) for i in range(ds.sizes["query"])]


def model_mosaic(ds: xr.Dataset, sel: Selection, gap: float = 0.12) -> xr.DataArray:
    """Every layer x head softmax map of one sample tiled into one array (the model view).

    Layer ``l``, head ``h`` occupies the cell ``[h - 0.5, h + 0.5] x [l - 0.5, l + 0.5]``
    of the returned grid, less a ``gap`` (a fraction of the cell) of NaN between cells, so
    a position in the grid rounds to its (head, layer). The trace's captured ``weights``
    are used (the model view shows the model as it ran).

    Returns
    -------
    xarray.DataArray
        ``(row, col)`` float32 with coordinates in head (x) and layer (y) units, rows by
        ascending layer; attrs ``n_layers``, ``n_heads``.
    """
    weights = ds["weights"].isel(batch=sel.sample)
    if "layer" not in weights.dims:
        weights = weights.expand_dims(layer=1)
    weights = weights.transpose("layer", "head", "query", "key")
    n_layers, n_heads, length, n_keys = weights.shape
    pad_q = max(1, int(round(gap * length)))
    pad_k = max(1, int(round(gap * n_keys)))
    rows, cols = length + pad_q, n_keys + pad_k
    grid = np.full((n_layers * rows, n_heads * cols), np.nan, dtype=np.float32)
    values = np.asarray(weights.values, dtype=np.float32)
    for layer in range(n_layers):
        for head in range(n_heads):
            top, left = layer * rows + pad_q // 2, head * cols + pad_k // 2
            grid[top : top + length, left : left + n_keys] = values[layer, head]
    y = -0.5 + (np.arange(grid.shape[0]) + 0.5) / rows
    x = -0.5 + (np.arange(grid.shape[1]) + 0.5) / cols
    return xr.DataArray(
        grid,
        dims=("row", "col"),
        coords={"row": y, "col": x},
        name="weights",
        attrs={"n_layers": n_layers, "n_heads": n_heads},
    )

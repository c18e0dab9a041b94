"""A survey (:func:`attnpanel.survey`) drawn: one statistic of one layer, every head's
distribution over the samples.

Per head: a box from the 25th to the 75th percentile, its median, whiskers from the 5th
to the 95th percentile, and every sample as a point (jittered across the head's column,
the same jitter for a sample in every head); past :data:`DENSE_POINTS` points, their
density as a datashaded image instead. The shown sample is a larger point in each head.
"""

from __future__ import annotations

import datashader as ds
import holoviews as hv
import numpy as np
import pandas as pd
import xarray as xr

DENSE_POINTS = 4000  # more points than this are drawn as their density
BOX_HALF = 0.3  # a head's box spans head - 0.3 to head + 0.3
JITTER = 0.22  # the points spread over head - 0.22 to head + 0.22
DENSITY_SIZE = (400, 200)  # the density image's cells (x, y)

LABELS = {
    "entropy": "entropy (nats)",
    "distance": "distance (steps)",
    "distance_time": "distance (s)",
    "sink": "weight on the first key",
    "token_share": "weight on named tokens",
    "diagonal_share": "weight on its own position",
    "previous_share": "weight on the previous position",
    "max_weight": "largest weight of a row",
    "previous_token": "previous-token score",
    "duplicate_token": "duplicate-token score",
    "induction": "induction score",
    "offset": "offset of the heaviest diagonal (steps)",
    "offset_weight": "share of weight on the heaviest diagonal",
}


def label(statistic: str) -> str:
    """A statistic's axis label (``vw_`` forms: "value-weighted ...")."""
    if statistic.startswith("vw_"):
        return "value-weighted " + LABELS.get(statistic[3:], statistic[3:])
    return LABELS.get(statistic, statistic)


def jitter(samples: int) -> np.ndarray:
    """Each sample's offset across its head's column, fixed (golden-ratio spacing)."""
    return ((np.arange(samples) * 0.6180339887) % 1.0 - 0.5) * 2 * JITTER


def distribution(values: xr.DataArray, sample: int | None = None) -> hv.Overlay:
    """``values`` ``(sample, head)`` as boxes, whiskers, medians and points per head.

    Layers (labels for their styles): ``whiskers``, ``boxes``, ``medians``, ``samples``
    (a Scatter, or a ``density`` Image past :data:`DENSE_POINTS`), ``shown`` (the shown
    sample in every head).
    """
    data = np.asarray(values.transpose("sample", "head").values, dtype=np.float64)
    samples, heads = data.shape
    centre = np.arange(heads, dtype=np.float64)
    q05, q25, q50, q75, q95 = np.nanpercentile(data, [5, 25, 50, 75, 95], axis=0)
    y = hv.Dimension("value", label=label(str(values.name)))
    x = hv.Dimension("head")
    corners = [hv.Dimension("x0", label="head"), hv.Dimension("y0", label=y.label), "x1", "y1"]
    whiskers = hv.Rectangles(
        (centre - 0.015, q05, centre + 0.015, q95),
        kdims=corners,
        group="Whiskers",
        label="whiskers",
    )
    boxes = hv.Rectangles(
        (centre - BOX_HALF, q25, centre + BOX_HALF, q75),
        kdims=corners,
        group="Boxes",
        label="boxes",
    )
    span = float(np.nanmax(q95) - np.nanmin(q05)) if np.isfinite(q95).any() else 1.0
    thick = max(span, 1e-12) * 0.004
    medians = hv.Rectangles(
        (centre - BOX_HALF, q50 - thick, centre + BOX_HALF, q50 + thick),
        kdims=corners,
        group="Medians",
        label="medians",
    )
    xs = (centre[None, :] + jitter(samples)[:, None]).ravel()
    ys = data.ravel()
    ids = np.repeat(np.arange(samples), heads)  # each point's sample, for the hover
    layers = [whiskers, boxes, medians]
    points = [x], [y, hv.Dimension("sample")]
    if samples * heads > DENSE_POINTS:
        # their density, and each head's extremes as points (they also set the value axis)
        layers.append(density(xs, ys, heads, y))
        filled = np.isfinite(data).any(axis=0)
        low = np.where(filled, np.nanargmin(np.where(np.isfinite(data), data, np.inf), axis=0), 0)
        high = np.where(filled, np.nanargmax(np.where(np.isfinite(data), data, -np.inf), axis=0), 0)
        picked = np.concatenate([low, high])
        ends = (np.tile(centre, 2), data[picked, np.tile(np.arange(heads), 2)], picked)
        layers.append(hv.Scatter(ends, *points, group="Samples", label="samples"))
    else:
        layers.append(hv.Scatter((xs, ys, ids), *points, group="Samples", label="samples"))
    if sample is not None and 0 <= sample < samples:
        shown = (centre + jitter(samples)[sample], data[sample], np.full(heads, sample))
        layers.append(hv.Scatter(shown, *points, group="Shown", label="shown"))
    return hv.Overlay(layers)


def density(xs: np.ndarray, ys: np.ndarray, heads: int, value="value") -> hv.Image:
    """Points as their count per cell, aggregated by datashader."""
    real = np.isfinite(ys)
    low, high = (float(np.min(ys[real])), float(np.max(ys[real]))) if real.any() else (0.0, 1.0)
    high = high if high > low else low + 1.0
    width, height = DENSITY_SIZE
    canvas = ds.Canvas(
        plot_width=width, plot_height=height, x_range=(-0.5, heads - 0.5), y_range=(low, high)
    )
    counts = canvas.points(pd.DataFrame({"x": xs[real], "y": ys[real]}), "x", "y")
    image = np.asarray(counts.values, dtype=np.float64)
    image[image == 0] = np.nan  # empty cells stay transparent
    return hv.Image(
        image[::-1],
        bounds=(-0.5, low, heads - 0.5, high),
        kdims=["head", value],
        vdims=["samples"],
        group="Density",
        label="density",
    )


def nearest_sample(values: xr.DataArray, x: float, y: float) -> int | None:
    """The sample whose point in the column of head ``round(x)`` lies nearest ``(x, y)``
    on screen scale (the value axis normalised by its spread); None off every column."""
    data = np.asarray(values.transpose("sample", "head").values, dtype=np.float64)
    samples, heads = data.shape
    head = int(round(x))
    if not 0 <= head < heads or abs(x - head) > 0.5 or not np.isfinite(data[:, head]).any():
        return None
    spread = np.nanmax(data) - np.nanmin(data)
    spread = spread if spread > 0 else 1.0
    dx = (head + jitter(samples) - x) / (2 * JITTER)
    dy = (data[:, head] - y) / spread * 4  # the value axis: a head's column is ~1/4 as wide
    distance = np.where(np.isfinite(dy), dx**2 + dy**2, np.inf)
    return int(np.argmin(distance))

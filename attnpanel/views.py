"""Views of a trace: pure functions ``(trace, selection) -> HoloViews element``.

Every function here reads an ``xarray.Dataset`` trace (see ``attnpanel.trace``) and a
:class:`Selection` and returns one HoloViews element, with no widgets and no state beyond an
optional :class:`StageCache`, so each view can be tested on its own and composed by
``attnpanel.explorer.AttentionExplorer`` (or, later, exported to static HTML).

A view that needs a variable the trace lacks raises :class:`MissingVariable`, naming it; the
explorer shows that message in the view's place.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import datashader as dsh
import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401  (registers the backend that .opts below needs)
import numpy as np
import pandas as pd
import xarray as xr
from bokeh.models import BasicTickFormatter

from attnpanel import summary
from attnpanel.palette import HEAD_COLORS, head_color  # noqa: F401 - views.HEAD_COLORS
from attnpanel.trace import STAGES, attention_stage, masked_cells

STAGE_LABELS = {
    "raw": "raw scores q·k",
    "scaled": "scaled scores q·k / √E",
    "masked": "masked scores",
    "softmax": "softmax weights",
}
HIGHLIGHT = "#39ff14"
APPLIANCE_COLORS = ("#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#7f7f7f")
TOP_KEYS = 5
# Columns as a plain dict: building an element this way takes ~1.5 ms instead of ~8 ms
# through pandas, and the explorer builds a dozen per selection change.
FAST_DATATYPE = ["dictionary"]


class MissingVariable(KeyError):
    """A view needs a trace variable (or coordinate) that this trace does not hold."""

    def __init__(self, names, view: str = "this view"):
        self.names = tuple([names] if isinstance(names, str) else names)
        self.view = view
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """One sentence naming what is missing, for display in the view's place."""
        joined = ", ".join(f"`{n}`" for n in self.names)
        return f"The {self.view} needs {joined}, which this trace does not contain."

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Selection:
    """What the user is looking at.

    Parameters
    ----------
    sample : int
        Batch index (by position).
    head : int or "mean"
        Head index, or ``"mean"`` for the mean over the enabled heads.
    query : int
        Query position.
    mask : str or None
        Mask mode the weights are recomputed with; ``None`` means the trace's own.
    stage : {"raw", "scaled", "masked", "softmax"}
        Stage of the score-to-weight pipeline.
    enabled_heads : tuple of int or None
        Heads kept in the merge; ``None`` means all.
    """

    sample: int = 0
    head: int | str = 0
    query: int = 0
    mask: str | None = None
    stage: str = "softmax"
    enabled_heads: tuple[int, ...] | None = field(default=None)

    def with_(self, **changes) -> Selection:
        """A copy with some fields changed."""
        return replace(self, **changes)


def require(ds: xr.Dataset, names, view: str) -> None:
    """Raise :class:`MissingVariable` unless every name is a variable or coordinate of ds."""
    names = [names] if isinstance(names, str) else list(names)
    missing = [n for n in names if n not in ds.variables]
    if missing:
        raise MissingVariable(missing, view)


class StageCache:
    """Least-recently-used cache of the arrays the views recompute, bounded in bytes.

    Recomputing a stage from ``q`` and ``k`` takes tens of milliseconds per sample on a
    small CPU; the explorer revisits the same (sample, mask, stage) often (the stage player,
    toggling masks or heads), so results are kept as float32 up to ``max_bytes`` in all
    (8 x 480 x 480 x 4 bytes = 7.4 MB per sample and stage at the demo size).
    """

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key, compute):
        """Return the cached value of ``key``, computing it with ``compute()`` on a miss."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()
        with self._lock:
            if key not in self._items:
                self._items[key] = value
                self._bytes += getattr(value, "nbytes", 0)
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= getattr(old, "nbytes", 0)
        return value

    def __contains__(self, key) -> bool:
        return key in self._items

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._items.clear()
            self._bytes = 0


def _mask_mode(ds: xr.Dataset, sel: Selection) -> str:
    return ds.attrs.get("mask", "none") if sel.mask is None else sel.mask


def blocked_cells(
    ds: xr.Dataset, mask: str | None = None, sample: int = 0, head: int | str | None = None
) -> np.ndarray | None:
    """The ``(query, key)`` cells drawn as masked for one sample and head, or None.

    See :func:`attnpanel.trace.masked_cells`: what the mask blocks for that sample and
    head (in every head for ``head="mean"``), and padded positions.
    """
    return masked_cells(ds, mask, batch=sample, head=head if isinstance(head, int) else None)


def stage_heads(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> np.ndarray:
    """The selected stage of one sample for every head, ``(head, query, key)`` float32.

    Only the selected sample is recomputed (from ``q`` and ``k``, for the selected mask);
    the full 4-D tensor is never copied.
    """
    mask = _mask_mode(ds, sel)
    if sel.stage not in STAGES:
        raise ValueError(f"unknown stage {sel.stage!r}; expected one of {STAGES}")

    def compute():
        try:
            values = attention_stage(ds, sel.stage, mask=mask, batch=sel.sample)
        except KeyError as err:
            names = [n for n in ("q", "k") if n not in ds]
            raise MissingVariable(names or ["q", "k"], f"{sel.stage} stage") from err
        return np.asarray(values.values, dtype=np.float32)

    if cache is None:
        return compute()
    return cache.get(("stage", sel.sample, mask, sel.stage), compute)


def attention_values(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> np.ndarray:
    """The ``(query, key)`` array shown by the attention matrix, float32.

    For the masked and softmax stages, blocked cells are NaN, so they are drawn in the
    "NaN" clipping colour (black) apart from the colour scale: the ``-1e4`` fill never
    squashes the colours of the rest. ``head="mean"`` averages the enabled heads.
    """
    heads = stage_heads(ds, sel, cache)
    mask = _mask_mode(ds, sel)

    def compute():
        if sel.head == "mean":
            enabled = list(sel.enabled_heads) if sel.enabled_heads else list(range(len(heads)))
            values = heads[enabled].mean(axis=0)
        else:
            values = heads[int(sel.head)].copy()
        if sel.stage in ("masked", "softmax"):
            blocked = blocked_cells(ds, mask, sel.sample, sel.head)
            if blocked is not None:
                values[blocked] = np.nan
        return values

    if cache is None:
        return compute()
    enabled = sel.enabled_heads if sel.head == "mean" else None
    return cache.get(("matrix", sel.sample, mask, sel.stage, sel.head, enabled), compute)


def attention_matrix(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> hv.Image:
    """The full ``(query, key)`` attention matrix of the selected sample, head and stage.

    Returns an ``hv.Image`` (group ``Attention``) with key on x, query on y, the stage as its
    value dimension and blocked cells NaN (drawn black by :data:`OPTIONS`). Pass it through
    :func:`rasterized` for display.
    """
    values = attention_values(ds, sel, cache)
    length, n_keys = values.shape
    # hv.Image takes rows top-down; flipped so row i lies at query = i.
    return hv.Image(
        values[::-1],
        bounds=(-0.5, -0.5, n_keys - 0.5, length - 0.5),
        kdims=["key", "query"],
        vdims=[hv.Dimension("value", label=STAGE_LABELS[sel.stage])],
        group="Attention",
        label=matrix_title(ds, sel),
    )


def raster_values(
    values: np.ndarray, bounds, width: int, height: int, x_range=None, y_range=None
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Regrid a cell-centred grid to at most ``width x height`` pixels with datashader.

    Every cell of the full array contributes (``mean`` when several cells share a pixel);
    the grid is never finer than the data over the range, so nothing is invented.

    Parameters
    ----------
    values : numpy.ndarray
        ``(rows, cols)`` with rows by ascending y.
    bounds : tuple of float
        ``(left, bottom, right, top)`` of the grid.
    width, height : int
        Pixel size of the plot frame.
    x_range, y_range : tuple of float, optional
        The visible window; defaults to the whole grid.

    Returns
    -------
    raster : numpy.ndarray
        float32, rows by ascending y.
    bounds : tuple of float
        ``(left, bottom, right, top)`` of the raster.
    """
    n_rows, n_cols = values.shape
    x0, y0, x1, y1 = bounds
    x_range = (x0, x1) if x_range is None else tuple(sorted(x_range))
    y_range = (y0, y1) if y_range is None else tuple(sorted(y_range))
    cell_x, cell_y = (x1 - x0) / n_cols, (y1 - y0) / n_rows
    grid = xr.DataArray(
        values,
        coords={
            "y": y0 + cell_y * (0.5 + np.arange(n_rows)),
            "x": x0 + cell_x * (0.5 + np.arange(n_cols)),
        },
        dims=("y", "x"),
    )
    cols = max(1, min(int(width), int(np.ceil((x_range[1] - x_range[0]) / cell_x))))
    rows = max(1, min(int(height), int(np.ceil((y_range[1] - y_range[0]) / cell_y))))
    window = (x_range[0], y_range[0], x_range[1], y_range[1])
    if n_rows == 1 or n_cols == 1:
        # datashader infers a grid's cell size from its coordinates, which one row or
        # column does not give (a one-position trace); every pixel then shows its cell.
        return _nearest_cells(values, bounds, window, rows, cols), window
    canvas = dsh.Canvas(plot_width=cols, plot_height=rows, x_range=x_range, y_range=y_range)
    raster = canvas.raster(grid, agg="mean")
    return np.asarray(raster.values, dtype=np.float32), window


def _nearest_cells(values: np.ndarray, bounds, window, rows: int, cols: int) -> np.ndarray:
    """``rows x cols`` pixels over ``window``, each the grid cell under its centre (NaN off it)."""
    x0, y0, x1, y1 = bounds
    left, bottom, right, top = window

    def cells(low, high, start, stop, count, pixels):
        centres = low + (high - low) * (np.arange(pixels) + 0.5) / pixels
        index = np.floor((centres - start) / ((stop - start) / count)).astype(np.int64)
        return index, (index >= 0) & (index < count)

    row, row_in = cells(bottom, top, y0, y1, values.shape[0], rows)
    col, col_in = cells(left, right, x0, x1, values.shape[1], cols)
    out = np.full((rows, cols), np.nan, dtype=np.float32)
    out[np.ix_(row_in, col_in)] = values[np.ix_(row[row_in], col[col_in])]
    return out


COLOR_TOP_PERCENTILE = 99.5  # top of every map's colour scale


def color_limits(values: np.ndarray, floor: float | None = None) -> tuple[float, float]:
    """The colour scale of a map: its minimum (or ``floor``) to its 99.5th percentile.

    A few sharp cells (a first query's weight of 1 under a causal mask) must not flatten
    the rest of the map; hover still shows exact values, heavier cells take the top colour.
    """
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return (0.0, 1.0)
    low = float(finite.min()) if floor is None else floor
    high = float(np.percentile(finite, COLOR_TOP_PERCENTILE))
    if high <= low:
        high = float(finite.max())
    return (low, high if high > low else low + 1e-9)


def image_limits(values: np.ndarray, group: str) -> tuple[float, float]:
    """The colour scale of a drawn map, the one rule every render and update follows.

    Head maps run from 0 (so that heads compare); a map with negative values (raw or
    scaled scores) is centred on 0, so that a diverging colormap's middle colour means 0,
    out to the 99.5th percentile of its magnitude; other maps run from their minimum to
    their 99.5th percentile (:func:`color_limits`).
    """
    if group == "HeadMap":
        return color_limits(values, 0.0)
    low, high = color_limits(values)  # one pass over the finite cells in the usual case
    if low < 0:  # signed: centred on 0
        finite = values[np.isfinite(values)]
        reach = float(np.percentile(np.abs(finite), COLOR_TOP_PERCENTILE)) or 1e-9
        return (-reach, reach)
    return low, high


def rasterized(image: hv.Image, width: int, height: int, x_range=None, y_range=None) -> hv.Image:
    """An ``hv.Image`` regridded by datashader to at most ``width x height`` (see
    :func:`raster_values`), with its colour limits set by :func:`color_limits`."""
    raster, bounds = raster_values(
        image.dimension_values(2, flat=False), image.bounds.lbrt(), width, height, x_range, y_range
    )
    return hv.Image(
        raster[::-1],
        bounds=bounds,
        kdims=image.kdims,
        vdims=image.vdims,
        group=image.group,
        label=image.label,
    ).opts(clim=image_limits(raster, image.group))


# Module-name segments that say nothing about which attention it is.
GENERIC_SEGMENTS = frozenset({"layers", "layer", "h", "blocks", "block", "model", "transformer"})


def short_layer_name(name, among_groups: bool = False) -> str:
    """A layer's module name cut to fit a title.

    Alone, its numbers (``encoder.layer.3.attn`` -> ``3``); ``among_groups`` (a capture with
    several kinds of attention, where numbers repeat across kinds) keeps every segment
    but the generic ones (``decoder.layers.0.multihead_attn`` -> ``decoder.0.multihead_attn``).
    """
    name = str(name)
    if among_groups:
        return ".".join(part for part in name.split(".") if part not in GENERIC_SEGMENTS)
    numbers = re.findall(r"\d+", name)
    return ".".join(numbers) if numbers and len(name) > 12 else name


def matrix_title(ds: xr.Dataset, sel: Selection) -> str:
    """The attention matrix's title for a selection (naming the layer of a captured model)."""
    head = "mean of heads" if sel.head == "mean" else f"head {sel.head}"
    if "layer" in ds.coords and ds["layer"].ndim == 0:
        name = short_layer_name(ds["layer"].item(), among_groups="group" in ds.attrs)
        head = f"{head}, layer {name}"
    mask = _mask_mode(ds, sel)
    if "sample_mask" in ds and mask == ds.attrs.get("mask", "none"):
        mask += ", per sample"
    if "padding" in ds:
        padded = int(np.asarray(ds["padding"].isel(batch=sel.sample).values).sum())
        if padded:
            mask += f"; {padded} padded positions masked"
    return f"sample {sel.sample}, {head}: {STAGE_LABELS[sel.stage]} (mask {mask})"


def query_marker(ds: xr.Dataset, sel: Selection) -> hv.HSpan:
    """A box around the selected query's row of an attention matrix."""
    return hv.HSpan(sel.query - 0.5, sel.query + 0.5, group="Marker")


def _position_axis(ds: xr.Dataset, sel: Selection) -> tuple[np.ndarray, str]:
    """The x values of the top view: timestamps where known, else integer positions."""
    if "time" in ds.coords:
        time = ds["time"]
        if "batch" in time.dims:
            time = time.isel(batch=sel.sample)
        return np.asarray(time.values), "time"
    return np.arange(ds.sizes["query"]), "position"


def sequence_curve(ds: xr.Dataset, sel: Selection, show_appliances: bool = True) -> hv.Overlay:
    """The input sequence of the selected sample over its positions (group ``Sequence``).

    The household aggregate power (with each appliance's ground truth, when asked and
    present) for a NILM trace; otherwise the norm of the input vector ``x`` per position;
    for a trace with only weights, the attention each position receives (mean over heads
    and queries).
    """
    xs, xname = _position_axis(ds, sel)
    xdim = hv.Dimension(xname)
    curves = []
    if "aggregate" in ds:
        power = ds["aggregate"].isel(batch=sel.sample).values
        ydim = hv.Dimension("power", label="power", unit="W")
        curves.append(
            hv.Curve(
                (xs, power), xdim, ydim, group="Sequence", label="aggregate", datatype=FAST_DATATYPE
            )
        )
        if show_appliances and "appliance_power" in ds:
            per_appliance = ds["appliance_power"].isel(batch=sel.sample)
            for i, name in enumerate(per_appliance["appliance"].values):
                curves.append(
                    hv.Curve(
                        (xs, per_appliance.isel(appliance=i).values),
                        xdim,
                        ydim,
                        group="Sequence",
                        label=str(name),
                        datatype=FAST_DATATYPE,
                    )
                )
        title = f"sample {sel.sample}: aggregate power (click to pick the query)"
    elif "x" in ds:
        norm = np.linalg.norm(ds["x"].isel(batch=sel.sample).values, axis=-1)
        curves.append(
            hv.Curve((xs, norm), xdim, ("norm", "‖x‖"), group="Sequence", label="input norm")
        )
        title = f"sample {sel.sample}: input vector norm per position"
    else:
        received = ds["weights"].isel(batch=sel.sample).mean(("head", "query")).values
        curves.append(
            hv.Curve(
                (xs, received),
                xdim,
                ("attention", "attention received"),
                group="Sequence",
                label="attention received",
            )
        )
        title = f"sample {sel.sample}: attention each position receives"
    return hv.Overlay(curves, label=title)


def position_marker(ds: xr.Dataset, sel: Selection) -> hv.VLine:
    """A vertical line at the selected query position on the top view's axis."""
    xs, _ = _position_axis(ds, sel)
    return hv.VLine(xs[sel.query], group="Marker")


def position_from_x(ds: xr.Dataset, sel: Selection, x) -> int:
    """The position nearest to an x value of the top view (a timestamp or a position)."""
    xs, xname = _position_axis(ds, sel)
    if xname == "time":
        if isinstance(x, int | float | np.integer | np.floating):
            # Bokeh reports datetime axes in milliseconds since the epoch.
            target = np.datetime64(int(x), "ms")
        else:
            target = np.datetime64(pd.Timestamp(x).to_datetime64())
        offsets = np.abs((xs - target).astype("timedelta64[ns]").astype(np.int64))
        return int(np.argmin(offsets))
    return int(np.clip(round(float(x)), 0, len(xs) - 1))


def _bars(
    values: np.ndarray, colors, xlabel: str, ylabel: str, heads=None, label: str = ""
) -> hv.Rectangles:
    """One rectangle per entry of a vector (group ``Vector``), coloured per entry."""
    n = len(values)
    index = np.arange(n, dtype=np.float32)
    values = np.asarray(values, dtype=np.float32)
    zeros = np.zeros(n, dtype=np.float32)
    columns = (
        index - 0.45,
        np.minimum(zeros, values),
        index + 0.45,
        np.maximum(zeros, values),
        values,
        np.zeros(n, dtype=int) if heads is None else heads,
        np.asarray(colors),
    )
    return hv.Rectangles(
        columns,
        kdims=[hv.Dimension("x0", label=xlabel), hv.Dimension("y0", label=ylabel), "x1", "y1"],
        vdims=["value", "head", "color"],
        group="Vector",
        label=label,
        datatype=FAST_DATATYPE,
    )


def _head_colors(heads: np.ndarray, enabled=None) -> list[str]:
    return [head_color(h) if enabled is None or h in enabled else "#c8c8c8" for h in heads]


def _lanes(n_heads: int, head_dim: int) -> hv.VSpans:
    """Shaded background behind every other head's lane of ``head_dim`` features."""
    starts = np.arange(1, n_heads, 2) * head_dim - 0.5
    return hv.VSpans((starts, starts + head_dim), group="Lanes")


def input_vector(ds: xr.Dataset, sel: Selection) -> hv.Rectangles:
    """The ``d_model`` input vector ``x`` at the selected position, as bars."""
    require(ds, "x", "input vector view")
    values = ds["x"].isel(batch=sel.sample, position=sel.query).values
    return _bars(
        values,
        ["#444444"] * len(values),
        "feature",
        "x",
        label=f"input x[{sel.query}]: {len(values)} features",
    )


def weight_heatmap(ds: xr.Dataset, name: str) -> hv.Image:
    """A projection matrix (``w_q``, ``w_k``, ``w_v`` or ``w_o``) as a heatmap, out x in."""
    require(ds, name, f"{name} heatmap")
    values = np.asarray(ds[name].values, dtype=np.float32)
    n_out, n_in = values.shape
    limit = float(np.abs(values).max()) or 1.0
    label = {"w_q": "Wq", "w_k": "Wk", "w_v": "Wv", "w_o": "Wo"}.get(name, name)
    return hv.Image(
        values[::-1],
        bounds=(-0.5, -0.5, n_in - 0.5, n_out - 0.5),
        kdims=["in", "out"],
        vdims=[hv.Dimension("weight", range=(-limit, limit))],
        group="Weight",
        label=f"{label} ({n_out}×{n_in})",
    )


def projection_vector(ds: xr.Dataset, sel: Selection, name: str) -> hv.Overlay:
    """``q``, ``k`` or ``v`` at the selected position, all heads joined into one vector.

    Bars are coloured by head and the ``n_heads`` lanes of ``head_dim`` features shaded
    alternately.
    """
    require(ds, name, f"{name.upper()} vector view")
    where = f"{sel.query}"
    if "position" in ds[name].dims:
        per_head = ds[name].isel(batch=sel.sample, position=sel.query).values  # (H, E)
    else:  # cross-attention: k and v live on the other sequence; show the key most attended
        key = int(np.nanargmax(_selected_weights(ds, sel, None)))
        per_head = ds[name].isel(batch=sel.sample, key=key).values  # (H, E)
        where = f"key {key}, most attended by query {sel.query}"
    n_heads, head_dim = per_head.shape
    heads = np.repeat(np.arange(n_heads), head_dim)
    bars = _bars(per_head.reshape(-1), _head_colors(heads), "feature", name, heads)
    title = f"{name.upper()}[{where}]: {n_heads} heads × {head_dim}"
    return hv.Overlay([bars, _lanes(n_heads, head_dim)], label=title)


def _selected_weights(ds: xr.Dataset, sel: Selection, cache: StageCache | None) -> np.ndarray:
    """Softmax weights of the selected query row (mean of enabled heads for "mean")."""
    heads = stage_heads(ds, sel.with_(stage="softmax"), cache)
    if sel.head == "mean":
        enabled = list(sel.enabled_heads) if sel.enabled_heads else list(range(len(heads)))
        return heads[enabled, sel.query].mean(axis=0)
    return heads[int(sel.head), sel.query]


def aggregation_weights(
    ds: xr.Dataset, sel: Selection, cache: StageCache | None = None
) -> hv.Overlay:
    """The selected query's softmax weights over every key, as bars, the query marked."""
    weights = _selected_weights(ds, sel, cache)
    head = "mean of heads" if sel.head == "mean" else f"head {sel.head}"
    bars = _bars(weights, ["#b2182b"] * len(weights), "key", "weight")
    return hv.Overlay(
        [bars, hv.VLine(sel.query, group="Marker")],
        label=f"weights of query {sel.query} ({head})",  # fits the narrow column
    )


def _values_for(ds: xr.Dataset, sel: Selection) -> np.ndarray:
    """Value vectors of the selected sample: ``(key, E)`` for a head, ``(key, D)`` for mean."""
    require(ds, "v", "value aggregation view")
    v = ds["v"].isel(batch=sel.sample).values  # (H, S, E)
    if sel.head == "mean":
        return v.transpose(1, 0, 2).reshape(v.shape[1], -1)  # (S, H*E)
    return v[int(sel.head)]


def top_values(
    ds: xr.Dataset, sel: Selection, cache: StageCache | None = None, top: int = TOP_KEYS
) -> hv.HeatMap:
    """The value vectors of the ``top`` most-attended keys of the selected query."""
    weights = _selected_weights(ds, sel, cache)
    values = _values_for(ds, sel)
    order = np.argsort(weights, kind="stable")[::-1][:top]
    n_dims = values.shape[1]
    labels = np.repeat(
        [f"key {key} w={weights[key]:.3f}" for rank, key in enumerate(order)], n_dims
    )
    table = pd.DataFrame(
        {
            "dim": np.tile(np.arange(n_dims), len(order)),
            "key": labels,
            "value": values[order].reshape(-1).astype(np.float32),
        }
    )
    return hv.HeatMap(
        table,
        kdims=["dim", "key"],
        vdims=["value"],
        group="Values",
        label=f"value vectors of the {len(order)} most-attended keys",
    )


def context_vector(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """The weighted sum of the value vectors: the context vector of the selected query."""
    weights = _selected_weights(ds, sel, cache)
    values = _values_for(ds, sel)
    context = (weights[:, None] * values).sum(axis=0)
    if sel.head == "mean":
        heads = np.repeat(np.arange(ds.sizes["head"]), len(context) // ds.sizes["head"])
        title = f"context of query {sel.query}: Σ mean-weight · v (all heads)"
    else:
        heads = np.full(len(context), int(sel.head))
        title = f"context of query {sel.query}, head {sel.head}: Σ w · v"
    return _bars(context, _head_colors(heads), "head dim", "context", heads, label=title)


def head_contexts(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> np.ndarray:
    """Per-head context vectors of the selected query, ``(head, head_dim)``.

    The trace's own ``context`` when the mask is the trace's; otherwise recomputed from
    the recomputed weights and ``v``.
    """
    if sel.mask in (None, ds.attrs.get("mask", "none")) and "context" in ds:
        return ds["context"].isel(batch=sel.sample, query=sel.query).values.astype(np.float32)
    require(ds, "v", "head merge view")
    weights = stage_heads(ds, sel.with_(stage="softmax"), cache)[:, sel.query]  # (H, S)
    v = ds["v"].isel(batch=sel.sample).values  # (H, S, E)
    return np.einsum("hs,hse->he", weights, v).astype(np.float32)


def _enabled(ds: xr.Dataset, sel: Selection) -> set[int]:
    n_heads = ds.sizes["head"]
    return set(range(n_heads)) if sel.enabled_heads is None else set(sel.enabled_heads)


def merged_output(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """Merged vector and output of the selected query, with all heads and without the off ones.

    Returns
    -------
    merged, output_all, output_enabled : numpy.ndarray
        ``(D,)`` merged vector (off heads zeroed), the output with every head, the output
        with only the enabled heads.
    """
    require(ds, "w_o", "output projection view")
    contexts = head_contexts(ds, sel, cache)  # (H, E)
    n_heads = contexts.shape[0]
    enabled = _enabled(ds, sel)
    keep = np.array([h in enabled for h in range(n_heads)], dtype=np.float32)[:, None]
    w_o = np.asarray(ds["w_o"].values, dtype=np.float32)
    merged_all = contexts.reshape(-1)  # (D,) heads side by side, as the model merges them
    merged = (contexts * keep).reshape(-1)
    return merged, w_o @ merged_all, w_o @ merged


def output_change_ratio(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> float:
    """``‖y_enabled − y_all‖ / ‖y_all‖`` at the selected query."""
    _, output_all, output_enabled = merged_output(ds, sel, cache)
    return float(np.linalg.norm(output_enabled - output_all) / (np.linalg.norm(output_all) or 1))


def head_merge(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> hv.Overlay:
    """The heads' context pieces joined into one ``d_model`` vector, coloured by head."""
    contexts = head_contexts(ds, sel, cache)
    n_heads, head_dim = contexts.shape
    enabled = _enabled(ds, sel)
    keep = np.array([h in enabled for h in range(n_heads)], dtype=np.float32)[:, None]
    heads = np.repeat(np.arange(n_heads), head_dim)
    bars = _bars(
        (contexts * keep).reshape(-1), _head_colors(heads, enabled), "feature", "merged", heads
    )
    off = n_heads - len(enabled)
    note = f", {off} head{'s' if off != 1 else ''} off" if off else ""
    title = f"head merge at query {sel.query}: {n_heads} × {head_dim} → {n_heads * head_dim}{note}"
    return hv.Overlay([bars, _lanes(n_heads, head_dim)], label=title)


def output_change(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """The output vector with only the enabled heads, against the output with all heads.

    Bars are the output without the switched-off heads; the black step line (group
    ``Reference``) is the output with every head; the title gives ``‖Δ‖ / ‖y‖``.
    """
    _, output_all, output_enabled = merged_output(ds, sel, cache)
    change = output_change_ratio(ds, sel, cache)
    bars = _bars(output_enabled, ["#2166ac"] * len(output_enabled), "feature", "output")
    reference = hv.Curve(
        (np.arange(len(output_all)), output_all.astype(np.float32)),
        "x0",
        "y0",
        group="Reference",
        label="all heads",
        datatype=FAST_DATATYPE,
    )
    return hv.Overlay(
        [bars, reference],
        label=f"output Wo · merged at query {sel.query}: changed {100 * change:.1f}% of ‖y‖",
    )


def head_map(
    ds: xr.Dataset, sel: Selection, head: int, cache: StageCache | None = None, enabled: bool = True
) -> hv.Image:
    """One head's softmax weights as a small map (group ``HeadMap``).

    The explorer colours it from white to the head's colour, grey when the head is off.
    """
    values = attention_values(ds, sel.with_(head=head, stage="softmax"), cache)
    length, n_keys = values.shape
    return hv.Image(
        values[::-1],
        bounds=(-0.5, -0.5, n_keys - 0.5, length - 0.5),
        kdims=["key", "query"],
        vdims=[hv.Dimension("weight")],
        group="HeadMap",
        label=f"head {head}" + ("" if enabled else " (off)"),
    )


def head_cmap(head: int, enabled: bool = True, n: int = 256) -> list[str]:
    """White to the head's colour (grey when off), ``n`` steps: a head's small-map palette."""
    end = head_color(head) if enabled else "#8a8a8a"
    rgb = np.array([int(end[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)
    steps = np.linspace(0.0, 1.0, n)[:, None]
    colors = np.round(255 + steps * (rgb - 255)).astype(int)
    return ["#{:02x}{:02x}{:02x}".format(*c) for c in colors]


def shape_table(ds: xr.Dataset, mask: str | None = None) -> hv.Table:
    """Every step of the layer with its operation and its real shape in this trace.

    The table of :func:`attnpanel.summary.shape_table` (also what ``attnpanel info``
    prints); ``mask`` names the mask mode shown, by default the trace's own.
    """
    table = summary.shape_table(ds, mask=mask)
    return hv.Table(table, kdims=["step"], vdims=["operation", "shape"])


def options(width: int = 400, height: int = 160) -> list:
    """The styling of every element the views make, to apply once with ``.opts(*options())``.

    The views return plain data elements (group and label name what they are); styling is
    applied once per plot rather than on every update, because ``.opts`` on each new element
    costs milliseconds and grows HoloViews' option tree.
    """
    # Charts leave the mouse wheel to the page (a wheel over a bar chart zoomed it instead
    # of scrolling); the maps keep it: a wheel zooms every linked map.
    common = dict(title="{label}", toolbar="above", show_grid=True, active_tools=["pan"])
    return [
        hv.opts.Rectangles(
            "Vector",
            color="color",
            line_color=None,
            tools=["hover"],
            yformatter=BasicTickFormatter(use_scientific=False),  # 0.007, not 7.000e-3
            width=width,
            height=height,
            show_legend=False,
            **common,
        ),
        hv.opts.VSpans("Lanes", color="#000000", alpha=0.06, line_color=None),
        hv.opts.VLine("Marker", color=HIGHLIGHT, line_width=3, alpha=0.9),
        hv.opts.HSpan(
            "Marker", color=HIGHLIGHT, fill_alpha=0.15, line_color=HIGHLIGHT, line_width=1.5
        ),
        hv.opts.Curve("Reference", color="black", line_width=1.2, interpolation="steps-mid"),
        hv.opts.Curve("Sequence", line_width=1, tools=["hover"], **common),
        hv.opts.Image(
            "Attention",
            cmap="coolwarm",
            clipping_colors={"NaN": "black"},
            colorbar=True,
            cformatter="%.3g",  # not 4.000e-3
            tools=["hover"],
            # cells are centred on whole positions: the one under the mouse, not 99.192
            hover_tooltips=[("key", "$x{0}"), ("query", "$y{0}"), ("value", "@image{0.0000}")],
            invert_yaxis=True,
            title="{label}",
            toolbar="above",
        ),
        hv.opts.Image(
            "HeadMap",
            clipping_colors={"NaN": "#222222"},
            invert_yaxis=True,
            xaxis=None,
            yaxis=None,
            toolbar=None,
            title="{label}",
        ),
        hv.opts.Image("Weight", cmap="RdBu_r", invert_yaxis=True, tools=["hover"], title="{label}"),
        hv.opts.HeatMap(
            "Values",
            cmap="RdBu_r",
            tools=["hover"],
            colorbar=True,
            invert_yaxis=True,
            title="{label}",
            toolbar="above",
        ),
        hv.opts.Overlay(title="{label}", show_legend=False),
    ]

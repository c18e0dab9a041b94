"""Views of a trace: pure functions ``(trace, selection) -> HoloViews element``.

Every function here reads an ``xarray.Dataset`` trace (see ``attnpanel.trace``) and a
:class:`~attnpanel.readouts.core.Selection` and returns one HoloViews element built from the
numbers of :mod:`attnpanel.readouts.core`, with no widgets and no state beyond an optional
:class:`~attnpanel.readouts.core.StageCache`. The explorer's sections draw through these same
functions; :mod:`attnpanel.render.styling` styles them and :mod:`attnpanel.readouts.raster`
regrids maps.

The names of ``readouts``, ``raster`` and ``styling`` that the views' users need are
re-exported here (``views.Selection``, ``views.raster_values``, ``views.options`` ...).
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import pandas as pd
import xarray as xr

from attnpanel.readouts import core, model_map, summary
from attnpanel.readouts.core import (
    Selection,
    StageCache,
    attention_values,
    enabled_set,
    head_contexts,
    head_patterns,
    matrix_title,
    merged_output,
    output_change_ratio,
    position_axis,
    require,
    selected_weights,
    stage_heads,
    stage_label,
    values_for,
)
from attnpanel.readouts.raster import (
    image_limits,
    raster_values,
)
from attnpanel.render.axes import shown_extent
from attnpanel.render.styling import (
    PROJECTION_FAMILIES,
    family_colors,
    head_colors,
    shade,
)
from attnpanel.traces.positions import TIME, TIME_END, Positions

TOP_VALUES = 5  # the values listed beside the context vector
FIGURE_SPACE = "\u2007"  # a space as wide as a digit (U+2007)


# Columns as a plain dict: building an element this way takes ~1.5 ms instead of ~8 ms
# through pandas, and the explorer builds a dozen per selection change.
FAST_DATATYPE = ["dictionary"]


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
        vdims=[hv.Dimension("value", label=stage_label(ds, sel.stage))],
        group="Attention",
        label=matrix_title(ds, sel),
    )


def rasterized(image: hv.Image, width: int, height: int, x_range=None, y_range=None) -> hv.Image:
    """An ``hv.Image`` regridded by datashader to at most ``width x height`` (see
    :func:`raster_values`), with its colour limits set by :func:`image_limits`."""
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
    ).opts(clim=image_limits(raster))


def query_marker(ds: xr.Dataset, sel: Selection) -> hv.HSpan:
    """A box around the selected query's row of an attention matrix."""
    return hv.HSpan(sel.query - 0.5, sel.query + 0.5, group="Marker")


def _sequence_series(ds: xr.Dataset, sel: Selection, show_reference: bool = True):
    """What the top view plots: ``(xs, xdim, ydim, [(label, values)], title)``."""
    found = core.sequence_series(ds, sel, show_reference)
    ydim = hv.Dimension(found.yname, label=found.ylabel, unit=found.unit)
    return found.xs, hv.Dimension(found.xname), ydim, found.series, found.title


def sequence_curve(ds: xr.Dataset, sel: Selection, show_reference: bool = True) -> hv.Overlay:
    """The input sequence of the selected sample over its positions (group ``Sequence``).

    The trace's input ``signal`` (with each reference series' truth and the model's
    prediction, when asked and present); otherwise
    the norm of the input vector ``x`` per position; for a trace with only weights, the
    attention each position receives (mean over heads and queries).
    """
    xs, xdim, ydim, series, title = _sequence_series(ds, sel, show_reference)
    curves = [
        hv.Curve((xs, values), xdim, ydim, group="Sequence", label=label, datatype=FAST_DATATYPE)
        for label, values in series
    ]
    return hv.Overlay(curves, label=title)


def weight_band(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> hv.Rectangles:
    """The selected query's weights painted behind the input curve (group ``QueryWeights``).

    One band per key position, white to dark red by its weight relative to the largest,
    spanning the height of every curve of the sample (shown or not); empty when the keys
    are not the curve's positions (cross-attention).
    """
    xs, xdim, ydim, series, _ = _sequence_series(ds, sel)
    weights = np.asarray(selected_weights(ds, sel, cache), dtype=np.float32)
    label = "selected query's weights"  # a legend entry: the same for every query
    if len(weights) != len(xs) or len(xs) == 0:
        empty = np.zeros(0, dtype=np.float32)
        columns = (empty, empty, empty, empty, empty, np.zeros(0, dtype=object))
    else:
        edges = _cell_edges(xs)
        low, high = _extent([values for _, values in series])
        n = len(xs)
        columns = (
            edges[:-1],
            np.full(n, low, dtype=np.float32),
            edges[1:],
            np.full(n, high, dtype=np.float32),
            weights,
            np.array(shade(weights)),
        )
    return hv.Rectangles(
        columns,
        # labelled as the curves' axes: the band is the overlay's first layer
        kdims=[
            hv.Dimension("x0", label=xdim.pprint_label),
            hv.Dimension("y0", label=ydim.pprint_label),
            "x1",
            "y1",
        ],
        vdims=["weight", "color"],
        group="QueryWeights",
        label=label,
        datatype=FAST_DATATYPE,
    )


def _cell_edges(xs: np.ndarray) -> np.ndarray:
    """``len(xs) + 1`` edges halfway between positions (or timestamps)."""
    if len(xs) == 1:
        half = np.timedelta64(30, "s") if np.issubdtype(xs.dtype, np.datetime64) else 0.5
        return np.array([xs[0] - half, xs[0] + half])
    middle = xs[:-1] + (xs[1:] - xs[:-1]) / 2
    return np.concatenate([[xs[0] - (xs[1] - xs[0]) / 2], middle, [xs[-1] + (xs[-1] - xs[-2]) / 2]])


def _extent(arrays) -> tuple[float, float]:
    """What the value axis shows of the curves (:func:`attnpanel.render.axes.fit_axis`):
    their lowest to their highest finite value, from 0 for one positive value (a flat
    curve). The band spanned from 0 whatever the curves: under curves far above 0 (a
    decoder's input norm, 5.60 to 5.63) it ran below the axis, cut at its edge."""
    finite = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return 0.0, 1.0
    low, high = float(finite.min()), float(finite.max())
    low, high = shown_extent(low, high)
    return (low, high) if high > low else (low - 1.0, high + 1.0)


def position_marker(ds: xr.Dataset, sel: Selection) -> hv.VLine | hv.VSpan:
    """The selected query on the top view's axis: a vertical line at its position or
    time, the interval of a span; nothing for a named token (it has no time)."""
    xs, xname = position_axis(ds, sel)
    x = xs[sel.query]
    found = Positions.of(ds, sel.sample)
    timeless = xname == "time" and np.isnat(x)
    if found.ends is not None:  # a trace of spans: always a span (one element type)
        return hv.VSpan(*((None, None) if timeless else (x, found.ends[sel.query])), group="Marker")
    return hv.VLine(None if timeless else x, group="Marker")


def position_from_x(ds: xr.Dataset, sel: Selection, x) -> int:
    """The position nearest to an x value of the top view (a timestamp or a position)."""
    xs, xname = position_axis(ds, sel)
    if xname == "time":
        if isinstance(x, int | float | np.integer | np.floating):
            # Bokeh reports datetime axes in milliseconds since the epoch.
            target = np.datetime64(int(x), "ms")
        else:
            target = np.datetime64(pd.Timestamp(x).to_datetime64())
        gaps = (xs - target).astype("timedelta64[ns]")
        offsets = np.where(np.isnat(gaps), np.iinfo(np.int64).max, np.abs(gaps.astype(np.int64)))
        return int(np.argmin(offsets))  # a named token (no time) is never nearest
    return int(np.clip(round(float(x)), 0, len(xs) - 1))


def vector_bars(
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


def lanes(n_heads: int, head_dim: int) -> hv.VSpans:
    """Shaded background behind every other head's lane of ``head_dim`` features."""
    starts = np.arange(1, n_heads, 2) * head_dim - 0.5
    return hv.VSpans((starts, starts + head_dim), group="Lanes")


def input_vector(ds: xr.Dataset, sel: Selection) -> hv.Rectangles:
    """The ``d_model`` input vector ``x`` at the selected position, as bars."""
    require(ds, "x", "input vector view")
    values = ds["x"].isel(batch=sel.sample, position=sel.query).values
    return vector_bars(
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
        key = int(np.nanargmax(selected_weights(ds, sel, None)))
        per_head = ds[name].isel(batch=sel.sample, key=key).values  # (H, E)
        where = f"key {key}, most attended by query {sel.query}"
    n_heads, head_dim = per_head.shape
    heads = np.repeat(np.arange(n_heads), head_dim)
    colors = family_colors(name, heads) if name in PROJECTION_FAMILIES else head_colors(heads)
    bars = vector_bars(per_head.reshape(-1), colors, "feature", name, heads)
    title = f"{name.upper()}[{where}]: {n_heads} heads × {head_dim}"
    return hv.Overlay([bars, lanes(n_heads, head_dim)], label=title)


def aggregation_weights(
    ds: xr.Dataset, sel: Selection, cache: StageCache | None = None
) -> hv.Overlay:
    """The selected query's softmax weights over every key, as bars, the query marked."""
    weights = selected_weights(ds, sel, cache)
    bars = vector_bars(weights, ["#b2182b"] * len(weights), "key", "weight")
    return hv.Overlay(
        [bars, hv.VLine(sel.query, group="Marker")], label=weights_title(sel.query, sel.head)
    )


def weights_title(query, head) -> str:
    """The query's weights bars' title (``query`` may be a placeholder the page fills)."""
    return f"weights of query {query} ({core.head_words(head)})"  # fits the narrow column


def top_values(
    ds: xr.Dataset, sel: Selection, cache: StageCache | None = None, top: int = TOP_VALUES
) -> hv.HeatMap:
    """The value vectors of the ``top`` most-attended keys of the selected query."""
    weights = selected_weights(ds, sel, cache)
    values = values_for(ds, sel)
    order = np.argsort(weights, kind="stable")[::-1][:top]
    seen = order[weights[order] > 0]  # a blocked key (query 0, causal) is no top key
    order = seen if len(seen) else order[:1]
    n_dims = values.shape[1]
    # each key's label at one width (its number right-aligned in figure spaces, a digit's
    # width): a new query's labels never widen the axis (BokehJS then lays the page out again)
    # a text's token with its position (a token may repeat), a named token by its name, a
    # step by its number
    names = key_names(ds, sel.sample, len(weights))
    shown = [names[key] for key in order]
    digits = max(len(n) for n in names)
    labels = [
        f"{key:{FIGURE_SPACE}>{digits}}: w {weights[k]:.3f}"
        for key, k in zip(shown, order, strict=True)
    ]
    labels = np.repeat(labels, n_dims)
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
        label=f"value vectors, top {len(order)} keys",  # fits the narrow column
    )


def key_names(ds: xr.Dataset, sample: int, n_keys: int) -> list[str]:
    """Each key's name in the top keys' labels: its token for text, its clock time or its
    name (``statistics``) where the trace has them, with its position where a name repeats
    (``"the (5)"``), else the position's number."""
    labels = model_map.tokens(ds, sample) or Positions.of(ds, sample).labels()
    if labels is None:
        return [str(key) for key in range(n_keys)]
    labels = labels[:n_keys]
    if len(set(labels)) == len(labels):
        return labels
    return [label if label == str(key) else f"{label} ({key})" for key, label in enumerate(labels)]


def context_vector(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """The weighted sum of the value vectors: the context vector of the selected query."""
    weights = selected_weights(ds, sel, cache)
    values = values_for(ds, sel)
    context = (weights[:, None] * values).sum(axis=0)
    if sel.head == "mean":
        heads = np.repeat(np.arange(ds.sizes["head"]), len(context) // ds.sizes["head"])
        title = f"context of query {sel.query}: Σ mean-weight · v (all heads)"
    else:
        heads = np.full(len(context), int(sel.head))
        title = f"context of query {sel.query}, head {sel.head}: Σ w · v"
    return vector_bars(context, head_colors(heads), "head dim", "context", heads, label=title)


def head_merge(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> hv.Overlay:
    """The heads' context pieces joined into one ``d_model`` vector, coloured by head."""
    contexts = head_contexts(ds, sel, cache)
    n_heads, head_dim = contexts.shape
    enabled = enabled_set(ds, sel)
    keep = np.array([h in enabled for h in range(n_heads)], dtype=np.float32)[:, None]
    heads = np.repeat(np.arange(n_heads), head_dim)
    bars = vector_bars(
        (contexts * keep).reshape(-1), head_colors(heads, enabled), "feature", "merged", heads
    )
    off = n_heads - len(enabled)
    note = f", {off} head{'s' if off != 1 else ''} off" if off else ""
    title = f"head merge at query {sel.query}: {n_heads} × {head_dim} → {n_heads * head_dim}{note}"
    return hv.Overlay([bars, lanes(n_heads, head_dim)], label=title)


def output_change(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """The output vector with only the enabled heads, against the output with all heads.

    Bars are the output without the switched-off heads; the black step line (group
    ``Reference``) is the output with every head; the title gives ``‖Δ‖ / ‖y‖``.
    """
    _, output_all, output_enabled = merged_output(ds, sel, cache)
    change = output_change_ratio(ds, sel, cache)
    bars = vector_bars(output_enabled, ["#2166ac"] * len(output_enabled), "feature", "output")
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


def head_summary_view(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> hv.Table:
    """Per head, where it looks in the selected sample under the selected mask.

    The mean attention distance (in steps, and in time for a trace with a regular clock),
    the most-attended lag with the share of queries whose top key is at it, and the mean
    row entropy relative to uniform (:func:`attnpanel.readouts.core.head_patterns`), from the
    softmax weights the explorer draws (recomputed for another mask than the trace's).
    """
    weights = stage_heads(ds, sel.with_(stage="softmax"), cache)
    positions = Positions.of(ds, sel.sample)
    stats = head_patterns(np.nan_to_num(weights), positions.named)
    step = positions.step()
    columns = {
        "head": np.array([f"head {h}" for h in range(len(weights))]),
        "distance": np.round(stats["distance"], 1),
    }
    if step is not None:
        columns["span"] = np.array([_duration(d * step) for d in stats["distance"]])
    columns["lag"] = stats["lag"]
    columns["share"] = np.round(stats["lag_share"], 3)
    columns["entropy"] = np.round(stats["entropy"], 3)
    tokens = [str(n) for n in positions.names if n]
    if "token_share" in stats:
        columns["tokens"] = np.round(stats["token_share"], 3)
    labels = {
        "tokens": f"weight on {' and '.join(tokens)}",
        "distance": f"distance ({distance_unit(ds)})",
        "span": "distance (time)",
        "lag": "top lag",
        "share": "queries at lag",
        "entropy": "entropy/uniform",
    }
    vdims = [hv.Dimension(name, label=labels[name]) for name in columns if name != "head"]
    return hv.Table(
        columns,
        kdims=["head"],
        vdims=vdims,
        group="HeadSummary",
    )


def distance_unit(ds: xr.Dataset) -> str:
    """What a distance between positions counts: tokens of a text, patches of a series cut
    into spans, else time steps."""
    if "token" in ds.coords:
        return "tokens"
    if TIME_END in ds.coords and (ds[TIME_END] != ds[TIME]).any():
        return "patches"
    return "steps"


def _duration(delta) -> str:
    """A duration as people write it: ``1 h 05 min``, ``12 min 30 s``, ``45 s``."""
    seconds = int(round(float(delta / np.timedelta64(1, "s"))))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {seconds:02d} s" if seconds else f"{minutes} min"
    return f"{seconds} s"


def shape_view(ds: xr.Dataset, mask: str | None = None) -> hv.Table:
    """Every step of the layer with its operation and its real shape in this trace.

    The table of :func:`attnpanel.readouts.summary.shape_table` (also what ``attnpanel info``
    prints); ``mask`` names the mask mode shown, by default the trace's own.
    """
    table = summary.shape_table(ds, mask=mask)
    return hv.Table(table, kdims=["step"], vdims=["operation", "shape"])

"""The explorer's panels for text and multi-layer traces, positions and the head average.

``AttentionExplorer`` calls these while it builds its layout; they register their views on
the explorer's hot path (``explorer._add``), so a parameter change redraws them like the
rest. What they add (issue 5):

- a ``Layer`` selector for a trace with a ``layer`` dim. The explorer keeps one layer of
  the trace in ``explorer.trace``; the views' closures hold that Dataset, so switching
  layers updates it in place (``Dataset.update``) and redraws every view, and the stage
  cache keys its entries by layer (:class:`attnpanel.model_views.LayerCache`);
- for a trace with a ``token`` coordinate: the token strip as the top view (click a token
  to pick the query), token tick labels on the matrix axes, and the most-attended token
  of each position;
- the model view: every layer x head map in one datashaded image; a click opens that map
  in the large matrix (sets ``layer`` and ``head``);
- the sinusoidal positional encoding (shown at start when the trace's attribute
  ``positional_encoding`` is ``"sinusoidal"``, else behind its checkbox) and the head
  average beside the per-head maps (behind its checkbox).
"""

from __future__ import annotations

from functools import partial

import holoviews as hv
import numpy as np
import panel as pn
import xarray as xr

from attnpanel import model_views, views

TOKEN_STRIP_HEIGHT = 120
MODEL_CELL = 96  # pixels per small map of the model view
HEAD_AVERAGE_COLORS = views.head_cmap(0, enabled=False)  # white to grey
TABLE_PARAMS = ["sample", "head", "mask", "enabled_heads", "layer"]


def current_layer(trace: xr.Dataset, layer: int) -> xr.Dataset:
    """The Dataset the explorer's views read: one layer of ``trace`` (a copy of its index)."""
    if "layer" not in trace.dims:
        return trace.copy(deep=False)  # its own Dataset (the arrays are shared, never written)
    n_layers = trace.sizes["layer"]
    if not 0 <= int(layer) < n_layers:
        raise ValueError(f"layer must be in 0..{n_layers - 1}, got {layer}")
    return model_views.at_layer(trace, layer)


def switch_layer(explorer) -> None:
    """Point the explorer's views at ``explorer.layer`` (before they redraw)."""
    if explorer.layers is None:
        return
    # In place: every view's closure holds this Dataset.
    explorer.trace.update(model_views.at_layer(explorer.layers, explorer.layer))
    explorer.cache.layer = explorer.layer
    for name in ("w_q", "w_k", "w_v", "w_o"):
        if name not in explorer.trace:
            continue
        values = np.asarray(explorer.trace[name].values, dtype=np.float32)
        limit = float(np.abs(values).max()) or 1.0
        for handles in explorer._handles.get(name, {}).get(("Image", "Weight", ""), []):
            source = handles["source"]
            # views.weight_heatmap draws output row 0 at the bottom: rows by ascending y.
            source.data = dict(source.data, image=[values])
            handles["color_mapper"].low, handles["color_mapper"].high = -limit, limit


def layer_widgets(explorer) -> list:
    """The ``Layer`` selector, for a multi-layer trace (none otherwise)."""
    if explorer.layers is None:
        return []
    names = model_views.layer_names(explorer.layers)
    select = pn.widgets.Select.from_param(
        explorer.param.layer,
        name="Layer",
        width=230,
        options={f"{i}: {name}": i for i, name in enumerate(names)},
    )
    select._debounce = 0  # a discrete change, sent at once (see AttentionExplorer._controls)
    explorer._widgets_extra["layer"] = select
    return [select]


def toggles(explorer) -> list:
    """Checkboxes of the positional-encoding view and of the head-average map."""
    positional = pn.widgets.Checkbox.from_param(
        explorer.param.show_positional, name="positional encoding"
    )
    average = pn.widgets.Checkbox.from_param(
        explorer.param.show_head_average, name="head average beside the head maps"
    )
    explorer._widgets_extra.update(show_positional=positional, show_head_average=average)
    return [positional, average]


def matrix_ticks(explorer) -> dict:
    """HoloViews options labelling the matrix axes by token (nothing without tokens)."""
    ticks = model_views.token_ticks(explorer.trace, explorer.sample)
    if not ticks:
        return {}
    pairs = list(ticks.items())
    return dict(xticks=pairs, yticks=pairs, xrotation=90)


def _relabel_axes(explorer, *_events) -> None:
    ticks = {int(k): v for k, v in model_views.token_ticks(explorer.trace, explorer.sample).items()}
    for pane in ("matrix", "unmasked"):
        for handles in explorer._handles.get(pane, {}).get(("Image", "Attention", ""), []):
            for axis in ("xaxis", "yaxis"):
                if axis in handles:
                    handles[axis].major_label_overrides = ticks


def token_strip(explorer):
    """The top view of a text trace: clickable token boxes, the selected one outlined."""
    boxes = explorer._add(
        "token strip",
        lambda sel: model_views.token_boxes(explorer.trace, sel, explorer.cache),
        ["sample", "head", "query", "mask", "enabled_heads"],
        "tokens",
    )
    labels = explorer._add(
        "token labels",
        lambda sel: model_views.token_labels(explorer.trace, sel),
        ["sample"],
        "tokens",
        title=False,
    )
    marker = explorer._add(
        "token marker",
        lambda sel: model_views.selected_token(explorer.trace, sel),
        ["query"],
        "tokens",
        title=False,
        first=True,
    )
    n = explorer.trace.sizes["query"]
    plot = (boxes * labels * marker).relabel(boxes.label)
    plot = plot.opts(*views.options(), *model_views.options()).opts(
        hv.opts.Rectangles(
            responsive=True,
            height=TOKEN_STRIP_HEIGHT,
            xaxis=None,
            xlim=(-0.5, n - 0.5),
            ylim=(-0.06, 1.06),
            fontsize={"title": 10},
        ),
        hv.opts.Overlay(responsive=True, height=TOKEN_STRIP_HEIGHT),
    )
    tap = hv.streams.Tap(source=plot, transient=True)
    tap.add_subscriber(explorer._on_top_tap)  # x is the position: rounds to the token
    explorer._top_tap = tap
    explorer.param.watch(partial(_relabel_axes, explorer), ["sample", "layer"], precedence=1)
    return explorer._render(
        plot, "tokens", sizing_mode="stretch_width", height=TOKEN_STRIP_HEIGHT + 10, margin=(0, 5)
    )


def head_average_cells(explorer) -> list:
    """The head-average map beside the per-head maps, shown when ``show_head_average``."""
    size = 150
    try:
        image = explorer._add(
            "head average map",
            lambda sel: (
                model_views.head_average_values(explorer.trace, sel, explorer.cache),
                "head average",
            ),
            ["sample", "mask"],
            "head average",
            raster=(size, size),
            group="HeadMap",
            active=lambda: explorer.show_head_average,
        ).element("weight")
    except (views.MissingVariable, ValueError) as err:
        return [explorer._missing(views.MissingVariable("weights", str(err)), size, size)]
    image = image.opts(*views.options()).opts(
        frame_width=size, frame_height=size, fontsize={"title": 10}, cmap=HEAD_AVERAGE_COLORS
    )
    note = pn.pane.Markdown(
        "mean of all heads: what `nn.MultiheadAttention` returns",
        width=size,
        margin=(0, 5),
        styles={"font-size": "11px"},
    )
    explorer.param.watch(
        partial(_refresh_named, explorer, "head average map"), "show_head_average", precedence=1
    )
    cell = pn.Column(
        explorer._render(image, "head average", linked_axes=True, margin=0),
        note,
        margin=(0, 0, 0, 15),
        visible=explorer.param.show_head_average,
    )
    return [cell]


def _refresh_named(explorer, name: str, event) -> None:
    if event.new:
        for view in explorer._views:
            if view.name == name:
                explorer._refresh(view, explorer.selection)


def _top_attended_table(explorer):
    table = model_views.top_attended(explorer.trace, explorer.selection, explorer.cache)
    return table.opts(*model_views.options()).opts(
        width=520, height=min(520, 40 + 26 * explorer.trace.sizes["query"])
    )


def top_attended_section(explorer) -> list:
    """Per position, the most-attended token for the selected head (text traces only)."""
    if model_views.tokens(explorer.trace) is None:
        return []
    pane = pn.pane.HoloViews(_top_attended_table(explorer), width=530, margin=(0, 5))

    def update(*_events):
        try:
            pane.object = _top_attended_table(explorer)
        except Exception as err:  # noqa: BLE001 - shown to the user; the session goes on
            explorer._report(err, "updating the most-attended tokens")

    explorer.param.watch(update, TABLE_PARAMS, precedence=1)
    explorer._top_attended = pane
    return [pn.pane.Markdown("### Most-attended token per position", margin=(0, 5)), pane]


def _model_view_image(explorer, sample: int) -> hv.Image:
    n_layers = explorer.layers.sizes["layer"]
    n_heads = explorer.trace.sizes["head"]
    return model_views.model_view(
        explorer.layers, views.Selection(sample=sample), MODEL_CELL * n_heads, MODEL_CELL * n_layers
    )


def _marker_columns(explorer) -> dict:
    marker = model_views.model_view_marker(
        explorer.layer, explorer.head, explorer.trace.sizes["head"]
    )
    return {
        "left": marker.dimension_values("x0"),
        "right": marker.dimension_values("x1"),
        "bottom": marker.dimension_values("y0"),
        "top": marker.dimension_values("y1"),
    }


def _update_model_view(explorer, *events) -> None:
    """Redraw the model view's image (a new sample) and its outline (a new layer or head)."""
    found = explorer._handles.get("model view", {})
    try:
        if "sample" in {event.name for event in events}:
            image = _model_view_image(explorer, explorer.sample)
            left, bottom, right, top = image.bounds.lbrt()
            for handles in found.get(("Image", "ModelView", ""), []):
                # Rows by ascending y, as Bokeh's image glyph takes them.
                handles["source"].data = dict(
                    image=[image.dimension_values(2, flat=False)],
                    x=[left],
                    y=[bottom],
                    dw=[right - left],
                    dh=[top - bottom],
                )
                handles["plot"].title.text = image.label
        for handles in found.get(("Rectangles", "Selected", ""), []):
            handles["source"].data = _marker_columns(explorer)
    except Exception as err:  # noqa: BLE001 - shown to the user; the session goes on
        explorer._report(err, "updating the model view")


def model_view_section(explorer) -> list:
    """Every layer x head map on one page (multi-layer traces); a click opens one above."""
    if explorer.layers is None:
        return []
    n_layers = explorer.layers.sizes["layer"]
    n_heads = explorer.trace.sizes["head"]
    image = _model_view_image(explorer, explorer.sample)
    marker = model_views.model_view_marker(
        explorer.layer, explorer.head, explorer.trace.sizes["head"]
    )
    names = model_views.layer_names(explorer.layers)
    width, height = MODEL_CELL * n_heads, MODEL_CELL * n_layers
    plot = (
        (image * marker)
        .relabel(image.label)
        .opts(*model_views.options())
        .opts(
            hv.opts.Image(
                frame_width=width,
                frame_height=height,
                clim=(0, 1),
                xaxis="top",
                xticks=[(h, f"head {h}") for h in range(n_heads)],
                yticks=[(i, f"{i}: {name}"[:40]) for i, name in enumerate(names)],
            ),
            hv.opts.Overlay(title="{label}"),
        )
    )

    def on_tap(x=None, y=None):
        if x is None or y is None:
            return
        layer, head = model_views.mosaic_cell(x, y, n_layers, n_heads)
        doc = pn.state.curdoc
        if doc is None or doc.session_context is None:
            explorer.param.update(layer=layer, head=head)
        else:
            # Stream callbacks run outside the document lock (see _select_query).
            doc.add_next_tick_callback(partial(explorer.param.update, layer=layer, head=head))

    tap = hv.streams.Tap(source=plot, transient=True)
    tap.add_subscriber(on_tap)
    explorer._model_tap = tap
    explorer.param.watch(
        partial(_update_model_view, explorer), ["sample", "layer", "head"], precedence=1
    )
    pane = explorer._render(plot, "model view", margin=(0, 5))
    explorer._model_view = pane
    return [
        pn.pane.Markdown(
            "### Model view: every layer and head (captured softmax weights; "
            "click a map to open it in the attention matrix)",
            margin=(0, 5),
        ),
        pane,
    ]


def positional_section(explorer) -> list:
    """The sinusoidal encoding heatmap, shown while ``show_positional`` is on."""
    image = model_views.positional_encoding(explorer.trace)
    length, width = image.dimension_values(2, flat=False).shape
    image = image.opts(*model_views.options()).opts(
        frame_width=min(900, max(300, 4 * width)), frame_height=min(400, max(200, 2 * length))
    )
    return [
        pn.Column(
            pn.pane.Markdown("### Positional encoding (position x dimension)", margin=(0, 5)),
            pn.pane.HoloViews(image, margin=(0, 5)),
            visible=explorer.param.show_positional,
        )
    ]


def sections(explorer) -> list:
    """The sections added below the attention matrix, in layout order."""
    return [
        *top_attended_section(explorer),
        *model_view_section(explorer),
        *positional_section(explorer),
    ]

"""Bokeh figures drawn straight from the views' elements: the served page's first render.

The views return plain HoloViews elements (their group and label say what they are).
Rendering one through HoloViews costs a session 40-70 ms of option lookups per plot, three
seconds for the explorer's page; :func:`draw` makes the same Bokeh models directly (about
15 ms a plot) and returns them as the plot handles the live-update engine writes into.
Every element kind the explorer shows is drawn here; the look of each group comes from
:data:`attnpanel.render.styling.LOOK`, the table that also styles the same elements for
HoloViews (``DynamicMap``s in a notebook).
"""

from __future__ import annotations

from collections.abc import Sequence

import holoviews as hv
import numpy as np
from bokeh.models import (
    Axis,
    BasicTickFormatter,
    BoxAnnotation,
    BoxInteractionHandles,
    ColorBar,
    ColumnDataSource,
    CustomJSHover,
    FactorRange,
    FixedTicker,
    GlyphRenderer,
    Grid,
    HoverTool,
    Legend,
    LinearColorMapper,
    PrintfTickFormatter,
    Range1d,
    Span,
    WheelZoomTool,
)
from bokeh.models import Image as ImageGlyph
from bokeh.models.annotations.geometry import AreaVisuals  # not re-exported by bokeh.models
from bokeh.plotting import figure as bokeh_figure
from holoviews.plotting.util import process_cmap

from attnpanel.readouts.raster import image_limits, scale_title
from attnpanel.render import axes
from attnpanel.render.axes import DRAWN_EXTENT, FIXED_AXES, axis_number, extents_of, fit_chart
from attnpanel.render.elements import CENTRED_GROUPS
from attnpanel.render.palette import legend_swatch
from attnpanel.render.styling import LEGEND_SWATCH, LOOK
from attnpanel.render.tables import table_model
from attnpanel.render.titles import COLORBAR_ROOM, fit_title

MAP_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"


def box_handles():
    """The look of a box annotation's drag handles, one model shared by every box of a page.

    Bokeh gives each ``BoxAnnotation`` its own two models for handles none of the explorer's
    boxes shows (they are not editable): about 60 models a page. Within one document the
    boxes can share one; a model belongs to one document, so each page makes its own.
    """
    return BoxInteractionHandles(all=AreaVisuals(fill_color="white", line_color="black"))


# WebGL draws long curves only. A map is one image, which a 2D canvas draws with one
# ``drawImage``; a WebGL canvas costs a context and a read-back per paint (software GL: the
# matrix's head change repainted in 114 ms median with WebGL maps, 91 ms on canvas, and the
# page's first paint took ~0.2 s longer). A chart of a few hundred bars or points gains
# nothing either (the top view's twelve 480-point layers: 148 ms a paint with WebGL, 12 ms
# without).
WEBGL_MIN_POINTS = 5_000


SHORT_PLOT = 150  # px: a chart this tall or less gets about 3 value ticks


def _key(element):
    from attnpanel.render.elements import PlotKey

    return PlotKey.of(element)


def palette(cmap) -> list[str]:
    """A 256-colour palette from a name (``"coolwarm"``) or a list of colours."""
    return list(cmap) if isinstance(cmap, list | tuple) else process_cmap(cmap, 256)


def backend(layers) -> str:
    """``"webgl"`` for a figure with a layer of over :data:`WEBGL_MIN_POINTS` points (a long
    curve), else ``"canvas"`` (maps included)."""
    longest = max(
        (len(layer) for layer in layers if isinstance(layer, hv.Curve | hv.Rectangles)), default=0
    )
    return "webgl" if longest > WEBGL_MIN_POINTS else "canvas"


def draw(
    element,
    *,
    width: int | None = None,
    height: int | None = None,
    frame_width: int | None = None,
    frame_height: int | None = None,
    responsive: bool = False,
    title: str | None = None,
    title_size: str = "10pt",
    xaxis: bool | str = True,
    yaxis: bool = True,
    xlabel: str | None = None,
    ylabel: str | None = None,
    xticks: Sequence | None = None,
    yticks: Sequence | None = None,
    xrotation: float = 0.0,
    toolbar: bool = False,
    tools: Sequence[str] = ("hover",),
    map_tools: bool = False,
    cmap=None,
    clim: tuple | None = None,
    colorbar: bool | str = False,
    cformat: str = "%.3g",
    x_range=None,
    y_range=None,
    xlim: tuple | None = None,
    ylim: tuple | None = None,
    legend: bool = False,
    legend_cols: int = 1,
    layer_style: dict | None = None,
    box_handles=None,
):
    """The Bokeh figure of an element (or overlay), and the handles of each layer.

    Parameters
    ----------
    element : holoviews.Element or holoviews.Overlay
        What a view built; an overlay's layers are drawn in order into one figure.
    width, height, frame_width, frame_height : int, optional
        The figure's size, or its frame's (the plotting area); ``responsive`` stretches
        the width.
    title : str, optional
        Defaults to the element's label.
    xaxis, yaxis : bool or "top"
        Whether (and where) to draw the axes.
    xlabel, ylabel : str, optional
        Axis labels instead of the dimensions' (``""`` for none).
    xticks, yticks : sequence of (position, label), optional
        Fixed tick labels (tokens, layer names).
    toolbar, tools, map_tools : optional
        A toolbar shown above while the mouse is over the plot; the tools (``"hover"``,
        ``"tap"``); ``map_tools`` adds pan, wheel zoom, box zoom, reset and save.
    cmap, clim, colorbar, cformat : optional
        Colours of a map: palette (or the group's), fixed limits, a colour bar (right of
        the frame, or ``"below"`` it, thin and unlabelled: the hover gives the values)
        and its tick format.
    x_range, y_range : bokeh.models.Range1d, optional
        Ranges to share (linked maps).
    xlim, ylim : tuple, optional
        Fixed x and y extents.
    legend, legend_cols : optional
        A legend of the labelled layers, right of the plot.
    layer_style : dict, optional
        Glyph properties per layer label (a curve's colour, dash, visibility).
    box_handles : bokeh.models.BoxInteractionHandles, optional
        Shared by the figure's box annotations (:func:`box_handles`, one per page).

    Returns
    -------
    figure : bokeh.plotting.figure or panel.models.HTML
        A table is an HTML table (:mod:`attnpanel.render.tables`, handle ``table``).
    layers : list of (PlotKey, dict)
        Each layer's handles: ``plot``, ``source``, ``glyph``, ``glyph_renderer`` and for
        maps ``color_mapper``, ``colorbar``, ``x_range``, ``y_range``, ``xaxis`` and
        ``yaxis`` (None where the axis is hidden).
    """
    if isinstance(element, hv.Table):
        return _table(element, width, height)
    layers = list(element) if isinstance(element, hv.Overlay) else [element]
    first = layers[0]
    sizing = {}
    if frame_width:
        sizing.update(frame_width=frame_width, frame_height=frame_height)
    elif responsive:
        sizing.update(sizing_mode="stretch_width", height=height)
    else:
        sizing.update(width=width, height=height)
    image = next((layer for layer in layers if isinstance(layer, hv.Image)), None)
    x_kind = "linear"
    xs = first.dimension_values(0) if not isinstance(first, hv.Table) else []
    if len(xs) and np.issubdtype(np.asarray(xs).dtype, np.datetime64):
        x_kind = "datetime"
    tool_names = [t for t in tools if t != "tap"]
    if map_tools:
        tool_names = [*MAP_TOOLS.split(","), *tool_names]
    if isinstance(first, hv.HeatMap):
        # rows by key, the first (most attended) on top: a categorical y axis from the start
        keys = [str(k) for k in first.dimension_values(1)]
        sizing["y_range"] = FactorRange(factors=list(dict.fromkeys(keys))[::-1])
    fig = bokeh_figure(
        title=element.label if title is None else title,
        # a hidden axis is not made at all (nor its grid, ticker and formatter)
        x_axis_type=x_kind if xaxis else None,
        y_axis_type="auto" if yaxis else None,
        x_axis_location="above" if xaxis == "top" else "below",
        tools=",".join(name for name in tool_names if name != "hover"),
        toolbar_location="above" if toolbar else None,
        # a row of its own above the title: beside it, the toolbar stayed where the first
        # title ended, over the end of a longer one (the mean of heads' title, 61 px)
        toolbar_sticky=False,
        output_backend=backend(layers),
        min_border=5,
        **sizing,
    )
    fig.title.text_font_size = title_size
    if fig.toolbar is not None:
        fig.toolbar.autohide = True
        wheel = [tool for tool in fig.tools if isinstance(tool, WheelZoomTool)]
        # a wheel over a map zooms it (and every linked map); charts leave it to the page
        fig.toolbar.active_scroll = wheel[0] if wheel else None
    if x_range is not None:
        fig.x_range = x_range
    if y_range is not None:
        fig.y_range = y_range
    found = []
    legend_items = []
    shared = {} if box_handles is None else {"handles": box_handles}
    for layer in layers:
        style = dict(LOOK.get((type(layer).__name__, layer.group), {}))
        style.update((layer_style or {}).get(layer.label, {}))
        handles = _layer(fig, layer, style, cmap, clim, shared)
        handles["plot"] = fig
        handles[DRAWN_EXTENT] = extents_of(layer)
        found.append((_key(layer), handles))
        if legend and layer.label and "glyph_renderer" in handles:
            renderers = [handles["glyph_renderer"]]
            swatch = LEGEND_SWATCH.get((type(layer).__name__, layer.group))
            if swatch is not None:  # a square of no area on the plot: the legend's swatch
                renderers.insert(0, legend_swatch(fig, swatch))
            legend_items.append(axes.legend_entry(handles, layer.label, renderers))
    for renderer in fig.renderers:
        # nothing here is ever selected or muted (legends hide): no glyphs for those
        renderer.nonselection_glyph = renderer.muted_glyph = None
    if image is not None or isinstance(first, hv.HeatMap):
        _map_frame(fig, found, first if image is None else image, colorbar, cformat)
    x_axis, y_axis = axes_of(fig)
    _axes(x_axis, y_axis, first, xticks, yticks, xrotation)
    tall = frame_height or (height if not frame_width else None)
    ticker = getattr(y_axis, "ticker", None)
    if hasattr(ticker, "desired_num_ticks") and not yticks and tall and tall <= SHORT_PLOT:
        ticker.desired_num_ticks = 3  # a short chart's labels would run into each other
    if xlabel is not None and x_axis is not None:
        x_axis.axis_label = xlabel or None
    if ylabel is not None and y_axis is not None:
        y_axis.axis_label = ylabel or None
    if "hover" in tools:
        hover = _hover(found, layers)
        fig.add_tools(hover)
        for _, handles in found:
            if "color_mapper" in handles and "image" in handles["source"].data:
                handles["hover"] = hover  # its value's name follows the stage (push)
    if xlim is not None and x_range is None:
        fig.x_range = Range1d(*xlim)
    if ylim is not None and y_range is None:
        fig.y_range = Range1d(*ylim)
    # a map's axes are its cells; given limits and shared ranges stay as given
    is_map = isinstance(first, (hv.Image, hv.HeatMap))
    fixed = {"x"} if is_map or xlim is not None or x_range is not None else set()
    fixed |= {"y"} if is_map or ylim is not None or y_range is not None else set()
    for _, handles in found:
        handles.update(x_range=fig.x_range, y_range=fig.y_range, xaxis=x_axis, yaxis=y_axis)
        handles[FIXED_AXES] = frozenset(fixed)
    fit_chart(fig, [h for _, h in found])  # the rule of every later state (push.write)
    if legend_items:
        axes.follow_legend(fig, [h for _, h in found])
        fig.add_layout(
            Legend(
                items=legend_items,
                ncols=legend_cols,
                label_text_font_size="8pt",
                spacing=4,  # between columns too: a long label ends before the next glyph
                padding=4,
                click_policy="hide",
            ),
            "right",
        )
    fig.title.text = fit_title(fig, fig.title.text)  # (its colour bar, if any, in place)
    return fig, found


def _layer(fig, layer, style: dict, cmap, clim, handles: dict) -> dict:
    kind = type(layer).__name__
    visible = style.pop("visible", True)
    if isinstance(layer, hv.Image):  # the first layer: a map; later, a density in a chart
        return _image(fig, layer, style, cmap, clim, frame=not fig.renderers)
    if isinstance(layer, hv.HeatMap):
        return _heatmap(fig, layer, style, cmap)
    if isinstance(layer, hv.VLine):
        span = Span(location=axis_number(layer.data), dimension="height", level="overlay", **style)
        fig.add_layout(span)
        return {"glyph": span}
    if isinstance(layer, hv.VSpan):  # a span of steps (a patch), hidden where it has none
        left, right = (axis_number(v) for v in layer.data)
        box = BoxAnnotation(left=left, right=right, bottom=None, top=None, level="overlay",
                            visible=left is not None, **style)  # fmt: skip
        fig.add_layout(box)
        return {"glyph": box}
    if isinstance(layer, hv.HSpan):
        low, high = (float(v) for v in layer.data)
        box = BoxAnnotation(
            bottom=low, top=high, left=None, right=None, level="overlay", **handles, **style
        )
        fig.add_layout(box)
        return {"glyph": box}
    if isinstance(layer, hv.VSpans):
        starts, ends = (layer.dimension_values(i) for i in (0, 1))
        renderer = fig.vstrip(x0=starts, x1=ends, level="underlay", **style)
        return {"glyph": renderer.glyph, "glyph_renderer": renderer}
    if isinstance(layer, hv.Rectangles):
        columns = {
            "left": layer.dimension_values(0),
            "bottom": layer.dimension_values(1),
            "right": layer.dimension_values(2),
            "top": layer.dimension_values(3),
        }
        for dim in layer.vdims:
            columns[dim.name] = layer.dimension_values(dim)
        source = ColumnDataSource(columns)
        if "color" in columns:
            style.setdefault("fill_color", "color")
        renderer = fig.quad(
            left="left", right="right", bottom="bottom", top="top", source=source, **style
        )
    elif isinstance(layer, hv.Curve):
        x, y = layer.kdims[0].name, layer.vdims[0].name
        source = ColumnDataSource({x: layer.dimension_values(0), y: layer.dimension_values(1)})
        if layer.group == "Reference":
            renderer = fig.step(x=x, y=y, mode="center", source=source, **style)
        else:
            renderer = fig.line(x=x, y=y, source=source, **style)
    elif isinstance(layer, hv.Scatter):
        x, y = layer.kdims[0].name, layer.vdims[0].name
        # every dimension a column: the further ones (a survey point's sample) for the hover
        source = ColumnDataSource({d.name: layer.dimension_values(d) for d in layer.dimensions()})
        renderer = fig.scatter(x=x, y=y, source=source, **style)
    elif isinstance(layer, hv.Labels):
        x, y, text = (d.name for d in layer.dimensions()[:3])
        source = ColumnDataSource({name: layer.dimension_values(name) for name in (x, y, text)})
        renderer = fig.text(
            x=x,
            y=y,
            text=text,
            source=source,
            text_align="center",
            text_baseline="middle",
            **style,
        )
    else:
        raise TypeError(f"attnpanel.render.figures cannot draw a {kind}")
    renderer.visible = visible
    return {"source": source, "glyph": renderer.glyph, "glyph_renderer": renderer}


def _image(fig, layer: hv.Image, style: dict, cmap, clim, frame: bool = True) -> dict:
    values = layer.dimension_values(2, flat=False)  # rows by ascending y
    left, bottom, right, top = layer.bounds.lbrt()
    source = ColumnDataSource(
        dict(image=[values], x=[left], y=[bottom], dw=[right - left], dh=[top - bottom])
    )
    centred = layer.group in CENTRED_GROUPS
    low, high = image_limits(values, centred) if clim is None else clim  # the one rule
    mapper = LinearColorMapper(
        palette=palette(cmap or style.pop("cmap", "viridis")),
        low=low,
        high=high,
        nan_color=style.pop("nan_color", "black"),
    )
    style.pop("cmap", None)
    # The glyph made directly: ``fig.image`` would build three Image glyphs (drawn, not
    # selected, muted), each first with a default colour mapper of its own.
    glyph = ImageGlyph(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper)
    renderer = GlyphRenderer(data_source=source, glyph=glyph)
    fig.renderers.append(renderer)
    if frame:  # a map frames its figure; a density under a chart's points does not
        fig.x_range = fig.x_range if isinstance(fig.x_range, Range1d) else Range1d(left, right)
        if not isinstance(fig.y_range, Range1d):
            fig.y_range = Range1d(top, bottom)  # query 0 on top, as every map here
    return {
        "source": source,
        "glyph": renderer.glyph,
        "glyph_renderer": renderer,
        "color_mapper": mapper,
        "x_range": fig.x_range,
        "y_range": fig.y_range,
    }


def _heatmap(fig, layer: hv.HeatMap, style: dict, cmap) -> dict:
    dims = layer.dimension_values(0)
    keys = [str(k) for k in layer.dimension_values(1)]
    values = layer.dimension_values(2)
    low, high = image_limits(np.asarray(values, dtype=float))  # the one rule
    mapper = LinearColorMapper(palette=palette(cmap or style.pop("cmap")), low=low, high=high)
    source = ColumnDataSource(
        dict(dim=dims, key=keys, zvalues=values, value=values, width=np.ones(len(values)))
    )
    renderer = fig.rect(
        x="dim",
        y="key",
        width="width",
        height=1,
        source=source,
        fill_color={"field": "zvalues", "transform": mapper},
        line_color=None,
    )
    return {
        "source": source,
        "glyph": renderer.glyph,
        "glyph_renderer": renderer,
        "color_mapper": mapper,
        "y_range": fig.y_range,
        "x_range": fig.x_range,
    }


def _map_frame(fig, found, layer, colorbar, cformat: str) -> None:
    handles = next(h for key, h in found if "color_mapper" in h)
    mapper = handles["color_mapper"]
    if colorbar:
        below = colorbar == "below"
        bar = ColorBar(
            color_mapper=mapper,
            formatter=PrintfTickFormatter(format=cformat),
            title=""
            if below
            else scale_title(layer.vdims[0].pprint_label if layer.vdims else "", mapper.low),
            title_text_font_style="italic",
            orientation="horizontal" if below else "vertical",
            major_label_text_font_size="7pt" if below else "8pt",
            ticker=FixedTicker(ticks=[]) if below else "auto",
            width="auto" if below else 12,
            height=8 if below else "auto",
            padding=4,
        )
        fig.add_layout(bar, "below" if below else "right")
        if not below:  # room for the usual labels ("-12.5", "0.0005"): one width every stage
            fig.min_border_right = COLORBAR_ROOM
        handles["colorbar"] = bar
        handles["colorbar_label"] = layer.vdims[0].pprint_label if layer.vdims else ""
    fig.center = [r for r in fig.center if not isinstance(r, Grid)]  # a map covers its grid


def axes_of(fig) -> tuple:
    """A figure's x and y axes (None where hidden), read from its sides: ``fig.xaxis``
    searches every model the figure references, ~1 ms a call, a dozen calls a plot."""
    x_axis = next((r for r in [*fig.below, *fig.above] if isinstance(r, Axis)), None)
    y_axis = next((r for r in [*fig.left, *fig.right] if isinstance(r, Axis)), None)
    return x_axis, y_axis


def _axes(x_axis, y_axis, first, xticks, yticks, xrotation) -> None:
    kdims = first.kdims if not isinstance(first, hv.Rectangles) else first.kdims[:2]
    labels = {}
    if len(kdims) >= 1:
        labels["x"] = kdims[0].pprint_label
    if isinstance(first, hv.Image | hv.HeatMap) and len(kdims) >= 2:
        labels["y"] = kdims[1].pprint_label
    elif isinstance(first, hv.Curve):
        labels["y"] = first.vdims[0].pprint_label
    elif isinstance(first, hv.Rectangles) and len(kdims) >= 2:
        labels["y"] = kdims[1].pprint_label
    for name, axis, ticks in (("x", x_axis, xticks), ("y", y_axis, yticks)):
        if axis is None:
            continue
        if name in labels:
            axis.axis_label = labels[name]
        if ticks:
            axis.ticker = [float(pos) for pos, _ in ticks]
            axis.major_label_overrides = {float(pos): str(label) for pos, label in ticks}
        axis.axis_label_text_font_size = "9pt"
        axis.major_label_text_font_size = "8pt"
    if xrotation and x_axis is not None:
        x_axis.major_label_orientation = np.deg2rad(xrotation)
    if isinstance(first, hv.Rectangles) and first.group == "Vector" and y_axis is not None:
        axes.steady_labels(y_axis)  # 0.007, not 7.000e-3; at one width whatever the scale
    if isinstance(first, hv.Rectangles) and first.group == "Ranking" and x_axis is not None:
        x_axis.formatter = BasicTickFormatter(use_scientific=False)  # 0.0001, not 1.000e-4


# A map's cell in the hover: 4 decimals, and where the map holds NaN (drawn black or blank)
# what the cell is, never "NaN": in an attention map, a cell the mask blocks (its weight is
# exactly 0 after the softmax, whatever stage is drawn); elsewhere the map's own reason.
BLOCKED = "blocked by the mask: weight 0 after the softmax"
BLANK_WORDS = {
    "Attention": BLOCKED,
    "HeadMap": BLOCKED,
    "Difference": "blocked by the mask in A or in B",
    "Importance": "the layer has no such head",
    "Patching": "the layer has no such head",
}


# BokehJS writes "NaN" for a NaN value before any formatter sees it, so a map's value is
# read by its cell (the image index: a special variable, never NaN) from the hovered
# image's own source: ``cell`` is the value, NaN included.
CELL = "$image_index"  # the tooltip's field: a map's value, formatted as its cell's
CELL_JS = """
const source = special_vars.glyph_view.renderer.model.data_source;
const data = source.data.image[value.index];
const cell = Array.isArray(data[0]) ? data[value.j][value.i] : data[value.flat_index];
"""


def cell_format(group: str) -> CustomJSHover:
    """The hover's formatter of a map's value (:data:`CELL`): 4 decimals, its blank cells
    in words."""
    words = BLANK_WORDS.get(group, "no value")
    code = CELL_JS + "return Number.isNaN(cell) ? blank : cell.toFixed(4);"
    return CustomJSHover(args=dict(blank=words), code=code)


def _hover(found, layers) -> HoverTool:
    """Hover on the first data layer (points that name their sample first): its columns
    named by its own dimensions (a map's axes and value: key and query, or head and layer),
    maps by whole cell."""
    pairs = list(zip(found, layers, strict=True))
    named = [pair for pair in pairs if pair[0][0].kind == "Scatter"]
    named = [p for p in named if "sample" in getattr(p[0][1].get("source"), "data", {})]
    for (key, handles), layer in named[:1] + pairs:
        renderer = handles.get("glyph_renderer")
        if renderer is None or not hasattr(renderer, "data_source"):
            continue
        columns = list(renderer.data_source.data)
        if key.kind == "Image":
            named = isinstance(layer, hv.Image)  # a Raster is an attention map
            x, y = (d.label for d in layer.kdims[:2]) if named else ("key", "query")
            value = layer.vdims[0].label if named else "value"
            tips = [(x, "$x{0}"), (y, "$y{0}"), (value, CELL + "{custom}")]
            hover = HoverTool(renderers=[renderer], tooltips=tips)
            hover.formatters = {CELL: cell_format(key.group)}
            return hover
        elif key.kind == "Scatter" and "sample" in columns:  # a survey's points
            x, y = layer.kdims[0], layer.vdims[0]
            tips = [("sample", "@sample"), (x.label, f"@{{{x.name}}}{{0}}")]
            tips.append((y.label, f"@{{{y.name}}}{{0.0000}}"))
        elif key.kind == "HeatMap":
            tips = [("dim", "@dim"), ("key", "@key"), ("value", "@value{0.000}")]
        elif key.kind == "Rectangles" and "value" in columns:
            tips = [("index", "$index"), ("value", "@value{0.0000}")]
            if "head" in columns:
                tips.append(("head", "@head"))
        elif key.kind == "Rectangles" and "weight" in columns:
            tips = [("position", "$index"), ("weight", "@weight{0.0000}")]
        elif key.kind == "Curve":
            x, y = columns[:2]
            tips = [(x, f"@{{{x}}}{{%F %H:%M}}" if x == "time" else f"@{{{x}}}"), (y, f"@{{{y}}}")]
            hover = HoverTool(renderers=[renderer], tooltips=tips)
            if x == "time":
                hover.formatters = {f"@{{{x}}}": "datetime"}
            return hover
        else:
            continue
        return HoverTool(renderers=[renderer], tooltips=tips)
    return HoverTool(tooltips=[])


def _table(element: hv.Table, width, height):
    table = table_model(element, width, height)
    handles = {"plot": table, "table": table}
    return table, [(_key(element), handles)]

"""A chart's axes follow what it draws, on its first draw and on every later state.

Both :func:`attnpanel.render.figures.draw` and :func:`attnpanel.render.push.write` fit a
chart's axes here, by one rule: the value axis to the layers that rescale it (bars, curves,
points) with 6 % of their span beyond each end, a clock axis to what it draws of its
sample's hours. The ranges are ``Range1d`` models the server writes (:func:`fit_axis`).
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
from bokeh.models import BasicTickFormatter, CustomJSTickFormatter, LegendItem, Range1d

from attnpanel.render.elements import Raster

CHART_PAD = 0.06  # a chart's value axis: its data, and 6 % of their span beyond each end
# values whose span is under this share of their size are one value, a float's noise, on a
# value axis (a LayerNorm's output norm had an axis 1e-6 high, the query's band off the chart)
FLAT = 1e-4
# layers that never rescale an axis: markers, spans, lanes and labels are drawn within the
# data of the others, a map's axes are its cells, a table has none
NEVER_RESCALE = (
    *(hv.HSpan, hv.VSpan, hv.HSpans, hv.VSpans, hv.VLine, hv.HLine, hv.Labels),
    *(hv.Image, hv.HeatMap, Raster, hv.Table),
)
# A bar chart's value axis keeps one width whatever its scale: BokehJS lays the whole page
# out again when an axis's labels change width (55-70 ms on a 2-core machine, in the frame
# that repaints the chart), and the query's weights bars take a new scale in the very
# frame that repaints the map after a head, mask or query change. Its labels are written
# as Bokeh writes them (plain decimals, never 7.000e-3) in a fixed-width font, right-aligned
# to STEADY_CHARS characters (a query's weights over up to ~2,000 keys always fit: their
# largest is 1/2000 or more; a longer label, -0.0015 say, is shown whole and widens the axis).
STEADY_CHARS = 6
STEADY_JS = """
this.labels ??= plain.doFormat(ticks, {loc: 0});
return this.labels[index].padStart(chars);
"""


def chart_extent(layer) -> tuple[float, float] | None:
    """The value (y) extent of a chart's layer, to which its axis fits; None where the layer
    sits on a fixed axis (outlines, token boxes, markers, maps, tables) or draws nothing."""
    if isinstance(layer, NEVER_RESCALE):
        return None
    if isinstance(layer, hv.Rectangles):
        if layer.group != "Vector":
            return None  # an outline or token boxes: their axis is fixed
        values = np.concatenate([layer.dimension_values("y0"), layer.dimension_values("y1")])
    else:
        values = layer.dimension_values(1)
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    return (float(values.min()), float(values.max())) if len(values) else None


def time_extent(layer) -> tuple[float, float] | None:
    """What a layer draws on a clock (milliseconds since the epoch, first to last: a curve's
    times, the edges of the weights' band), or None for a layer whose x is not time."""
    if isinstance(layer, NEVER_RESCALE):
        return None  # markers at one time: drawn within the others
    names = ("x0", "x1") if isinstance(layer, hv.Rectangles) else (0,)
    xs = np.concatenate([np.asarray(layer.dimension_values(n)) for n in names])
    if not len(xs) or not np.issubdtype(xs.dtype, np.datetime64):
        return None
    xs = xs[~np.isnat(xs)]
    return (axis_number(xs.min()), axis_number(xs.max())) if len(xs) else None


def fit_axis(fig, axis: str, extent: tuple[float, float], pad: float = CHART_PAD) -> None:
    """Fit a chart's ``x`` or ``y`` axis to ``extent``, with ``pad`` of its span beyond each
    end (a value axis of one positive value: from 0, :func:`shown_extent`; all-equal values
    otherwise: 1 either side), never below 0 for values that are not, its reset included.

    The range is a ``Range1d`` the server writes: BokehJS keeps a ``DataRange1d``'s start
    and end for ever once a document arrives with them set, so a range written into one
    before the page loads (a link's sample) would stay the first state's in every later one.
    """
    lo, hi = shown_extent(*extent) if axis == "y" else extent
    margin = pad * (hi - lo) if hi > lo else 1.0
    start, end = lo - margin, hi + margin
    if lo >= 0:
        start = max(start, 0.0)  # a non-negative quantity on a non-negative axis
    name = f"{axis}_range"
    rng = getattr(fig, name)
    if not isinstance(rng, Range1d):
        setattr(fig, name, Range1d(start=start, end=end, reset_start=start, reset_end=end))
        return
    rng.update(start=start, end=end, reset_start=start, reset_end=end)


def shown_extent(lo: float, hi: float) -> tuple[float, float]:
    """What a value axis shows of data from ``lo`` to ``hi``, before its padding: the data,
    or from 0 for one positive value (a span under :data:`FLAT` of its size: float noise)."""
    if lo > 0 and hi - lo <= FLAT * hi:
        return 0.0, hi
    return lo, hi


FIXED_AXES = "fixed axes"  # a layer's handles: the axes its figure was drawn with fixed
DRAWN_EXTENT = "extent"  # a layer's handles: what it draws, (values, clock), kept for its figure
LEGEND_ITEM = "legend item"  # a layer's handles: its entry in its figure's legend


def extents_of(layer) -> tuple:
    """What a layer draws on a chart's value axis and on its clock (each None where it
    does not rescale that axis), kept in its handles under :data:`DRAWN_EXTENT`."""
    return chart_extent(layer), time_extent(layer)


def fit_chart(fig, handles) -> None:
    """Fit a chart's axes to what every layer shown in it draws now (the handles of each:
    several views may share one figure, such as the curves and the weights' band): the
    value axis to the layers that rescale it (:func:`chart_extent`), a clock axis to what
    it draws of the sample's hours. An axis stays as it is where no layer rescales it
    (Bokeh's own range of data that never change) or where the figure was drawn with it
    fixed (:data:`FIXED_AXES`: a map's, given limits, a range shared with other plots)."""

    def visible(h) -> bool:
        return getattr(h.get("glyph_renderer"), "visible", True)

    mine = [h for h in handles if h.get("plot") is fig]
    fixed = set().union(*(h.get(FIXED_AXES, ()) for h in mine))
    shown = [h[DRAWN_EXTENT] for h in mine if DRAWN_EXTENT in h and visible(h)]
    values = [e[0] for e in shown if e[0] is not None]
    if values and "y" not in fixed:
        fit_axis(fig, "y", (min(e[0] for e in values), max(e[1] for e in values)))
    times = [e[1] for e in shown if e[1] is not None]
    if times and "x" not in fixed:  # a new sample covers other hours: unpadded
        fit_axis(fig, "x", (min(e[0] for e in times), max(e[1] for e in times)), pad=0.0)


def legend_entry(handles, label: str, renderers: list) -> LegendItem:
    """A layer's entry in its figure's legend, kept in its handles (:data:`LEGEND_ITEM`),
    shown as the layer is (:func:`shown_by_server`)."""
    visible = handles["glyph_renderer"].visible
    handles[LEGEND_ITEM] = item = LegendItem(label=label, renderers=renderers, visible=visible)
    return item


def follow_legend(fig, handles) -> None:
    """Fit ``fig``'s axes again (:func:`fit_chart`) whenever one of its layers is shown or
    hidden, from its legend in the browser too: a curve shown again from the legend was
    drawn beyond an axis fitted without it, until the next state."""

    def refit(attr, old, new) -> None:
        fit_chart(fig, handles)

    for h in handles:
        if LEGEND_ITEM in h:
            h["glyph_renderer"].on_change("visible", refit)


def shown_by_server(handles, shown: bool) -> None:
    """Show or hide a layer the server draws, and its legend entry with it: a layer the
    server hides is no longer written (a reference series switched off keeps the sample it
    was drawn for), and its legend entry showed it again, another sample's, over this one.

    A layer the user hid from its legend stays hidden when the server shows it again (a
    new sample brought every hidden curve back), and stays in the legend to be shown."""
    item = handles.get(LEGEND_ITEM)
    renderer = handles["glyph_renderer"]
    hidden_by_user = item is not None and item.visible and not renderer.visible
    renderer.visible = shown and not hidden_by_user
    if item is not None:
        item.visible = shown


def steady_labels(axis, chars: int = STEADY_CHARS) -> None:
    """Write ``axis``'s labels at one width whatever the scale (see :data:`STEADY_CHARS`)."""
    plain = BasicTickFormatter(use_scientific=False)
    axis.formatter = CustomJSTickFormatter(args=dict(plain=plain, chars=chars), code=STEADY_JS)
    axis.major_label_text_font = "monospace"


def axis_number(value) -> float | None:
    """Bokeh's number for an axis value: datetimes become milliseconds since the epoch; a
    value that has none (None, NaT: a named token's time) is None."""
    if value is None or (isinstance(value, np.datetime64) and np.isnat(value)):
        return None
    if isinstance(value, np.datetime64):
        return float(value.astype("datetime64[ns]").astype(np.int64) / 1e6)
    return float(value)

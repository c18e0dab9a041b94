"""Writing new data into Bokeh models already on the page, in place.

:func:`attnpanel.render.figures.draw` builds a figure once from a HoloViews element and
hands back its models (source, glyph, colour mapper ...) under a
:class:`~attnpanel.render.elements.PlotKey`; :func:`write` takes the next element of the
same view and writes its data into those models, so a served page updates a plot without
rebuilding it (~1 ms a plot where a ``DynamicMap`` refresh took 25-45 ms).
"""

from __future__ import annotations

import holoviews as hv
import numpy as np

from attnpanel.readouts.raster import image_limits, scale_title
from attnpanel.render.elements import CENTRED_GROUPS, PlotKey, Raster
from attnpanel.render.figures import axis_number, table_html

RECT_COLUMNS = {"left": "x0", "right": "x1", "bottom": "y0", "top": "y1"}


def layers_of(element) -> list:
    """An overlay's layers, or the element alone."""
    return list(element) if isinstance(element, hv.Overlay) else [element]


def write(drawn: dict[PlotKey, list[dict]], element, title: bool = True) -> None:
    """Write an element (or an overlay's layers) into the models drawn for one pane.

    Parameters
    ----------
    drawn : dict
        The pane's models by :class:`PlotKey`, as recorded when it was drawn.
    element : holoviews.Element or holoviews.Overlay
        The view's new element.
    title : bool
        Whether the element's label becomes the plot's title.
    """
    present = set()
    figures = {}
    for layer in layers_of(element):
        key = PlotKey.of(layer)
        present.add(key)
        if key.group == "Lanes":
            continue  # the lane shading never changes
        for handles in drawn.get(key, []):
            # a section that drew its own models says how they take new data
            extent = handles.get("push", push)(handles, layer)
            figure = handles["plot"]
            if "glyph_renderer" in handles:
                handles["glyph_renderer"].visible = True
            if extent is not None:
                # a layer on a fixed axis (None) beside one that rescales it
                lo, hi = figures.get(id(figure), (figure, None))[1] or (np.inf, -np.inf)
                figures[id(figure)] = (figure, (min(lo, extent[0]), max(hi, extent[1])))
            else:
                figures.setdefault(id(figure), (figure, None))
    # Reference curves switched off are hidden, but only by a redraw of the curves
    # themselves: the query marker shares their pane and must not hide them.
    redrawn_sequence = any(key.group == "Sequence" for key in present)
    for key, found in drawn.items():
        if redrawn_sequence and key.group == "Sequence" and key not in present:
            for handles in found:
                handles["glyph_renderer"].visible = False
    for figure, extent in figures.values():
        if title:
            figure.title.text = element.label
        # all-equal values (empty mass bars: zeros) keep the axis they were drawn with
        if extent is not None and np.isfinite(extent).all() and extent[1] > extent[0]:
            pad = 0.06 * (extent[1] - extent[0]) or 1.0
            figure.y_range.start, figure.y_range.end = extent[0] - pad, extent[1] + pad


def push(handles: dict, element):
    """Write one element's data into its rendered Bokeh models; return its y extent."""
    if isinstance(element, hv.Table):
        handles["table"].text = table_html(element)
        return None
    glyph = handles.get("glyph")
    if isinstance(element, hv.HSpan):
        glyph.bottom, glyph.top = (axis_number(v) for v in element.data)
        return None
    if isinstance(element, hv.VLine):
        glyph.location = axis_number(element.data)
        return None
    source = handles["source"]
    if isinstance(element, Raster):
        left, bottom, right, top = element.bounds
        image = element.values
        source.data = dict(
            image=[image], x=[left], y=[bottom], dw=[right - left], dh=[top - bottom]
        )
        mapper = handles.get("color_mapper")
        if mapper is not None:
            mapper.low, mapper.high = image_limits(image, element.group in CENTRED_GROUPS)
        colorbar = handles.get("colorbar")
        if colorbar is not None and colorbar.title:  # a titled bar states the rule
            label = element.value_label or handles.get("colorbar_label", "")
            colorbar.title = scale_title(label, mapper.low)
        hover = handles.get("hover")
        if element.value_label and hover is not None and hover.tooltips:
            *place, (_, field) = hover.tooltips  # the value's name: what the map now shows
            if hover.tooltips[-1][0] != element.value_label:
                hover.tooltips = [*place, (element.value_label, field)]
        return None
    if isinstance(element, hv.HeatMap):
        values = element.dimension_values("value")
        data = {
            "dim": element.dimension_values("dim"),
            "key": element.dimension_values("key"),
            "zvalues": values,
            "value": values,
        }
        old = source.data.get("width")
        data["width"] = old if old is not None and len(old) == len(values) else np.ones(len(values))
        source.data = {k: v for k, v in data.items() if k in source.data}
        # Reversed, as HoloViews lays them out with an inverted axis: most attended on top.
        handles["y_range"].factors = [str(k) for k in dict.fromkeys(data["key"])][::-1]
        mapper = handles["color_mapper"]
        mapper.low, mapper.high = image_limits(np.asarray(values, dtype=float))
        return None
    columns = element.data if isinstance(element.data, dict) else {}
    data = {}
    for column in source.data:
        name = RECT_COLUMNS.get(column, column) if isinstance(element, hv.Rectangles) else column
        data[column] = columns[name] if name in columns else element.dimension_values(name)
    source.data = data
    if isinstance(element, hv.Rectangles):
        if element.group != "Vector":
            return None  # an outline or token boxes: their axis is fixed
        return float(np.min(data["bottom"])), float(np.max(data["top"]))
    xs = element.dimension_values(0)
    if len(xs) and np.issubdtype(np.asarray(xs).dtype, np.datetime64):
        # A new sample covers other hours: the time axis follows it.
        handles["x_range"].start, handles["x_range"].end = (
            axis_number(xs.min()),
            axis_number(xs.max()),
        )
    values = element.dimension_values(1)
    if not np.isfinite(values).any():
        return None  # nothing drawn (a prediction that could not be made): the range stays
    return float(np.nanmin(values)), float(np.nanmax(values))

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
from attnpanel.render.axes import (
    DRAWN_EXTENT,
    axis_number,
    extents_of,
    fit_chart,
    shown_by_server,
)
from attnpanel.render.elements import CENTRED_GROUPS, PlotKey, Raster
from attnpanel.render.tables import write_table
from attnpanel.render.titles import fit_title

RECT_COLUMNS = {"left": "x0", "right": "x1", "bottom": "y0", "top": "y1"}
# A layer's handles: what the server calls once it has written the layer's figure, for a
# layer the page's scripts redraw themselves too (``sync: false``, unknown to the server's
# models): Bokeh sends only what changes on the server, so a draw equal to the server's last
# one would leave the browser's own (:class:`attnpanel.render.client_bars.ClientBars`).
REDRAWN_BY_BROWSER = "redrawn by the browser"


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
            own = handles.get("push")  # a section that drew its own models writes them
            (own or push)(handles, layer)
            if own is None:
                handles[DRAWN_EXTENT] = extents_of(layer)
            figure = handles["plot"]
            if "glyph_renderer" in handles:
                shown_by_server(handles, True)
            figures[id(figure)] = figure
    # Reference curves switched off are hidden, but only by a redraw of the curves
    # themselves: the query marker shares their pane and must not hide them.
    redrawn_sequence = any(key.group == "Sequence" for key in present)
    for key, found in drawn.items():
        if redrawn_sequence and key.group == "Sequence" and key not in present:
            for handles in found:
                shown_by_server(handles, False)
    every = [handles for found in drawn.values() for handles in found]
    for figure in figures.values():
        if title:
            figure.title.text = fit_title(figure, element.label)
        fit_chart(figure, every)  # what every view of the figure draws now (a table: nothing)
    for handles in every:
        if REDRAWN_BY_BROWSER in handles and id(handles["plot"]) in figures:
            handles[REDRAWN_BY_BROWSER]()


def name_map(handles: dict, value_label: str, low: float, hovers=()) -> None:
    """The words around a map: its colour bar's title (what the map shows and the colour
    rule its scale follows, from ``low``) and the value's name in its hover (and in
    ``hovers``, other hover tools over the same map)."""
    colorbar = handles.get("colorbar")
    if colorbar is not None and colorbar.title:  # a titled bar states the rule
        colorbar.title = scale_title(value_label or handles.get("colorbar_label", ""), low)
    for hover in (handles.get("hover"), *hovers):
        if value_label and hover is not None and hover.tooltips:
            *place, (_, field) = hover.tooltips  # the value's name: what the map now shows
            if hover.tooltips[-1][0] != value_label:
                hover.tooltips = [*place, (value_label, field)]


def push(handles: dict, element) -> None:
    """Write one element's data into its rendered Bokeh models (their axes: :func:`write`)."""
    if isinstance(element, hv.Table):
        write_table(handles["table"], element)
        return
    glyph = handles.get("glyph")
    if isinstance(element, hv.HSpan):
        glyph.bottom, glyph.top = (axis_number(v) for v in element.data)
        return
    if isinstance(element, hv.VLine):
        glyph.location = axis_number(element.data)
        return
    if isinstance(element, hv.VSpan):
        left, right = (axis_number(v) for v in element.data)
        glyph.update(left=left, right=right, visible=left is not None)
        return
    source = handles["source"]
    if isinstance(element, (Raster, hv.Image)):  # a Raster on the live path, else an Image
        if isinstance(element, Raster):
            left, bottom, right, top = element.bounds
            image = element.values
        else:  # a survey's density: rows by ascending value, as it was drawn
            left, bottom, right, top = element.bounds.lbrt()
            image = element.dimension_values(2, flat=False)
        source.data = dict(
            image=[image], x=[left], y=[bottom], dw=[right - left], dh=[top - bottom]
        )
        mapper = handles.get("color_mapper")
        if mapper is not None:
            mapper.low, mapper.high = image_limits(image, element.group in CENTRED_GROUPS)
            # a Raster's value label names the stage
            name_map(handles, getattr(element, "value_label", None) or "", mapper.low)
        return
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
        return
    columns = element.data if isinstance(element.data, dict) else {}
    data = {}
    for column in source.data:
        name = RECT_COLUMNS.get(column, column) if isinstance(element, hv.Rectangles) else column
        data[column] = columns[name] if name in columns else element.dimension_values(name)
    source.data = data

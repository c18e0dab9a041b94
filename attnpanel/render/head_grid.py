"""Every head's softmax map in one Bokeh figure: the head comparison's small multiples.

Eight small figures cost a session about 0.4 s of server time (Bokeh models) and the
browser about 0.1 s each to lay out and paint; one figure holding eight tiles costs a
fraction of one. Each head keeps its own image glyph, source and colour mapper, so its
colours follow the one colour rule (:func:`attnpanel.readouts.raster.image_limits`) on its own and
what a tile holds is the head's values themselves.

Tile space: head ``h``'s tile is the unit square at column ``h % columns`` and row
``h // columns``; columns are a tile and a gap apart, rows a tile, the strip of mass-share
bars under it and a gap; ``y`` grows downwards (query 0 on top, as on every
map here). Every tile shows the same window of its head's map (the linked window, snapped
to whole cells): :attr:`HeadGrid.extent` holds its ``(left, bottom, right, top)`` in key and
query positions, which the hover, the query band and the box selection translate through.
The grid has no zoom of its own: it follows the window of the linked maps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from bokeh.events import SelectionGeometry
from bokeh.models import (
    BoxAnnotation,
    BoxSelectTool,
    ColumnDataSource,
    CustomJSHover,
    GlyphRenderer,
    HoverTool,
    LinearColorMapper,
    Quad,
    Range1d,
    Text,
)
from bokeh.models import Image as ImageGlyph
from bokeh.plotting import figure as bokeh_figure

from attnpanel.readouts.raster import image_limits
from attnpanel.render.figures import CELL, cell_format
from attnpanel.render.palette import HIGHLIGHT

EXTENT = ("left", "bottom", "right", "top")  # the shown window, in positions
SHARES_NAME = "head maps shares"  # the source of the mass-share bars and their values
BOX_SOURCE = "head maps box"  # the source of the box selection's outline on every tile
NAME = "head maps"  # the figure's name in the page
WINDOW_NAME = "head maps window"  # the source holding the window the tiles show
GAP_PX = 8  # white space between two tiles
SHARE_PX = 38  # under each row of tiles: each head's share of attention mass in the box
SHARE_BAR = 0.6  # the tallest bar (a share of 1), as a fraction of the strip
TITLE_PX = 24  # the figure's title (what the box holds), as Bokeh lays a 9pt title out
MIN_WIDTH_PX = 440  # the figure's title: what the box holds
NAME_TEXT = dict(
    text_font_size="8pt", text_align="left", text_baseline="middle", text_color="#666666"
)
SHARE_TEXT = dict(text_font_size="8pt", text_align="center", text_baseline="bottom")
MAX_COLUMNS = 8  # tiles per row; more heads wrap onto further rows
BOX_STYLE = dict(
    fill_alpha=0.08, fill_color="#111111", line_color="#111111", line_width=2, line_dash="dashed"
)
QUERY_STYLE = dict(fill_color=HIGHLIGHT, fill_alpha=0.15, line_color=HIGHLIGHT, line_width=1.5)
# The hover's key and query: a tile position through the shown window to a whole cell.
POSITION_JS = """
const e = extent.data;
const f = Math.min(1, value - step * Math.floor(value / step));  // within the tile
const [lo, hi] = axis === "x" ? [e.left[0], e.right[0]] : [e.bottom[0], e.top[0]];
return String(Math.round(lo + f * (hi - lo)));
"""


def _quads(n: int) -> dict:
    return dict(left=np.zeros(n), right=np.zeros(n), bottom=np.zeros(n), top=np.zeros(n))


class HeadGrid:
    """One figure with a tile per head, a query band and a box on every tile, and under each
    tile its head's share of attention mass in the box (a bar and its value).

    Parameters
    ----------
    n_heads : int
        How many tiles.
    size : int
        A tile's side in pixels.
    palettes : list of list of str
        Each head's palette, in head order.
    extent : tuple of float
        ``(left, bottom, right, top)`` the tiles show first (the whole map).
    select_overlay : bokeh.models.BoxAnnotation
        The box-select tool's rubber band (shared look with the other maps).
    """

    def __init__(self, n_heads: int, size: int, palettes, extent, select_overlay: BoxAnnotation):
        self.n_heads = n_heads
        self.columns = max(1, min(n_heads, MAX_COLUMNS))
        self.rows = max(1, math.ceil(n_heads / self.columns))
        self.step = 1.0 + GAP_PX / size  # a tile and its gap, in tile units
        self.strip = SHARE_PX / size  # the mass-share strip under a row of tiles
        self.pitch = 1.0 + self.strip + GAP_PX / size  # from one row of tiles to the next
        # at least wide enough for the title naming the box (one or two heads' tiles are not)
        width = max(self.columns * self.step - GAP_PX / size, MIN_WIDTH_PX / size)
        height = self.rows * self.pitch - GAP_PX / size
        self.figure = bokeh_figure(
            # At most the tiles' own size; narrower (a notebook's output, a 1280 px window)
            # the figure scales down as a whole, so that every tile stays in view.
            width=round(width * size),
            height=round(height * size) + TITLE_PX,
            title=" ",
            max_width=round(width * size),
            sizing_mode="scale_width",
            x_range=Range1d(0.0, width),
            y_range=Range1d(height, 0.0),  # y grows downwards: query 0 on top
            x_axis_type=None,
            y_axis_type=None,
            toolbar_location=None,
            tools="",
            min_border=0,
            outline_line_color=None,
            output_backend="canvas",  # images: see attnpanel.render.figures.WEBGL_MIN_POINTS
            margin=(0, 5, 0, 5),
            name=NAME,
        )
        self.extent = ColumnDataSource(
            {k: [float(v)] for k, v in zip(EXTENT, extent, strict=True)}, name=WINDOW_NAME
        )
        # every tile's top-left corner, (head, 2), in tile units
        self.origins = np.array([self.origin(h) for h in range(n_heads)], dtype=float)
        self.tiles: list[dict] = [self._tile(h, palettes[h]) for h in range(n_heads)]
        self.query_band = ColumnDataSource(_quads(0))
        self.box = ColumnDataSource(_quads(0), name=BOX_SOURCE)
        for source, style in ((self.query_band, QUERY_STYLE), (self.box, BOX_STYLE)):
            self.figure.renderers.append(
                GlyphRenderer(
                    data_source=source,
                    glyph=Quad(left="left", right="right", bottom="bottom", top="top", **style),
                    level="overlay",
                )
            )
        self.shares = ColumnDataSource(
            dict(**_quads(0), color=[], x=[], y=[], text=[]), name=SHARES_NAME
        )
        self.figure.renderers.append(
            GlyphRenderer(
                data_source=self.shares,
                glyph=Quad(
                    left="left",
                    right="right",
                    bottom="bottom",
                    top="top",
                    fill_color="color",
                    line_color=None,
                ),
            )
        )
        self.figure.renderers.append(
            GlyphRenderer(
                data_source=self.shares, glyph=Text(x="x", y="y", text="text", **SHARE_TEXT)
            )
        )
        names = self.origins
        self.names = ColumnDataSource(  # each tile's head, left in the strip under it
            dict(
                x=names[:, 0] + 0.02,
                y=names[:, 1] + 1.0 + 0.55 * self.strip,
                text=[f"head {h}" for h in range(n_heads)],
            )
        )
        self.figure.renderers.append(
            GlyphRenderer(
                data_source=self.names, glyph=Text(x="x", y="y", text="text", **NAME_TEXT)
            )
        )
        self.figure.title.text_font_size = "9pt"
        self._query: float | None = None
        self._box_window: tuple | None = None
        self._select_callbacks: list[Callable] = []
        self._tools(select_overlay)

    def origin(self, head: int) -> tuple[float, float]:
        """The top-left corner of ``head``'s tile, in tile units."""
        return (head % self.columns) * self.step, (head // self.columns) * self.pitch

    def _tile(self, head: int, palette) -> dict:
        x, y = self.origin(head)
        source = ColumnDataSource(dict(image=[np.zeros((1, 1), dtype=np.float32)]))
        mapper = LinearColorMapper(palette=list(palette), low=0.0, high=1.0, nan_color="#222222")
        glyph = ImageGlyph(image="image", x=x, y=y, dw=1.0, dh=1.0, color_mapper=mapper)
        renderer = GlyphRenderer(data_source=source, glyph=glyph, name=f"head {head}")
        self.figure.renderers.append(renderer)
        return {
            "plot": self.figure,
            "source": source,
            "glyph": glyph,
            "glyph_renderer": renderer,
            "color_mapper": mapper,
            "push": self.push_tile,
        }

    def _tools(self, select_overlay: BoxAnnotation) -> None:
        renderers = [tile["glyph_renderer"] for tile in self.tiles]
        position = {
            axis: CustomJSHover(
                args=dict(extent=self.extent, step=step, axis=axis), code=POSITION_JS
            )
            for axis, step in (("x", self.step), ("y", self.pitch))
        }
        hover = HoverTool(
            renderers=renderers,
            tooltips=[
                ("", "$name"),
                ("key", "$x{custom}"),
                ("query", "$y{custom}"),
                ("weight", CELL + "{custom}"),
            ],
            formatters={"$x": position["x"], "$y": position["y"], CELL: cell_format("HeadMap")},
        )
        select = BoxSelectTool(
            renderers=renderers[:1],
            description="Box select: compare the heads' attention mass",
            overlay=select_overlay,
        )
        self.figure.add_tools(hover, select)
        self.figure.toolbar.active_drag = select
        self.figure.on_event(SelectionGeometry, self._on_select)

    # -- what the tiles show -------------------------------------------------------------

    def push_tile(self, handles: dict, raster) -> None:
        """Write a head's regridded window (a :class:`~attnpanel.render.elements.Raster`)
        into its tile."""
        handles["source"].data = dict(image=[raster.values])
        mapper = handles["color_mapper"]
        mapper.low, mapper.high = image_limits(raster.values)
        self.show_extent(raster.bounds)

    def show_extent(self, bounds) -> None:
        """The window every tile shows now, ``(left, bottom, right, top)`` in positions."""
        bounds = tuple(float(v) for v in bounds)
        if bounds != self.window_bounds:
            self.extent.data = {k: [v] for k, v in zip(EXTENT, bounds, strict=True)}
            self._draw_query()
            self._draw_box()

    @property
    def window_bounds(self) -> tuple[float, float, float, float]:
        """``(left, bottom, right, top)`` of the window the tiles show, in positions."""
        return tuple(self.extent.data[k][0] for k in EXTENT)

    def set_names(self, texts: list[str]) -> None:
        """The words under each tile ("head 3 · previous token")."""
        self.names.data = dict(self.names.data, text=list(texts))

    def set_palette(self, head: int, palette) -> None:
        """Recolour one head's tile (its colours, or grey while it is off)."""
        self.tiles[head]["color_mapper"].palette = list(palette)

    def push_query(self, handles: dict, span) -> None:
        """Band the selected query's row on every tile (an ``hv.HSpan`` of the row)."""
        low, high = (float(v) for v in span.data)
        self._query = (low + high) / 2
        self._draw_query()

    def push_shares(self, handles: dict, shares) -> None:
        """Each head's share of attention mass in the box (an
        :class:`attnpanel.app.linked.MassShares`) as a bar under its tile, with its value."""
        values = np.clip(np.asarray(shares.shares, dtype=float), 0.0, 1.0)
        if len(values) == 0:
            self.shares.data = dict(**_quads(0), color=[], x=[], y=[], text=[])
            return
        origins = self.origins[: len(values)]
        base = origins[:, 1] + 1.0 + self.strip  # the strip's bottom edge (y grows down)
        top = base - values * SHARE_BAR * self.strip
        self.shares.data = dict(
            left=origins[:, 0] + 0.45,
            right=origins[:, 0] + 0.75,
            bottom=base,
            top=top,
            color=list(shares.colors),
            x=origins[:, 0] + 0.6,
            y=top - 0.02,
            text=[f"{v:.2f}" for v in values],
        )

    def drawn_shares(self) -> np.ndarray:
        """The shares the bars under the tiles show now (their heights), in head order."""
        data = self.shares.data
        return (np.asarray(data["bottom"]) - np.asarray(data["top"])) / (SHARE_BAR * self.strip)

    def mark_box(self, box) -> None:
        """Outline ``((key0, key1), (query0, query1))`` on every tile, or nothing (None)."""
        self._box_window = box
        self._draw_box()

    def _fractions(self, low: float, high: float, axis: str) -> tuple[float, float] | None:
        left, bottom, right, top = self.window_bounds
        start, stop = (left, right) if axis == "x" else (bottom, top)
        a = (low - start) / (stop - start)
        b = (high - start) / (stop - start)
        if b <= 0 or a >= 1:
            return None
        return max(a, 0.0), min(b, 1.0)

    def _rects(self, fx, fy) -> dict:
        if fx is None or fy is None:
            return _quads(0)
        origins = self.origins
        return dict(
            left=origins[:, 0] + fx[0],
            right=origins[:, 0] + fx[1],
            bottom=origins[:, 1] + fy[0],
            top=origins[:, 1] + fy[1],
        )

    def _draw_query(self) -> None:
        if self._query is None:
            return
        fy = self._fractions(self._query - 0.5, self._query + 0.5, "y")
        self.query_band.data = self._rects((0.0, 1.0), fy)

    def _draw_box(self) -> None:
        if self._box_window is None:
            self.box.data = _quads(0)
            return
        (k0, k1), (q0, q1) = self._box_window
        self.box.data = self._rects(self._fractions(k0, k1, "x"), self._fractions(q0, q1, "y"))

    # -- box selection -------------------------------------------------------------------

    def on_select(self, callback: Callable) -> None:
        """Call ``callback(key_range, query_range)`` when a box is drawn on a tile."""
        self._select_callbacks.append(callback)

    def to_window(self, x_range, y_range) -> tuple[tuple, tuple]:
        """A box in tile units, drawn on one tile, as ``(key_range, query_range)``.

        The tile is the one under the box's centre; the box is clipped to that tile.
        """
        x0, x1 = sorted(float(v) for v in x_range)
        y0, y1 = sorted(float(v) for v in y_range)
        column = min(self.columns - 1, max(0, math.floor((x0 + x1) / 2 / self.step)))
        row = min(self.rows - 1, max(0, math.floor((y0 + y1) / 2 / self.pitch)))
        left, bottom, right, top = self.window_bounds

        def position(v, origin, start, stop):
            return start + min(1.0, max(0.0, v - origin)) * (stop - start)

        ox, oy = column * self.step, row * self.pitch
        keys = (position(x0, ox, left, right), position(x1, ox, left, right))
        queries = (position(y0, oy, bottom, top), position(y1, oy, bottom, top))
        return keys, queries

    def select(self, x_range, y_range) -> None:
        """A box drawn in tile units (as the box-select tool reports it): tell the
        :meth:`on_select` callbacks its keys and queries."""
        box = self.to_window(x_range, y_range)
        for callback in self._select_callbacks:
            callback(*box)

    def _on_select(self, event) -> None:
        geometry = event.geometry or {}
        if event.final and geometry.get("type") == "rect":
            self.select((geometry["x0"], geometry["x1"]), (geometry["y0"], geometry["y1"]))

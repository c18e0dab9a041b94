"""The query-key embedding of one head drawn by datashader, and the marks a box of its points
puts on the attention matrix.

The points (:func:`attnpanel.readouts.embedding.qk_embedding`) are aggregated to the plot's
pixels by datashader: every other sample's points are grey context (darker where more fall
on one pixel); the shown sample's queries and keys each take a ramp of one hue by position,
light at the first position and dark at the last (the mean position of the points on a
pixel). The shown sample's points are spread to 3 x 3 pixels, so that a lone point is seen;
its queries are drawn over its keys. The plot is square and the plane keeps its proportions:
a query near a key is near it in the head's own space.
"""

from __future__ import annotations

from dataclasses import dataclass

import datashader as dsh
import datashader.transfer_functions as tf
import holoviews as hv
import numpy as np
import pandas as pd
import xarray as xr
from bokeh.events import SelectionGeometry
from bokeh.models import (
    BoxAnnotation,
    BoxSelectTool,
    ColorBar,
    ColumnDataSource,
    GlyphRenderer,
    HStrip,
    ImageRGBA,
    LinearColorMapper,
    Range1d,
    Rect,
    VStrip,
    WheelZoomTool,
)
from bokeh.plotting import figure as bokeh_figure

from attnpanel.readouts.embedding import matrix_positions, sample_label
from attnpanel.render.head_grid import BOX_STYLE  # the page's look of a box selection
from attnpanel.render.titles import fit_title

EMBEDDING_SIZE = 360  # the plot's square frame, px
QUERY_COLORS = ("#cbb8e8", "#3f007d")  # first to last query position: light to dark violet
KEY_COLORS = ("#fdc38d", "#8c2d04")  # first to last key position: light to dark orange
CONTEXT_COLORS = ("#e6e6e6", "#9c9c9c")  # the other samples: one point to many on a pixel
MARGIN = 0.05  # around every point, a fraction of the window's side
EMBEDDING_NAME = "query-key embedding"  # the figure's name in the page
MARKS_NAMES = ("embedding box queries", "embedding box keys")  # the matrix marks' sources
WASH_ALPHA = 0.45  # white over the matrix's rows and columns outside a box
TICK_PX = 7  # the solid ticks at the matrix's edge
# the 3 x 3 spread of a shown point: its own pixel first, then the nearest neighbours
NEIGHBOURS = ((0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (1, -1), (-1, 1), (-1, -1))


def ramp(colors: tuple[str, str], n: int = 256) -> list[str]:
    """``n`` colours from the first to the last, linear in RGB (as datashader blends)."""
    ends = np.array([[int(c[i : i + 2], 16) for i in (1, 3, 5)] for c in colors], dtype=float)
    steps = np.linspace(0.0, 1.0, n)[:, None]
    rgb = np.rint(ends[0] + steps * (ends[1] - ends[0])).astype(int)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in rgb]


def full_window(embedding: xr.Dataset) -> tuple[tuple[float, float], tuple[float, float]]:
    """The square window around every point of the embedding, ``((x0, x1), (y0, y1))``."""
    x, y = embedding["x"].values, embedding["y"].values
    centre = ((x.min() + x.max()) / 2, (y.min() + y.max()) / 2)
    side = max(np.ptp(x), np.ptp(y))
    half = (side if side > 0 else 1.0) * (0.5 + MARGIN)
    return tuple((float(c - half), float(c + half)) for c in centre)


@dataclass
class EmbeddingImage:
    """The embedding as the page draws it: one RGBA image of the window."""

    rgba: np.ndarray  # (height, width) uint32 RGBA, rows by ascending y
    window: tuple  # ((x0, x1), (y0, y1)) the image covers
    full: tuple  # the window of every point (where the plot's reset goes)
    label: str
    counts: tuple[int, int]  # query and key positions: the colour bars run to these - 1
    axes: tuple[str, str] = ("", "")  # the x and y axes' labels
    box: tuple | None = None  # ((x0, x1), (y0, y1)) of the box selection, or None
    group: str = "Embedding"

    def element(self) -> hv.RGB:
        """The image as an ``hv.RGB`` (for a notebook's ``dynamic_map``)."""
        channels = self.rgba.view(np.uint8).reshape(*self.rgba.shape, 4)[::-1]
        (x0, x1), (y0, y1) = self.window
        return hv.RGB(channels, bounds=(x0, y0, x1, y1), label=self.label, vdims=list("RGBA"))


def empty_image(window, full, label: str, counts=(1, 1), size: int = EMBEDDING_SIZE):
    """Nothing drawn over ``window``, and why in its title."""
    return EmbeddingImage(np.zeros((size, size), np.uint32), window, full, label, counts)


def embedding_image(
    trace: xr.Dataset,
    embedding: xr.Dataset,
    sample: int,
    window=None,
    size: int = EMBEDDING_SIZE,
    box=None,
) -> EmbeddingImage:
    """The embedding's points aggregated by datashader to ``size x size`` pixels.

    Parameters
    ----------
    trace : xarray.Dataset
        The one layer the embedding was made from (positions are placed on its matrix).
    embedding : xarray.Dataset
        What :func:`~attnpanel.readouts.embedding.qk_embedding` returned.
    sample : int
        The batch index drawn in colour; the other samples are grey.
    window : ((float, float), (float, float)), optional
        The part of the plane to draw (a zoom); every point by default.
    size : int
        Pixels along each side.
    box : optional
        The box selection to draw on it.

    Returns
    -------
    EmbeddingImage
    """
    full = full_window(embedding)
    window = full if window is None else tuple(tuple(sorted(map(float, r))) for r in window)
    counts = (trace.sizes["query"], trace.sizes["key"])
    shown = embedding["sample"].values == sample_label(trace, sample)
    kinds = embedding["kind"].values
    points = pd.DataFrame(
        {
            "x": embedding["x"].values,
            "y": embedding["y"].values,
            "position": matrix_positions(trace, embedding).astype(np.float64),
        }
    )
    canvas = dsh.Canvas(plot_width=size, plot_height=size, x_range=window[0], y_range=window[1])
    layers = []
    context = canvas.points(points[~shown], "x", "y", dsh.count())
    if context.values.any():
        layers.append(tf.shade(context, cmap=ramp(CONTEXT_COLORS), how="log"))
    for kind, colors, count in (("key", KEY_COLORS, counts[1]), ("query", QUERY_COLORS, counts[0])):
        mean = canvas.points(points[shown & (kinds == kind)], "x", "y", dsh.mean("position"))
        spread = mean.copy(data=spread_points(mean.values))
        if np.isfinite(spread.values).any():
            span = (0, max(count - 1, 1))
            layers.append(tf.shade(spread, cmap=ramp(colors), how="linear", span=span))
    rgba = over([np.asarray(layer.data, np.uint32) for layer in layers], size)
    others = " · grey: the other samples" if (~shown).any() else ""
    label = f"head {embedding.attrs.get('head', '')}, sample {sample}{others}"
    return EmbeddingImage(rgba, window, full, label, counts, axis_labels(embedding), box)


def axis_labels(embedding: xr.Dataset) -> tuple[str, str]:
    """``("PC 1 (66% of the variance)", "PC 2 (15%)")``, or ``("UMAP 1", "UMAP 2")``."""
    variance = embedding.attrs.get("explained_variance")
    if embedding.attrs.get("method", "pca") != "pca" or variance is None:
        return ("UMAP 1", "UMAP 2")
    return (f"PC 1 ({100 * variance[0]:.0f}% of the variance)", f"PC 2 ({100 * variance[1]:.0f}%)")


def over(layers: list[np.ndarray], size: int) -> np.ndarray:
    """Opaque RGBA layers (alpha 255 where painted, 0 elsewhere), each drawn over the ones
    before it. (``datashader.transfer_functions.stack`` does the same for any alpha, but
    importing its compositing compiles it: 3.8 s on this 2-core machine.)"""
    out = np.zeros((size, size), np.uint32)
    for layer in layers:
        painted = (layer >> 24) > 0
        out[painted] = layer[painted]
    return out


def spread_points(values: np.ndarray) -> np.ndarray:
    """Each empty pixel (NaN) takes the value of its nearest non-empty neighbour within one
    pixel: every point then covers 3 x 3 pixels (its own value first)."""
    out = values.copy()
    rows, cols = values.shape
    padded = np.pad(values, 1, constant_values=np.nan)
    for dy, dx in NEIGHBOURS:
        shifted = padded[1 + dy : 1 + dy + rows, 1 + dx : 1 + dx + cols]
        empty = np.isnan(out) & ~np.isnan(shifted)
        out[empty] = shifted[empty]
    return out


def _image_data(image: EmbeddingImage) -> dict:
    (x0, x1), (y0, y1) = image.window
    return dict(image=[image.rgba], x=[x0], y=[y0], dw=[x1 - x0], dh=[y1 - y0])


class EmbeddingFigure:
    """The embedding's plot: the image, its box selection, a colour bar per kind.

    A drag draws a box (the box-select tool is the active drag), the wheel zooms; the
    plot's reset goes back to every point.

    Parameters
    ----------
    image : EmbeddingImage
        The first image.
    box_handles : bokeh.models.BoxInteractionHandles, optional
        Shared by the page's box annotations.
    """

    def __init__(self, image: EmbeddingImage, box_handles=None):
        (x0, x1), (y0, y1) = image.window
        height, width = image.rgba.shape
        self.figure = bokeh_figure(
            frame_width=width,
            frame_height=height,
            x_range=Range1d(x0, x1),
            y_range=Range1d(y0, y1),
            tools="pan,wheel_zoom,reset,save",
            toolbar_location="above",
            output_backend="canvas",  # one image: see attnpanel.render.figures.WEBGL_MIN_POINTS
            min_border=5,
            title=image.label,
            name=EMBEDDING_NAME,
        )
        self.figure.title.text_font_size = "10pt"
        self.figure.title.text = fit_title(self.figure, image.label)
        self.source = ColumnDataSource(_image_data(image))
        self.renderer = GlyphRenderer(
            data_source=self.source,
            glyph=ImageRGBA(image="image", x="x", y="y", dw="dw", dh="dh"),
        )
        self.figure.renderers.append(self.renderer)
        select = BoxSelectTool(
            renderers=[self.renderer],
            description="Box select: mark these queries and keys on the matrix",
        )
        self.figure.add_tools(select)
        self.figure.toolbar.active_drag = select
        self.figure.toolbar.active_scroll = self.figure.select_one({"type": WheelZoomTool})
        self.figure.toolbar.autohide = True
        handles = {} if box_handles is None else {"handles": box_handles}
        self.box = BoxAnnotation(
            left=0.0,
            right=0.0,
            bottom=0.0,
            top=0.0,
            level="overlay",
            visible=False,
            editable=False,
            **BOX_STYLE,
            **handles,
        )
        self.figure.add_layout(self.box)
        self.mappers = []
        for title, colors in (("query position", QUERY_COLORS), ("key position", KEY_COLORS)):
            mapper = LinearColorMapper(palette=ramp(colors), low=0, high=1)
            self.mappers.append(mapper)
            bar = ColorBar(
                color_mapper=mapper,
                orientation="horizontal",
                title=title,
                title_text_font_size="8pt",
                title_text_font_style="normal",
                major_label_text_font_size="8pt",
                height=8,
                padding=2,
                margin=4,
            )
            self.figure.add_layout(bar, "below")
        self._full = None
        self._quiet = False
        self.handles = {"plot": self.figure, "source": self.source, "push": self.push}
        self.push(self.handles, image)

    @property
    def window(self) -> tuple:
        """``((x0, x1), (y0, y1))`` the plot shows now."""
        x, y = self.figure.x_range, self.figure.y_range
        return ((x.start, x.end), (y.start, y.end))

    def push(self, handles: dict, image: EmbeddingImage) -> None:
        """Draw the next image (its window, its box); a new embedding resets the view."""
        self.source.data = _image_data(image)
        if image.full != self._full:
            self._full = image.full
            self._quiet = True  # not a zoom of the user's
            try:
                ranges = (self.figure.x_range, self.figure.y_range)
                for rng, (lo, hi), reset in zip(ranges, image.window, image.full, strict=True):
                    rng.update(start=lo, end=hi, reset_start=reset[0], reset_end=reset[1])
            finally:
                self._quiet = False
        self.figure.xaxis.axis_label, self.figure.yaxis.axis_label = image.axes
        for mapper, count in zip(self.mappers, image.counts, strict=True):
            mapper.high = max(count - 1, 1)
        if image.box is None:
            self.box.visible = False
        else:
            (left, right), (bottom, top) = image.box
            self.box.update(left=left, right=right, bottom=bottom, top=top, visible=True)

    def on_window(self, callback) -> None:
        """Call ``callback(window)`` when the user pans or zooms."""

        def changed(_attr, _old, _new):
            if not self._quiet:
                callback(self.window)

        for rng in (self.figure.x_range, self.figure.y_range):
            rng.on_change("start", changed)
            rng.on_change("end", changed)

    def on_select(self, callback) -> None:
        """Call ``callback(x_range, y_range)`` when a box is drawn."""

        def selected(event):
            geometry = event.geometry or {}
            if event.final and geometry.get("type") == "rect":
                callback((geometry["x0"], geometry["x1"]), (geometry["y0"], geometry["y1"]))

        self.figure.on_event(SelectionGeometry, selected)


@dataclass
class BoxedPositions:
    """The queries and keys of a box of the embedding, as the matrix marks them."""

    queries: np.ndarray  # the matrix's rows, sorted
    keys: np.ndarray  # its columns, sorted
    label: str  # what the box holds, or how to draw one
    counts: tuple[int, int] | None = None  # the matrix's rows and columns; None: no box
    group: str = "EmbeddingBox"

    def outside(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows and columns not in the box (none without a box)."""
        if self.counts is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return tuple(
            np.setdiff1d(np.arange(count), inside)
            for count, inside in zip(self.counts, (self.queries, self.keys), strict=True)
        )

    def element(self) -> hv.Overlay:
        """The rows and columns outside the box as HoloViews spans (a notebook's
        ``dynamic_map``)."""
        rows, cols = (position_runs(found) for found in self.outside())
        return hv.Overlay(
            [hv.HSpans(list(zip(*rows, strict=True))), hv.VSpans(list(zip(*cols, strict=True)))],
            label=self.label,
        )


def position_runs(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive positions as cell edges: ``(starts - 0.5, ends + 0.5)``."""
    positions = np.unique(np.asarray(positions, dtype=np.int64))
    if positions.size == 0:
        return np.zeros(0), np.zeros(0)
    breaks = np.nonzero(np.diff(positions) > 1)[0]
    starts = positions[np.concatenate([[0], breaks + 1])]
    ends = positions[np.concatenate([breaks, [positions.size - 1]])]
    return starts - 0.5, ends + 0.5


def mark_matrix(figure) -> dict:
    """Add to a matrix figure the marks of a box's queries and keys: the rows and columns
    outside the box washed out (a white band over each run of them, so a cell of neither is
    washed twice and a boxed query's cell on a boxed key keeps its colour), and a solid tick
    at the map's edge for each run in the box (violet at the left for queries, orange at the
    top for keys). The returned handles take :class:`BoxedPositions` (``push``)."""
    rows = ColumnDataSource(dict(y=[], height=[], edge=[]), name=MARKS_NAMES[0])
    cols = ColumnDataSource(dict(x=[], width=[], edge=[]), name=MARKS_NAMES[1])
    rows_out, cols_out = ColumnDataSource(dict(y0=[], y1=[])), ColumnDataSource(dict(x0=[], x1=[]))
    for source, glyph in (
        (rows_out, HStrip(y0="y0", y1="y1")),
        (cols_out, VStrip(x0="x0", x1="x1")),
    ):
        glyph.update(fill_color="white", fill_alpha=WASH_ALPHA, line_color=None)
        figure.renderers.append(GlyphRenderer(data_source=source, glyph=glyph))
    for source, color, place in (
        (rows, QUERY_COLORS[1], dict(x="edge", y="y", height="height")),
        (cols, KEY_COLORS[1], dict(x="x", y="edge", width="width")),
    ):
        across = "width" if "height" in place else "height"
        tick = Rect(
            **place,
            **{across: 2 * TICK_PX, f"{across}_units": "screen"},  # half of it in the frame
            fill_color=color,
            line_color=None,
        )
        # glyph level: clipped to the frame, drawn over the map
        figure.renderers.append(GlyphRenderer(data_source=source, glyph=tick))

    def push(handles: dict, marks: BoxedPositions) -> None:
        for source, found, (centre, size) in (
            (rows, marks.queries, ("y", "height")),
            (cols, marks.keys, ("x", "width")),
        ):
            starts, ends = position_runs(found)
            source.data = {
                centre: (starts + ends) / 2,
                size: ends - starts,
                "edge": np.full(len(starts), -0.5),  # the map's left (rows) or top (columns)
            }
        away_rows, away_cols = marks.outside()
        rows_out.data = dict(zip(("y0", "y1"), position_runs(away_rows), strict=True))
        cols_out.data = dict(zip(("x0", "x1"), position_runs(away_cols), strict=True))

    return dict(plot=figure, rows=rows, cols=cols, rows_out=rows_out, cols_out=cols_out, push=push)

"""Linked zoom and box selection across the attention matrix and the per-head maps.

The large matrix, the unmasked matrix beside it and the head average share one pair of
Bokeh ranges, so a zoom or pan on any of them moves all of them in the browser at once.
The server then re-rasterizes the *visible window* of each map with datashader from the
full array, at the map's own pixel size, and writes the images into the Bokeh models
already on the page (the explorer's hot path): a zoomed map is never a magnified image.
When the window holds no more cells than the map has pixels, the image is the array's slice
itself, cell for cell. The head maps (:mod:`attnpanel.render.head_grid`, one figure of a tile per
head) follow the same window: their tiles are re-rasterized with the other maps.

A box selection (drag on a head's tile, or the box-select tool of the matrix) marks the
same region on every map and tile and shows, per head, the share of attention mass inside
it::

    share[h] = sum(weights[h, rows, cols]) / sum(weights[h, rows, :])

with ``rows`` the query positions and ``cols`` the key positions whose cells have their
centre in the box, and ``weights`` the softmax weights of the shown sample and mask: the
fraction of the selected queries' attention that goes to the selected keys (1 when they
attend only inside the box).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial

import holoviews as hv
import numpy as np
from bokeh.events import SelectionGeometry
from bokeh.models import BoxAnnotation, BoxSelectTool, WheelZoomTool

from attnpanel.app.documents import one_message
from attnpanel.app.engine import LiveEngine
from attnpanel.app.registry import LINKED_GROUPS
from attnpanel.readouts import core
from attnpanel.render import styling, views

log = logging.getLogger(__name__)

ZOOM_DEBOUNCE_MS = 25  # a wheel zoom sends a range change per wheel step: act on the last
BOX_COLOR = "#111111"
BOX_NAME = "box selection"  # the box annotation's name on every linked map
SHARE_LABEL = "mass in box / mass of its queries"
# Bokeh's box-select overlay (its DEFAULT_BOX_SELECT_OVERLAY), with the page's shared handles.
SELECT_OVERLAY = dict(
    syncable=False,
    level="overlay",
    visible=False,
    editable=True,
    left=math.nan,
    right=math.nan,
    top=math.nan,
    bottom=math.nan,
    fill_color="lightgrey",
    fill_alpha=0.5,
    line_color="black",
    line_alpha=1.0,
    line_width=2,
    line_dash=[4, 4],
)


def box_cells(x_range, y_range, n_query: int, n_key: int) -> tuple[slice, slice]:
    """Query rows and key columns whose cell centres (integer positions) lie in a box."""
    x0, x1 = sorted(float(v) for v in x_range)
    y0, y1 = sorted(float(v) for v in y_range)
    cols = slice(max(0, math.ceil(x0)), min(n_key, math.floor(x1) + 1))
    rows = slice(max(0, math.ceil(y0)), min(n_query, math.floor(y1) + 1))
    return rows, cols


def mass_share(weights: np.ndarray, x_range, y_range) -> np.ndarray:
    """Per head, the share of the box's query rows' attention mass that falls in the box.

    Parameters
    ----------
    weights : numpy.ndarray
        ``(head, query, key)`` attention weights (masked entries 0).
    x_range, y_range : tuple of float
        The box in key (x) and query (y) coordinates; cells count when their centre is in it.

    Returns
    -------
    numpy.ndarray
        ``(head,)`` float64, ``sum(w[h, rows, cols]) / sum(w[h, rows, :])``; NaN for a head
        whose selected rows carry no mass, and for a box without any cell centre.
    """
    n_heads, n_query, n_key = weights.shape
    rows, cols = box_cells(x_range, y_range, n_query, n_key)
    block = np.nan_to_num(np.asarray(weights[:, rows], dtype=np.float64))
    if block.shape[1] == 0 or cols.start >= cols.stop:
        return np.full(n_heads, np.nan)
    inside = block[:, :, cols].sum(axis=(1, 2))
    total = block.sum(axis=(1, 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, inside / np.where(total > 0, total, 1.0), np.nan)


NO_BOX_LABEL = "drag a box on a head's tile: each head's share of its queries' attention in it"


@dataclass
class MassShares:
    """Each head's share of attention mass in the box, as the head maps draw it under their
    tiles (:meth:`attnpanel.render.head_grid.HeadGrid.push_shares`); empty without a box."""

    shares: np.ndarray  # (head,) in [0, 1]; empty without a box
    colors: list  # per head: its colour, grey while off
    label: str  # what the box holds, or how to draw one
    group: str = "MassShare"

    def element(self) -> hv.Rectangles:
        """The shares as bars, for a notebook user (``explorer.dynamic_map("mass share")``)."""
        heads = np.arange(len(self.colors))
        values = self.shares if len(self.shares) else np.zeros(len(heads))
        return views.vector_bars(values, self.colors, "head", SHARE_LABEL, heads, self.label)


def mass_shares(ds, sel: core.Selection, cache, box, shares=None) -> MassShares:
    """The per-head mass shares of a box (head colours, grey when off), or none.

    ``shares(rows, cols)``, given, computes them for the box's query and key slices (a
    virtual trace, :func:`attnpanel.readouts.windows.streamed_mass_share`); by default they
    are read from the sample's weights (:func:`mass_share`).
    """
    n_heads = ds.sizes["head"]
    colors = list(styling.head_colors(np.arange(n_heads), set(sel.enabled_heads) or None))
    if box is None:
        return MassShares(np.zeros(0), colors, NO_BOX_LABEL)
    rows, cols = box_cells(*box, ds.sizes["query"], ds.sizes["key"])
    if cols.stop <= cols.start or rows.stop <= rows.start:
        return MassShares(np.zeros(0), colors, "the box holds no cell: draw a larger one")
    if shares is None:
        weights = core.stage_heads(ds, sel.with_(stage="softmax"), cache)
        shares = np.nan_to_num(mass_share(weights, *box))
    else:
        shares = shares(rows, cols)
    label = (
        f"{SHARE_LABEL}: queries {rows.start}-{rows.stop - 1} on keys {cols.start}-{cols.stop - 1}"
    )
    return MassShares(shares, colors, label)


class LinkedMaps:
    """The linked zoom and box selection of one explorer's attention maps.

    It follows every map the engine renders (:meth:`LiveEngine.on_render`): the shared
    ranges' changes re-rasterize every linked map for the new window (the engine's
    ``window``), and a box selection marks every map and sets :attr:`box`.

    Parameters
    ----------
    engine : attnpanel.app.engine.LiveEngine
        The engine that draws the maps.
    """

    def __init__(self, engine: LiveEngine):
        self.engine = engine
        self.box: tuple | None = None  # ((x0, x1), (y0, y1)) of the box selection
        self.last_zoom_ms: float | None = None  # server time of the last linked zoom
        self._box_watchers: list = []
        self._figures: list = []
        self._boxes: list = []
        self._watched: set = set()
        self._changed_at = 0.0
        self._pending_window = None
        self._scheduled = False
        self._zooming = False
        engine.on_render(self._attach)

    @property
    def window(self) -> tuple | None:
        """``((x0, x1), (y0, y1))`` shown by every linked map, or None (the whole map)."""
        return self.engine.window

    @property
    def boxes(self) -> tuple:
        """The box annotations marking the selection, one per linked map."""
        return tuple(self._boxes)

    def on_box(self, callback) -> None:
        """Call ``callback()`` after the box selection changes (set or cleared)."""
        self._box_watchers.append(callback)

    def _attach(self, figure, element, handles) -> None:
        """Link a freshly rendered map: range callbacks, box select, box annotation."""
        if not isinstance(element, hv.Image) or element.group not in LINKED_GROUPS:
            return
        if any(f is figure for f in self._figures):
            return
        self._figures.append(figure)
        self._watch_ranges(figure)
        select = BoxSelectTool(
            renderers=[handles["glyph_renderer"]],
            description="Box select: compare the heads' attention mass",
            overlay=self.select_overlay(),
        )
        figure.add_tools(select)
        if element.group == "HeadMap":
            # A small map shows no toolbar: the wheel zooms and a drag draws the box.
            figure.toolbar.active_drag = select
            wheel = [t for t in figure.tools if isinstance(t, WheelZoomTool)]
            if wheel:
                figure.toolbar.active_scroll = wheel[0]
        # Numbers from the start: Bokeh's defaults are references to the frame's edges, and
        # replacing a reference makes the document walk all its models again, per edge and
        # per map (5.3 s on the demo page for the first box selection).
        edges = dict(left=0.0, right=0.0, bottom=0.0, top=0.0)
        if self.box is not None:
            (edges["left"], edges["right"]), (edges["bottom"], edges["top"]) = self.box
        box = BoxAnnotation(
            handles=self.engine.box_handles,
            name=BOX_NAME,
            **edges,
            fill_alpha=0.08,
            fill_color=BOX_COLOR,
            line_color=BOX_COLOR,
            line_width=2,
            line_dash="dashed",
            level="overlay",
            visible=self.box is not None,
            editable=False,
        )
        figure.add_layout(box)
        self._boxes.append(box)
        figure.on_event(SelectionGeometry, self._on_select)

    def select_overlay(self) -> BoxAnnotation:
        """A box-select tool's rubber band, as every map of the page draws it."""
        return BoxAnnotation(handles=self.engine.box_handles, **SELECT_OVERLAY)

    def _watch_ranges(self, figure) -> None:
        for rng in (figure.x_range, figure.y_range):
            if id(rng) not in self._watched:
                self._watched.add(id(rng))
                rng.on_change("start", partial(self._on_range, figure))
                rng.on_change("end", partial(self._on_range, figure))

    def _on_range(self, figure, attr, old, new) -> None:
        window = (
            (figure.x_range.start, figure.x_range.end),
            (figure.y_range.start, figure.y_range.end),
        )
        if self._zooming or window == self.window or None in (*window[0], *window[1]):
            return  # zoom() itself setting the ranges, or nothing new
        doc = figure.document
        if doc is None or doc.session_context is None:
            self.zoom(*window)
            return
        # Debounced: a wheel zoom sends a change per wheel step and per range end.
        self._changed_at = time.monotonic()
        self._pending_window = window
        if not self._scheduled:
            self._scheduled = True
            doc.add_timeout_callback(partial(self._debounced, doc), ZOOM_DEBOUNCE_MS)

    def _debounced(self, doc) -> None:
        wait_ms = ZOOM_DEBOUNCE_MS - 1000 * (time.monotonic() - self._changed_at)
        if wait_ms > 1:
            doc.add_timeout_callback(partial(self._debounced, doc), wait_ms)
            return
        self._scheduled = False
        with one_message(doc):
            self.zoom(*self._pending_window)

    def zoom(self, x_range, y_range) -> None:
        """Show the window ``x_range x y_range`` (key, query) on every linked map.

        Every map's visible window is re-rasterized from the full array at its pixel size
        and written into its rendered Bokeh image; ranges not shared are set to the window.
        """
        start = time.perf_counter()
        self.engine.window = (tuple(x_range), tuple(y_range))
        self._zooming = True
        try:
            for figure in self._figures:
                for rng, (lo, hi) in ((figure.x_range, x_range), (figure.y_range, y_range)):
                    if (rng.start, rng.end) != (lo, hi):
                        rng.start, rng.end = lo, hi
        finally:
            self._zooming = False
        self.engine.redraw(lambda view: view.raster is not None and view.group in LINKED_GROUPS)
        self.last_zoom_ms = 1000 * (time.perf_counter() - start)

    def _on_select(self, event) -> None:
        geometry = event.geometry or {}
        if not event.final or geometry.get("type") != "rect":
            return
        self.select((geometry["x0"], geometry["x1"]), (geometry["y0"], geometry["y1"]))

    def select(self, x_range, y_range) -> None:
        """Mark the box ``x_range x y_range`` on every map and tell the box's watchers."""
        self.box = (tuple(sorted(x_range)), tuple(sorted(y_range)))
        for box in self._boxes:
            box.update(
                left=self.box[0][0],
                right=self.box[0][1],
                bottom=self.box[1][0],
                top=self.box[1][1],
                visible=True,
            )
        self._box_changed()

    def clear(self, *_) -> None:
        """Remove the box selection from every map."""
        self.box = None
        for box in self._boxes:
            box.visible = False
        self._box_changed()

    def _box_changed(self) -> None:
        for callback in self._box_watchers:
            callback()

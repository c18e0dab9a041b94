"""The queries and keys of the shown head in one plane (AttentionViz), linked to the matrix.

Every query and key of the shown layer and head, over every sample, is a point of the
plane :func:`attnpanel.readouts.embedding.qk_embedding` finds; datashader draws them
(:mod:`attnpanel.render.embedding_view`): the shown sample's queries and keys each in a
hue ramp by position, every other sample grey. All samples are drawn because the plane is
theirs (the embedding is fitted on every sample, so one sample's cloud is read against the
others'); the shown sample is the one in colour because it is the one the matrix shows. A
box drawn over the points marks the shown sample's queries inside it (rows) and keys
(columns) on the large matrix: the other rows and columns are washed out, and ticks at the
matrix's edges name them. The box follows the sample; another head or layer is another
plane, and its box is gone. Shown on demand (``show_embedding``); only on the dense
page (the long page of a virtual trace has no such section).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import panel as pn

from attnpanel.app.documents import one_message, served_doc
from attnpanel.app.sections.base import Section
from attnpanel.readouts.embedding import box_positions, qk_embedding
from attnpanel.render.elements import MAP_KEY, PlotKey
from attnpanel.render.embedding_view import (
    EMBEDDING_SIZE,
    BoxedPositions,
    EmbeddingFigure,
    embedding_image,
    empty_image,
    mark_matrix,
)

PANE = "embedding"
VIEW = "query-key embedding"
MARKS = "embedding box on the matrix"
ZOOM_REST_MS = 40  # a wheel zoom sends a range change per step: draw on the last
NO_BOX = (
    "Drag a box over the points: on the matrix, the rows of the shown sample's queries in it "
    "and the columns of its keys keep their colours, the rest is washed out."
)
MEAN_HEAD = "the embedding is one head's: pick a head (the matrix shows the mean of heads)"


class QueryKeyEmbedding(Section):
    """The shown head's queries and keys in one plane; a box of them marks the matrix."""

    title = "Queries and keys in one plane"
    shown_by = "show_embedding"

    def __init__(self, **params):
        super().__init__(**params)
        self.status = pn.pane.Markdown(NO_BOX, margin=(0, 10), styles={"font-size": "12px"})
        self.figure: EmbeddingFigure | None = None
        self._embedding = None  # ((layer, head), Dataset): the one drawn
        self._box = None  # ((layer, head), x_range, y_range)
        self._window = None  # ((layer, head), window) of a zoom
        self._changed_at = 0.0
        self._scheduled = False
        self.state.param.watch(self._new_plane, ["head", "layer"])
        self.state.param.watch(self._hidden, "show_embedding")

    @property
    def box(self) -> tuple | None:
        """``((x0, x1), (y0, y1))`` of the box on the shown head's plane, or None."""
        if self._box is None or self._box[0] != self._plane(self.state.selection):
            return None
        return self._box[1:]

    def embedding(self, sel):
        """The plane of the selection's layer and head (kept while it is shown)."""
        plane = self._plane(sel)
        if self._embedding is None or self._embedding[0] != plane:
            self._embedding = (plane, qk_embedding(self.trace, head=int(sel.head)))
        return self._embedding[1]

    @staticmethod
    def _plane(sel) -> tuple:
        return (sel.layer, sel.head)

    def image(self, sel):
        """The drawn image of the selection (nothing, and why, for the mean of heads)."""
        if sel.head == "mean":
            window = self.figure.window if self.figure is not None else ((0, 1), (0, 1))
            counts = (self.trace.sizes["query"], self.trace.sizes["key"])
            return empty_image(window, window, MEAN_HEAD, counts)
        zoom = self._window
        window = zoom[1] if zoom is not None and zoom[0] == self._plane(sel) else None
        return embedding_image(self.trace, self.embedding(sel), sel.sample, window, box=self.box)

    def marks(self, sel) -> BoxedPositions:
        """The shown sample's queries and keys in the box, as the matrix marks them."""
        box = self.box
        if box is None or sel.head == "mean" or not self.state.show_embedding:
            return BoxedPositions(np.zeros(0, int), np.zeros(0, int), NO_BOX)
        queries, keys = box_positions(self.trace, self.embedding(sel), sel.sample, *box)
        label = (
            f"Box: {len(queries)} queries and {len(keys)} keys of sample {sel.sample}. On the "
            "matrix, the other rows and columns are washed out; ticks at its edges mark the "
            "queries (violet, left) and keys (orange, top)."
        )
        counts = (self.trace.sizes["query"], self.trace.sizes["key"])
        return BoxedPositions(queries, keys, label, counts)

    def build(self):
        if "q" not in self.trace or "k" not in self.trace:
            lacking = " and ".join(name for name in ("q", "k") if name not in self.trace)
            note = f"The query-key embedding needs the trace's {lacking}; this trace has none."
            return pn.Column(self.heading(), pn.pane.Alert(note, alert_type="warning"))
        image = self.engine.add(VIEW, self.image, ["sample", "head"], PANE, active=self.shown)
        self.figure = EmbeddingFigure(image, box_handles=self.engine.box_handles)
        self.engine.record(PANE, PlotKey("EmbeddingImage", "Embedding"), self.figure.handles)
        self.figure.on_select(self.select)
        self.figure.on_window(self._on_window)
        marks = self.engine.add(MARKS, self.marks, ["sample", "head"], "matrix", title=False)
        matrices = self.engine.handles("matrix", MAP_KEY)
        if matrices:
            handles = mark_matrix(matrices[0]["plot"])
            handles["push"] = partial(self._push_marks, handles["push"])
            handles["push"](handles, marks)
            self.engine.record("matrix", PlotKey("BoxedPositions", "EmbeddingBox"), handles)
        clear = pn.widgets.Button(label="Clear box of points", width=140, margin=(5, 10))
        clear.on_click(self.clear)
        return pn.Column(
            self.heading(),
            pn.pane.Bokeh(self.figure.figure, margin=0),
            pn.Row(self.status, clear, margin=0),
            margin=0,
            width=EMBEDDING_SIZE + 60,
        )

    def shown(self) -> bool:
        """Whether the section is shown (its view is skipped while it is hidden)."""
        return self.state.show_embedding

    def _push_marks(self, push, handles, marks: BoxedPositions) -> None:
        push(handles, marks)
        self.status.object = marks.label

    def reshown(self) -> None:
        # skipped while hidden (``active``)
        self.engine.redraw(lambda view: view.name in (VIEW, MARKS))

    def select(self, x_range, y_range) -> None:
        """Mark the box ``x_range x y_range`` of the plane: its queries and keys of the shown
        sample on the matrix."""
        plane = self._plane(self.state.selection)
        self._box = (plane, tuple(sorted(x_range)), tuple(sorted(y_range)))
        self.engine.redraw(lambda view: view.name in (VIEW, MARKS))

    def clear(self, *_) -> None:
        """Remove the box and its marks."""
        self._box = None
        self.engine.redraw(lambda view: view.name in (VIEW, MARKS))

    def _hidden(self, event) -> None:
        if not event.new and self.figure is not None:
            # the matrix loses the marks of a box it no longer shows (they come back with it)
            self.engine.redraw(lambda view: view.name == MARKS)

    def _new_plane(self, *_events) -> None:
        # another head or layer is another plane: the box and the zoom of this one go
        self._box = self._window = None

    def _on_window(self, window) -> None:
        self._window = (self._plane(self.state.selection), window)
        doc = served_doc()
        if doc is None:
            self.engine.redraw(lambda view: view.name == VIEW)
            return
        self._changed_at = time.monotonic()
        if not self._scheduled:
            self._scheduled = True
            doc.add_timeout_callback(partial(self._rested, doc), ZOOM_REST_MS)

    def _rested(self, doc) -> None:
        wait = ZOOM_REST_MS - 1000 * (time.monotonic() - self._changed_at)
        if wait > 1:
            doc.add_timeout_callback(partial(self._rested, doc), wait)
            return
        self._scheduled = False
        with one_message(doc):
            self.engine.redraw(lambda view: view.name == VIEW)

"""Why this cell: the selected cell's score split over the model's input, inside the model.

With the model at hand (:class:`attnpanel.interventions.model_run.ModelRun`), a click on a
cell of the matrix picks its query and key; this section draws the cell's score split by
integrated gradients (:func:`attnpanel.score_attribution`) over the input's positions,
through the query (blue) and through the key (vermillion), under the input curve with the
two positions marked, and over the input's channels (the demo: the aggregate power and
the 16 time features). Until a cell is clicked, the key is the one the query attends most.
Without a model, it says what it needs.
"""

from __future__ import annotations

import threading

import holoviews as hv
import numpy as np
import panel as pn

from attnpanel.app.sections.head_maps import ModelHeadsSection
from attnpanel.interventions.attribution import AttributionError, Cell, explain_cell
from attnpanel.interventions.components import component_attribution
from attnpanel.readouts import core
from attnpanel.render import views, why_views
from attnpanel.render.styling import WRAP
from attnpanel.util.kept import Kept

TABLE_ROWS = why_views.TOP_CHANNELS + 1  # the largest, then the rest in one row
PARTS_KEPT = 64  # cells whose split over earlier parts a session keeps
SHARES_HEIGHT, INPUT_HEIGHT = 240, 220  # the input's as the top view's: its axis label fits
FRAME_LEFT, FRAME_RIGHT = 90, 20  # px: both plots' frames on one x (wider than either needs)


def framed(pane: pn.pane.Bokeh) -> pn.pane.Bokeh:
    """The pane with its figure's frame at :data:`FRAME_LEFT` and :data:`FRAME_RIGHT` from
    its edges: the input curve and the shares under it share one x axis."""
    pane.object.min_border_left, pane.object.min_border_right = FRAME_LEFT, FRAME_RIGHT
    return pane


WHY_NEEDS_MODEL = (
    "Splitting a score over the input needs the model itself, not only its trace: the "
    "served demo has it; for your own, `attnpanel.explore(capture, "
    "model=attnpanel.ModelRun(model, inputs, layers=[...]))`, or `attnpanel why` on the "
    "command line."
)
WHY_EXPLAINED = (
    "A click on a cell of the attention matrix picks its query and key (until then, the key "
    "the query attends most). The cell's score before the softmax (a linear attention's: its "
    "features' product φ(q)·φ(k), before the row sum) is split over the model's "
    "input by integrated gradients from a zero baseline (token ids: zero embeddings): each "
    "position's and each channel's share of the change, through the query (blue) and "
    "through the key (vermillion). The shares add up to the change; the table under the "
    "curves says how exactly. The last table splits the score over the earlier parts whose "
    "outputs were added into the layer's input (the embedding, each earlier head, each "
    "MLP), layer norms frozen at this run: exact where q and k are linear in that input."
)
# (not the mask: the model runs with its own, and the default key is its own weights')
WHY_PARAMETERS = ["sample", "head", "query", "why_key"]


class WhyThisCell(ModelHeadsSection):
    """The selected cell's score attribution: per position on the input's axis, per channel."""

    title = "Why this cell: its score split over the input"
    shown_by = "show_why"

    def __init__(self, **params):
        super().__init__(**params)
        self._computing = threading.Lock()  # the views share one attribution, made once
        self._parts = Kept(PARTS_KEPT)  # the split over earlier parts, by cell
        self.state.param.watch(self._query_moved, ["query", "why_key"])

    def _query_moved(self, *events) -> None:
        """A key picked by a click on the matrix belongs to the query clicked with it: the
        query moved by other means (the slider, the curve), the key is the one it attends
        most again."""
        if {event.name for event in events} == {"query"} and self.state.why_key != -1:
            self.state.why_key = -1

    def key(self, sel) -> int:
        """The key of the cell explained: the clicked one, else the one the query attends
        most."""
        key = self.state.why_key
        if not 0 <= key < self.trace.sizes["key"]:
            own = sel.with_(mask=None)  # the model's own mask: it is what the model ran
            weights = np.nan_to_num(core.selected_weights(self.trace, own, self.cache))
            key = int(np.argmax(weights))
        return key

    def _explained(self, sel, explain):
        """``(explain(cell), "")`` of the selected cell, or ``(None, why there is none)``;
        one run of the model at a time (its modes, its hooks)."""
        if sel.head == "mean":
            return None, "the mean of heads has no score of its own: pick one head"
        cell = Cell(sel.sample, self.layer_name(sel), int(sel.head), int(sel.query), self.key(sel))
        try:
            with self._computing:
                return explain(cell), ""
        except AttributionError as err:
            return None, str(err)

    def attribution(self, sel):
        """``(attribution, "")`` of the selected cell over the input, or ``(None, why not)``."""
        return self._explained(sel, self.run.why)

    def parts(self, sel):
        """``(split over earlier parts, "")`` of the selected cell, or ``(None, why not)``."""
        run = self.run

        def split(cell):
            return self._parts.get(cell, lambda: explain_cell(
                component_attribution, run.model, *run.one(cell.sample), cell))  # fmt: skip

        return self._explained(sel, split)

    def shown(self) -> bool:
        """Whether the section is shown (hidden, its views wait: a click costs nothing)."""
        return self.state.show_why

    def reshown(self) -> None:
        self.engine.redraw(lambda view: view.name.startswith("why: "))

    def build(self):
        if self.run is None:
            return pn.Column(
                self.heading(), pn.pane.Markdown(WHY_NEEDS_MODEL, margin=(0, 10)), margin=0
            )
        return pn.Column(
            self.heading(),
            pn.pane.Markdown(WHY_EXPLAINED, margin=(0, 10)),
            pn.Row(self._input(), sizing_mode="stretch_width"),
            pn.Row(self._shares(), sizing_mode="stretch_width"),
            pn.Row(
                self._summary(),
                self._channels(),
                self._parts_view(),
                sizing_mode="stretch_width",
                stylesheets=[WRAP],  # at 1280 px the third goes under the others
            ),
            sizing_mode="stretch_width",
        )

    def _input(self):
        def build(sel):  # (the cell's two positions: nothing to wait for)
            curve = views.sequence_curve(self.trace, sel, show_reference=False)
            marks = why_views.cell_marks(self.trace, sel, self.key(sel))
            return hv.Overlay([*curve, *marks], label=f"{curve.label.split(' (')[0]}")

        element = self.engine.add(
            "why: the input", build, WHY_PARAMETERS, "why input", active=self.shown
        )
        # black, as on the top view: blue and vermillion are the two sides' marks
        black = {layer.label: dict(line_color="black") for layer in element if layer.label}
        style = dict(height=INPUT_HEIGHT, responsive=True, layer_style=black)
        return framed(self.engine.render(
            element, "why input", style=style, sizing_mode="stretch_width", height=INPUT_HEIGHT
        ))  # fmt: skip

    def _shares(self):
        def build(sel):
            key = self.key(sel)
            found, reason = self.attribution(sel)
            labels = core.clock_labels(self.trace, sel.sample)
            return why_views.position_shares(self.trace, sel, key, found, reason, labels)

        element = self.engine.add(
            "why: per position", build, WHY_PARAMETERS, "why shares", slow=True, active=self.shown
        )
        # no legend: the shares' x axis is the input's above, the same width (the title
        # names the colours)
        style = dict(height=SHARES_HEIGHT, responsive=True)
        return framed(self.engine.render(
            element, "why shares", style=style, sizing_mode="stretch_width", height=SHARES_HEIGHT
        ))  # fmt: skip

    def _table(self, name: str, build, pane: str, width: int, rows: int):
        """A table view of the cell (``rows`` rows, no scroll) under its caption (its
        element's label), computed on a worker."""
        element = self.engine.add(
            name, build, WHY_PARAMETERS, pane, title=False, slow=True, active=self.shown
        )
        style = dict(width=width, height=40 + 27 * rows)
        caption = pn.pane.Markdown(f"**{element.label}**", width=width, margin=(0, 10))
        return pn.Column(caption, self.engine.render(element, pane, style=style), margin=0)

    def _summary(self):
        def build(sel):
            mask = self.trace.attrs.get("mask", "none")
            return why_views.cell_table(*self.attribution(sel), mask=mask)

        return self._table("why: the cell", build, "why cell", 520, 9)

    def _channels(self):
        def build(sel):
            return why_views.channel_table(self.attribution(sel)[0])

        return self._table("why: per channel", build, "why channels", 470, TABLE_ROWS)

    def _parts_view(self):
        def build(sel):
            return why_views.parts_table(*self.parts(sel))

        return self._table("why: earlier parts", build, "why parts", 470, TABLE_ROWS + 1)

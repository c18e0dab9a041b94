"""How heads compose: a graph of every head by layer, joined where a later head reads an
earlier one's output more than random weights would (:func:`attnpanel.circuits`).

Nodes are heads (x: layer, y: head), coloured by their OV copying score; a line joins a
head to a head of a later layer where their Q-, K- or V-composition score (the state's
``composition``) is above the p95 of random matrices of the same shapes, its width by the
score. A click on a line draws both heads' maps of the shown sample beside the graph and
opens the later head in the matrix where the trace holds its layer. The weights are the
trace's own where it holds every layer's ``w_q, w_k, w_v, w_o``, else the model's at hand.
"""

from __future__ import annotations

import numpy as np
import panel as pn
import xarray as xr
from bokeh.models import ColorBar, ColumnDataSource, HoverTool, LinearColorMapper, Range1d
from bokeh.plotting import figure

from attnpanel.app.sections.head_maps import opening
from attnpanel.app.sections.matrix import PositionMap, matrix_style
from attnpanel.readouts import circuits as circuit_readouts
from attnpanel.readouts.core import layer_names
from attnpanel.render import circuit_views
from attnpanel.render.elements import PlotKey
from attnpanel.render.palette import HIGHLIGHT
from attnpanel.render.titles import fit_title

GRAPH_HEIGHT, LAYER_WIDTH = 330, 190  # px; the graph is a layer's width per layer
PAIR_SIZE = 220  # px of each of the pair's maps
NEEDS_WEIGHTS = (
    "Composition is read from the heads' projection matrices of several layers of one "
    "kind: neither this trace nor a capture of the model at hand (if any) has every layer's "
    "`w_q, w_k, w_v, w_o` (a rotary embedding, grouped-query heads, an encoder-decoder or a "
    "linear attention's feature map leave them out here). `attnpanel circuits TRACE` on "
    "the command line reads what a trace has."
)
COMPOSITION_EXPLAINED = (
    "Each dot is a head (colour: its OV copying score, the share of its OV matrix's "
    "eigenvalue mass that is positive: near 1, it copies what it attends to). A line joins "
    "a head to a head of a later layer whose {mode} read its output more than random "
    "matrices of the same shapes do (above their p95, {p95:.3f}); width: the score. A click "
    "on a line draws both heads' maps of this sample (until then, the strongest pair's) and "
    "opens the later head in the matrix where this trace holds its layer."
)
READS = {"Q": "queries", "K": "keys", "V": "values"}
PAIR = ("earlier", "later")


def padded(low: int, high: int) -> tuple[float, float]:
    """A range over ``low`` to ``high`` with room for a node's dot at either end, no more
    than 1.24x as wide (one place: a fifth of it)."""
    room = 0.12 * max(high - low, 1) if high > low else 0.2
    return low - room, high + room


class HeadComposition(PositionMap):
    """The composition graph of every head, and the maps of a clicked pair (clock times
    or tokens on their axes, as the matrix has them)."""

    title = "How heads compose (from the weights)"
    shown_by = "show_composition"
    map_group = "Pair"
    map_panes = (
        ("pair earlier", PlotKey("Image", "Pair")),
        ("pair later", PlotKey("Image", "Pair")),
    )

    def __init__(self, **params):
        super().__init__(**params)
        self.status = pn.pane.Markdown("", margin=(0, 10))
        self.result: xr.Dataset | None = None  # every circuit and composition (built once)
        self._edges_of: dict[str, dict] = {}  # by mode: the lines above random

    def weights_trace(self):
        """Every layer with its weights: the trace's own, else a capture of the model at
        hand; None where neither has two layers of them."""
        layers = self.state.layers
        if layers is not None and circuit_readouts.has_weights(layers):
            return layers
        if self.state.model is not None:
            found = self.state.model.capture(0)
            if isinstance(found, xr.Dataset) and "layer" in found.dims:
                return found if circuit_readouts.has_weights(found) else None
        return None

    def weights_of(self, sample: int, layer: str) -> xr.DataArray:
        """One layer's maps ``(head, query, key)`` of one sample: the trace's, else those of
        the model at hand run on the sample."""
        layers = self.state.layers
        if layers is not None and layer in layer_names(layers):
            return layers["weights"].sel(layer=layer).isel(batch=sample)
        return self.state.model.capture(sample)["weights"].sel(layer=layer).isel(batch=0)

    def mode_edges(self, mode: str) -> dict:
        """The lines above random of composition ``mode`` (computed once a mode)."""
        if mode not in self._edges_of:
            self._edges_of[mode] = circuit_views.edge_columns(self.result, mode)
        return self._edges_of[mode]

    def build(self):
        weights = self.weights_trace()
        if weights is None:
            return pn.Column(
                self.heading(), pn.pane.Markdown(NEEDS_WEIGHTS, margin=(0, 10)), margin=0
            )
        self.result = circuit_readouts.circuits(weights)
        mode = pn.widgets.RadioButtonGroup.from_param(
            self.state.param.composition, name="composition", button_type="light"
        )
        self.explained = pn.pane.Markdown(self._explanation(), margin=(0, 10))
        graph = self._graph()
        self.state.param.watch(self._redraw, "composition")
        self.state.param.watch(lambda *_events: self._mark_pair(), "composed_pair")
        return pn.Column(
            self.heading(),
            self.explained,
            mode,
            pn.Row(pn.pane.Bokeh(graph, margin=(0, 5)), self._pair("earlier"), self._pair("later")),
            self.status,
            sizing_mode="stretch_width",
        )

    def _explanation(self) -> str:
        mode = self.state.composition
        p95 = float(self.result["composition_baseline_p95"].sel(mode=mode))
        return COMPOSITION_EXPLAINED.format(mode=READS[mode], p95=p95)

    def _graph(self):
        result = self.result
        n_layers, n_heads = result.sizes["layer"], result.sizes["head"]
        fig = figure(
            width=max(320, LAYER_WIDTH * n_layers),
            height=GRAPH_HEIGHT,
            # no wider than its nodes and a quarter (a wider range would say there is more)
            x_range=Range1d(*padded(0, n_layers - 1)),
            y_range=Range1d(*padded(0, n_heads - 1)[::-1]),  # head 0 on top, as maps' rows
            tools="tap",
            toolbar_location=None,
            min_border=5,
        )
        self._edges = ColumnDataSource(self.mode_edges(self.state.composition))
        edges = fig.multi_line(
            xs="xs", ys="ys", line_width="width", line_alpha=0.55, line_color="#555555",
            source=self._edges,
        )  # fmt: skip
        # Bokeh's own tap selection would light every line under the click: the pair drawn
        # is marked instead (``_chosen``), the lines never change look
        edges.selection_glyph = edges.nonselection_glyph = None
        # the hover answers on each line's middle part only (unseen, wider): not on a
        # head's dot, where all its lines meet
        hovered = fig.multi_line(
            xs="hover_xs", ys="hover_ys", line_width=8, line_alpha=0, source=self._edges
        )
        hovered.selection_glyph = hovered.nonselection_glyph = None
        self._chosen = ColumnDataSource(circuit_views.chosen_columns(None, []))
        fig.multi_line(
            xs="xs", ys="ys", line_width=4, line_alpha=0.9, line_color=HIGHLIGHT,
            source=self._chosen,
        )  # fmt: skip
        mapper = LinearColorMapper(palette=circuit_views.COPYING_PALETTE, low=0.0, high=1.0)
        nodes = fig.scatter(
            x="x", y="y", size=12, line_color="black",
            fill_color={"field": "copying", "transform": mapper},
            source=ColumnDataSource(circuit_views.node_columns(result)),
        )  # fmt: skip
        fig.add_tools(
            HoverTool(renderers=[nodes], tooltips=circuit_views.NODE_TIPS),
            HoverTool(renderers=[hovered], tooltips=circuit_views.EDGE_TIPS, line_policy="interp"),
        )
        fig.add_layout(ColorBar(color_mapper=mapper, title="OV copying", width=10), "right")
        fig.xaxis.ticker = list(range(n_layers))
        fig.xaxis.major_label_overrides = {i: str(i) for i in range(n_layers)}
        fig.yaxis.ticker = list(range(n_heads))
        fig.xaxis.axis_label, fig.yaxis.axis_label = "layer", "head"
        fig.xgrid.visible = fig.ygrid.visible = False
        fig.on_event("tap", lambda event: self.click(event.x, event.y))
        self._figure = fig
        self._retitle()
        self._mark_pair()
        return fig

    def drawn_pair(self) -> tuple[str, int, str, int]:
        """The pair whose maps are drawn: the clicked one, else the mode's strongest."""
        edges = self.mode_edges(self.state.composition)  # (not the plot's: a worker reads it)
        layers = layer_names(self.result)
        pair = self.state.composed_pair
        found = [circuit_views.pair_head(pair, which, edges, layers) for which in PAIR]
        return (*found[0], *found[1])

    def _mark_pair(self) -> None:
        pair = self.drawn_pair()
        self._chosen.data = circuit_views.chosen_columns(pair, layer_names(self.result))

    def edges(self) -> dict:
        """The lines drawn now: each pair's heads, place and score (its source's columns)."""
        return dict(self._edges.data)

    def title_text(self) -> str:
        """The graph's title as drawn."""
        return self._figure.title.text

    def _retitle(self) -> None:
        mode = self.state.composition
        words = circuit_views.graph_title(self.mode_edges(mode), mode)
        self._figure.title.text = fit_title(self._figure, words)

    def _redraw(self, *_events) -> None:
        self._edges.data = self.mode_edges(self.state.composition)
        self.explained.object = self._explanation()
        self.status.object = ""
        self._mark_pair()
        self._retitle()

    def _pair(self, which: str):
        def build(sel):
            drawn = self.drawn_pair()
            layer, head = drawn[:2] if which == "earlier" else drawn[2:]
            weights = self.weights_of(sel.sample, layer).sel(head=head)
            return (
                weights.values.astype(np.float32),
                f"{layer} head {head}, sample {sel.sample} (the model's own mask)",
                "weight",
            )

        raster = self.engine.add(
            f"the {which} head of the pair",
            build,
            ["sample", "composed_pair", "composition"],
            f"pair {which}",
            raster=(PAIR_SIZE, PAIR_SIZE),
            group="Pair",
            follows_layer=False,
        )
        image = raster.element("weight")
        style = matrix_style(None, title_size="10pt", size=PAIR_SIZE, **self._ticks())
        return self.engine.render(image, f"pair {which}", style=style)

    def click(self, x=None, y=None) -> None:
        """A click on a line: draw both heads' maps, open the later one in the matrix."""
        if x is None or y is None:
            return
        pair = circuit_views.nearest_edge(self.edges(), x, y)
        if pair is None:
            self.status.object = "no line there: click a line between two heads to draw both"
            return
        self.status.object = ""
        opened = opening(self.state, pair[2], pair[3]) or {}  # the later head, where it can
        self.engine.soon(self.state.param.update, composed_pair=pair, **opened)

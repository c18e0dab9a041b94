"""Sections for text and multi-layer traces and positions.

- the most-attended token of each position (a trace with a ``token`` coordinate);
- the model view: every layer x head map in one datashaded image; a click opens that
  map in the attention matrix (sets ``layer`` and ``head``);
- the sinusoidal positional encoding (shown at start when the trace's attribute
  ``positional_encoding`` is ``"sinusoidal"``, else behind its checkbox).
"""

from __future__ import annotations

import holoviews as hv
import panel as pn

from attnpanel.app.scroll import MATRIX
from attnpanel.app.sections.base import Section
from attnpanel.readouts import model_map
from attnpanel.readouts.circuits import ov_copying
from attnpanel.readouts.core import Selection, layer_names
from attnpanel.readouts.roles import trace_roles
from attnpanel.render import model_views, styling
from attnpanel.render.elements import Raster

MODEL_CELL = 96  # pixels per small map of the model view, at most
MODEL_WIDTH = 860  # the model view's frame at most: with its layer names it fits 1280 px
COPYING_CELL = 60  # pixels a small map needs for its "OV copy 0.75"
TABLE_PARAMS = ["sample", "head", "mask", "enabled_heads", "layer"]


class TopAttended(Section):
    """Per position, the most-attended token for the selected head (text traces only)."""

    title = "Most-attended token per position"

    def __init__(self, **params):
        super().__init__(**params)
        self.pane = None

    @property
    def shown(self) -> bool:
        """Whether the trace has tokens (the section is empty otherwise)."""
        return model_map.tokens(self.trace) is not None

    def _table(self):
        table = model_views.top_attended(self.trace, self.state.selection, self.cache)
        return table.opts(*styling.options()).opts(
            width=520, height=min(520, 40 + 26 * self.trace.sizes["query"])
        )

    def build(self):
        if not self.shown:
            return pn.Spacer(height=0, margin=0)
        self.pane = pn.pane.HoloViews(self._table(), width=530, margin=(0, 5))
        self.engine.follow(self._update, TABLE_PARAMS)
        return pn.Column(self.heading(), self.pane)

    def _update(self, *_events) -> None:
        try:
            self.pane.object = self._table()
        except Exception as err:  # noqa: BLE001 - shown to the user; the session goes on
            self.engine.report(err, "updating the most-attended tokens")


class ModelView(Section):
    """Every layer x head map on one page; a click opens one in the matrix above."""

    title = (
        "Model view: every layer and head (captured {weights}; "
        "click a map to open it in the attention matrix)"
    )

    def __init__(self, **params):
        super().__init__(**params)

    @property
    def shown(self) -> bool:
        """Whether the trace has several layers (the section is empty otherwise)."""
        return self.state.layers is not None

    @property
    def cell(self) -> int:
        """Pixels per small map: MODEL_CELL, fewer when the heads would not fit."""
        return max(24, min(MODEL_CELL, MODEL_WIDTH // self.state.n_heads))

    def _image(self, sample: int) -> Raster:
        n_layers, n_heads = self.state.layers.sizes["layer"], self.state.n_heads
        image = model_views.model_view(
            self.state.layers, Selection(sample=sample), self.cell * n_heads, self.cell * n_layers
        )
        # rows by ascending y, as the engine's maps are
        values = image.dimension_values(2, flat=False)
        return Raster(values, image.bounds.lbrt(), "ModelView", image.label)

    def _marker(self, sel: Selection):
        return model_views.model_view_marker(sel.layer, sel.head, self.state.n_heads)

    def build(self):
        if not self.shown:
            return pn.Spacer(height=0, margin=0)
        state = self.state
        n_layers, n_heads = state.layers.sizes["layer"], state.n_heads
        image = self.engine.add(
            "model view",
            lambda sel: self._image(sel.sample),
            ["sample"],
            "model view",
            follows_layer=False,  # every layer at once
        ).element("weight", kdims=("head", "layer"))
        marker = self.engine.add(
            "model view outline", self._marker, ["layer", "head"], "model view", title=False
        )
        roles = self.engine.add(
            "model view roles",
            lambda sel: model_views.role_labels(
                trace_roles(state.layers, sel.sample), n_layers, n_heads
            ),
            ["sample"],
            "model view",
            title=False,
            follows_layer=False,
            slow=True,  # every layer's weights of the sample are read
        )
        # each head's OV copying score along its map's bottom edge, where the maps have room
        shown = ov_copying(state.layers) if self.cell >= COPYING_CELL else None
        copying = model_views.copying_labels(shown, n_layers, n_heads)
        names = layer_names(state.layers)
        plot = hv.Overlay([image, marker, roles, copying], label=image.label)
        style = dict(
            frame_width=self.cell * n_heads,
            frame_height=self.cell * n_layers,
            xaxis="top",
            xticks=[(h, f"head {h}") for h in range(n_heads)],
            yticks=[(i, f"{i}: {name}"[:40]) for i, name in enumerate(names)],
            colorbar=True,
            toolbar=True,
            title_size="11pt",
        )
        pane = self.engine.render(plot, "model view", style=style, on_tap=self.click)
        title = (
            self.title if shown is None else f"{self.title}; in blue, each head's OV copying score"
        )
        return pn.Column(self.heading(title), pane, margin=(0, 5))

    def click(self, x=None, y=None) -> None:
        """What a click on the model view does: open that layer and head above."""
        if x is None or y is None:
            return
        n_layers = self.state.layers.sizes["layer"]
        layer, head = model_views.mosaic_cell(x, y, n_layers, self.state.n_heads)
        self.engine.soon(self.state.param.update, layer=layer, head=head)
        self.engine.bring_into_view(MATRIX)


class Positional(Section):
    """The sinusoidal encoding heatmap, shown while ``show_positional`` is on."""

    title = "Positional encoding (position x dimension)"
    shown_by = "show_positional"  # drawn the first time it is shown (most traces never show it)

    def build(self):
        image = model_views.positional_encoding(self.trace)
        length, width = image.dimension_values(2, flat=False).shape
        image = image.opts(*styling.options()).opts(
            frame_width=min(900, max(300, 4 * width)),
            frame_height=min(400, max(200, 2 * length)),
            ylabel="position number",  # the same rows whatever a sample's tokens or times
        )
        note = pn.pane.Markdown(model_views.positional_note(self.trace), margin=(0, 10))
        return pn.Column(self.heading(), note, pn.pane.HoloViews(image, margin=(0, 5)), margin=0)

"""What the sections that need the model share: a map of every layer's heads, and a click
on it that opens the head in the matrix above.

:class:`ModelHeadsSection` is a :class:`~attnpanel.app.sections.base.Section` with the
model at hand (``state.model``, a :class:`~attnpanel.interventions.model_run.ModelRun`):
the importance and the patching sections draw their ``(layer, head)`` maps through
:meth:`render_map` and open a clicked head with :meth:`open_head`.
"""

from __future__ import annotations

import holoviews as hv
import panel as pn

from attnpanel.app.scroll import MATRIX
from attnpanel.app.sections.base import Section
from attnpanel.readouts.core import layer_names
from attnpanel.render import importance_views

MAP_SIZE = (460, 290)  # a (layer, head) map with its layer names and colour bar


def shown_layer(state, sel) -> str | None:
    """The model's name of the shown layer: the trace's own where it names it (a capture),
    else the model run's (None without a model)."""
    trace, run = state.trace, state.model
    if "layer" in trace.coords and trace["layer"].ndim == 0:
        name = str(trace["layer"].item())
        if run is None or name in run.heads():
            return name
    if run is None:
        return None
    layers = list(run.layers)
    return layers[sel.layer] if len(layers) > 1 else layers[0]


def opening(state, layer: str, head: int) -> dict | None:
    """The state's changes that open ``head`` of ``layer`` in the matrix: its index in a
    trace of several layers, or the head alone where ``layer`` is the one shown; None
    where the trace lacks that layer."""
    names = layer_names(state.layers) if state.layers is not None else []
    if layer in names:
        return dict(layer=names.index(layer), head=head)
    if layer == shown_layer(state, state.selection):
        return dict(head=head)
    return None


class ModelHeadsSection(Section):
    """A section that maps every head of the model and opens one on a click."""

    def __init__(self, **params):
        super().__init__(**params)
        self.status = pn.pane.Markdown("", margin=(0, 10))

    @property
    def run(self):
        """The model at hand, or None."""
        return self.state.model

    def layer_name(self, sel) -> str:
        """The model's name of the shown layer (:func:`shown_layer`)."""
        return shown_layer(self.state, sel)

    def render_map(self, raster, value: str, pane: str):
        """A ``(layer, head)`` map (a registered view's first raster) with hover and tap."""
        element = raster.element(
            hv.Dimension(value, label=raster.value_label), kdims=("head", "layer")
        )
        width, height = MAP_SIZE
        heads = max(self.run.heads().values())
        style = dict(
            width=width,
            height=height,
            colorbar=True,
            xticks=[(h, str(h)) for h in range(heads)],  # whole heads (not 0.5, 1.5 ...)
            yticks=importance_views.layer_ticks(self.run.heads()),
            tools=("hover", "tap"),
        )
        return self.engine.render(element, pane, style=style, on_tap=self.click)

    def tapped(self, x, y) -> tuple[str, int] | None:
        """The ``(layer, head)`` under a click on the map, or None."""
        if x is None or y is None:
            return None
        return importance_views.tapped_head(self.run.heads(), x, y)

    def click(self, x=None, y=None) -> None:
        """A click on the map: that head opens in the matrix."""
        found = self.tapped(x, y)
        if found is not None:
            self.open_head(*found)

    def open_head(self, layer: str, head: int) -> None:
        """Open ``head`` of ``layer`` in the matrix, or say the trace lacks that layer."""
        changes = opening(self.state, layer, head)
        if changes is None:
            self.status.object = f"layer `{layer}` is not in this trace: capture it to open it"
            return
        self.status.object = ""
        self.engine.soon(self.state.param.update, **changes)
        self.engine.bring_into_view(MATRIX)

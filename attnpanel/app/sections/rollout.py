"""Attention rollout beside the layer's matrix: how much each input position feeds each
position after the last layer (Abnar & Zuidema 2020, :func:`attnpanel.rollout`).

It composes a stacked capture's layers, or, with the model at hand, every layer of the
model captured on the shown sample. With the model, the rollout can also weigh each
weight by the gradient of the model's output norm first (Chefer et al. 2021). A trace of
one layer and no model shows nothing here.
"""

from __future__ import annotations

import holoviews as hv
import panel as pn
import param
import xarray as xr

from attnpanel.app.sections.matrix import PositionMap, matrix_style
from attnpanel.readouts.flow import rollout
from attnpanel.render import importance_views
from attnpanel.render.elements import PlotKey

ROLLOUT_SIZE = 230
ROLLOUT_KEY = PlotKey("Image", "Rollout")
WEIGHINGS = {"weights": "plain", "gradient × weights": "gradient"}


class Rollout(PositionMap):
    """The rollout map of the shown sample, plain or gradient-weighted."""

    title = "Attention rollout (every layer)"
    map_group = "Rollout"
    map_panes = (("rollout", ROLLOUT_KEY),)
    weighing = param.Selector(
        objects=list(WEIGHINGS), default="weights", doc="What weighs each layer's weights."
    )

    def __init__(self, **params):
        super().__init__(**params)
        self.param.watch(self._on_weighing, "weighing")

    @property
    def run(self):
        """The model at hand, or None."""
        return self.state.model

    @property
    def weighted(self) -> bool:
        """Whether the buttons ask for the gradient-weighted rollout (with a model only)."""
        return self.run is not None and WEIGHINGS[self.weighing] == "gradient"

    def rolled_out(self, sel) -> xr.Dataset | None:
        """The layers a rollout of the shown sample composes: the stacked trace, else (and
        for the gradient-weighted rollout, whose gradients are of the model's own capture)
        the model captured on that sample; None when neither is one square sequence."""
        stacked = self.state.layers
        if self.run is not None and (stacked is None or self.weighted):
            stacked = self.run.capture(sel.sample)  # kept: the view reads it again
        square = isinstance(stacked, xr.Dataset) and "layer" in stacked.dims
        if not square or stacked.sizes["query"] != stacked.sizes["key"]:
            return None
        return stacked.isel(batch=[sel.sample]) if stacked is self.state.layers else stacked

    def _model_rolls_out(self) -> bool:
        """Whether the model's own capture is one square stack (not an encoder-decoder):
        the gradient-weighted rollout reads it."""
        found = self.run.capture(self.state.sample)
        return (
            isinstance(found, xr.Dataset)
            and "layer" in found.dims
            and (found.sizes["query"] == found.sizes["key"])
        )

    def rollout(self, sel) -> xr.DataArray:
        """The rollout of the shown sample, weighed as the buttons say."""
        layers = self.rolled_out(sel)
        if self.weighted:
            return rollout(layers, gradients=self.run.gradients(sel.sample))
        return rollout(layers)

    def build(self):
        if self.rolled_out(self.state.selection) is None:
            return pn.Column(margin=0, visible=False)
        parts = [self.heading()]
        if self.run is not None and self._model_rolls_out():
            buttons = pn.widgets.RadioButtonGroup.from_param(self.param.weighing, margin=(0, 10))
            parts.append(buttons)
        return pn.Column(*parts, self._map(), margin=0)

    def _map(self):
        raster = self.engine.add(
            "attention rollout",
            lambda sel: importance_views.rollout_values(self.rollout(sel)),
            ["sample"],
            "rollout",
            raster=(ROLLOUT_SIZE, ROLLOUT_SIZE),
            group="Rollout",
            follows_layer=False,
        )
        style = matrix_style(None, title_size="10pt", size=ROLLOUT_SIZE, **self._ticks())
        image = raster.element(hv.Dimension("flow", label=raster.value_label))
        plot = self.marked(image, "query marker", "rollout")  # the row of the shown query
        return self.engine.render(plot, "rollout", style=style, on_tap=self.click)

    def _on_weighing(self, _event) -> None:
        self.engine.redraw(lambda view: view.pane == "rollout")

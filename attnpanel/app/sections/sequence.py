"""The input sequence at the top of the page: the power curve, or the tokens of a text.

A click on it picks the query (the nearest position, or the clicked token).
"""

from __future__ import annotations

import holoviews as hv

from attnpanel.app.sections.base import Section
from attnpanel.render import model_views, views
from attnpanel.render.palette import curve_styles

CURVE_HEIGHT = 230
TOKEN_STRIP_HEIGHT = 120


def sequence_styles(curves, show_reference: bool) -> dict:
    """Each curve's line by its label; the reference series (all but the first) hidden
    unless ``show_reference``."""
    labels = [curve.label for curve in curves]
    return {
        label: dict(line, visible=i == 0 or show_reference)
        for i, (label, line) in enumerate(zip(labels, curve_styles(labels), strict=True))
    }


class InputSequence(Section):
    """The sequence the layer reads, with the selected query marked."""

    def build(self):
        if "token" in self.trace.coords:
            plot, pane, style = self._token_strip()
        else:
            plot, pane, style = self._curves()
        return self.engine.render(
            plot,
            pane,
            style=dict(responsive=True, **style),
            on_tap=self.click,
            sizing_mode="stretch_width",
            height=style["height"],
            margin=(0, 5),
        )

    def _curves(self):
        state = self.state
        band = self.engine.add(
            "query weights on the curve",
            lambda sel: views.weight_band(self.trace, sel, self.cache),
            ["sample", "head", "query", "mask", "enabled_heads"],
            "sequence",
            title=False,
        )
        shown = self.engine.add(
            "sequence view",
            lambda sel: views.sequence_curve(self.trace, sel, show_reference=state.show_reference),
            ["sample", "show_reference"],
            "sequence",
        )
        # Every reference curve is drawn once; switching them off hides their renderers.
        curves = (
            shown
            if state.show_reference
            else views.sequence_curve(self.trace, state.selection, show_reference=True)
        )
        marker = self.engine.add(
            "position marker",
            lambda sel: views.position_marker(self.trace, sel),
            ["sample", "query"],
            "sequence",
            title=False,
            first=True,
        )
        layer_style = sequence_styles(curves, state.show_reference)
        plot = hv.Overlay([band, *curves, marker], label=curves.label)
        style = dict(
            height=CURVE_HEIGHT,
            legend=True,
            legend_cols=2 if len(curves) > 6 else 1,  # truth and prediction side by side
            layer_style=layer_style,
        )
        return plot, "sequence", style

    def _token_strip(self):
        add = self.engine.add
        boxes = add(
            "token strip",
            lambda sel: model_views.token_boxes(self.trace, sel, self.cache),
            ["sample", "head", "query", "mask", "enabled_heads"],
            "tokens",
        )
        labels = add(
            "token labels",
            lambda sel: model_views.token_labels(self.trace, sel),
            ["sample"],
            "tokens",
            title=False,
        )
        marker = add(
            "token marker",
            lambda sel: model_views.selected_token(self.trace, sel),
            ["query"],
            "tokens",
            title=False,
            first=True,
        )
        n = self.trace.sizes["query"]
        plot = hv.Overlay([boxes, labels, marker], label=boxes.label)
        style = dict(
            height=TOKEN_STRIP_HEIGHT,
            yaxis=False,
            xaxis=False,
            ylim=(-0.1, 1.1),  # the selected token's outline (-0.08 to 1.08) whole
            xlim=(-0.5, n - 0.5),
        )
        return plot, "tokens", style

    def click(self, x=None, y=None) -> None:
        """What a click on the sequence does: pick the nearest position as the query."""
        if x is None:
            return
        try:
            query = views.position_from_x(self.trace, self.state.selection, x)
        except Exception as err:  # noqa: BLE001 - shown to the user; the session goes on
            self.engine.report(err, "selecting the query on the top view")
            return
        self.engine.soon(self.state.param.update, query=query)

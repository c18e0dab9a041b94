"""Which heads the prediction needs: heads switched off inside the real model.

With the model at hand (:class:`attnpanel.interventions.model_run.ModelRun`: the served demo,
``explore(capture, model=ModelRun(...))``), the head toggles of the head comparison switch
heads off in the model itself: the model runs again on the shown sample and the page draws
its prediction with every head and without those, and the change of its metrics. A map of
every layer's heads, coloured by how much switching each off alone changes the prediction,
opens a head on click. Without a model, the section says what it needs.
"""

from __future__ import annotations

import panel as pn

from attnpanel.app.sections.head_maps import ModelHeadsSection
from attnpanel.readouts.core import PREDICTED
from attnpanel.render import importance_views
from attnpanel.render.palette import SERIES_COLORS

PREDICTION_HEIGHT = 230
NEEDS_MODEL = (
    "Switching heads off needs the model itself, not only its trace: the served demo has "
    "it; for your own, `attnpanel.explore(capture, model=attnpanel.ModelRun(model, inputs, "
    "layers=[...]))`. Without it, the head toggles change this layer's output only."
)


def prediction_styles(labels: list[str]) -> dict:
    """The input signal black; each series its colour, solid with every head and dashed
    with heads switched off."""
    styles, names = {}, {}
    suffixes = (importance_views.OFF_SUFFIX, PREDICTED)
    for label in labels:
        if not label.endswith(suffixes):
            styles[label] = dict(line_color="black", line_width=1.4)
            continue
        name = label.removesuffix(importance_views.OFF_SUFFIX).removesuffix(PREDICTED)
        color = names.setdefault(name, SERIES_COLORS[len(names) % len(SERIES_COLORS)])
        dash = "dashed" if label.endswith(importance_views.OFF_SUFFIX) else "solid"
        styles[label] = dict(line_color=color, line_width=1.2, line_dash=dash)
    return styles


class HeadImportance(ModelHeadsSection):
    """The model re-run with the switched-off heads, and every head's importance."""

    title = "Which heads the prediction needs"

    def off(self, sel) -> list[int]:
        """The heads switched off in the shown layer (the head toggles)."""
        return sorted(set(range(self.state.n_heads)) - set(sel.enabled_heads))

    def predictions(self, sel):
        off = self.off(sel)
        plain = self.run.prediction(sel.sample)
        ablated = self.run.prediction(sel.sample, {self.layer_name(sel): off})
        return plain, ablated, off

    def build(self):
        if self.run is None:
            return pn.Column(
                self.heading(), pn.pane.Markdown(NEEDS_MODEL, margin=(0, 10)), margin=0
            )
        parts = [self._map()]
        self.engine.ahead(lambda sel: self.run.importance_forwards(sel.sample))
        if "truth" in self.trace:
            parts.append(self._metrics())
        return pn.Column(
            self.heading(),
            pn.pane.Markdown(
                "Switch heads off with the head toggles above (under the head maps): the "
                "model runs again on this "
                "sample without them (solid: every head; dashed: heads off). A click on the "
                "map opens a head of the shown layer.",
                margin=(0, 10),
            ),
            pn.Row(self._curves(), sizing_mode="stretch_width"),
            pn.Row(*parts),
            self.status,
            sizing_mode="stretch_width",
        )

    def _curves(self):
        def build(sel):
            plain, ablated, off = self.predictions(sel)
            names = self.run.series_names(len(plain))
            return importance_views.prediction_curves(self.trace, sel, plain, ablated, names, off)

        element = self.engine.add(
            "prediction with heads off", build, ["sample", "enabled_heads"], "prediction"
        )
        labels = [curve.label for curve in element]
        style = dict(
            height=PREDICTION_HEIGHT,
            responsive=True,
            legend=True,
            legend_cols=2,
            layer_style=prediction_styles(labels),
        )
        return self.engine.render(
            element,
            "prediction",
            style=style,
            sizing_mode="stretch_width",
            height=PREDICTION_HEIGHT,
        )

    def _metrics(self):
        def build(sel):
            plain, ablated, off = self.predictions(sel)
            truth = self.trace["truth"].isel(batch=sel.sample).values
            return importance_views.metric_table(
                self.run.metrics(plain, truth), self.run.metrics(ablated, truth), off
            )

        element = self.engine.add(
            "metrics with heads off", build, ["sample", "enabled_heads"], "metrics", title=False
        )
        height = 40 + 27 * len(element)  # every metric, no scroll
        return self.engine.render(element, "metrics", style=dict(width=420, height=height))

    def _map(self):
        raster = self.engine.add(
            "head importance",
            lambda sel: importance_views.importance_map(self.run.importance(sel.sample)),
            ["sample"],
            "importance",
            follows_layer=False,
        )
        return self.render_map(raster, "importance", "importance")

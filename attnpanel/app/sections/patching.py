"""What changes the prediction: every head patched from this sample into a corrupted one.

With the model at hand (:class:`attnpanel.interventions.model_run.ModelRun`), the section
picks a corrupted input (the model's own, such as the demo's "without the kettle", another
sample, or a span of the input replaced by its mean or by zeros) and draws the map of every
head's patching effect (:func:`attnpanel.patching_effect`): the share of the clean-corrupted
difference of the score that taking the head's output (or q, k, v, weights) from the clean
run restores. A click on a head draws the prediction with it patched and opens it in the
matrix. Without a model, it says what it needs.
"""

from __future__ import annotations

import numpy as np
import panel as pn

from attnpanel.app.sections.head_maps import ModelHeadsSection
from attnpanel.interventions.model_run import ANOTHER_SAMPLE, SPAN_MEAN, SPAN_ZEROS
from attnpanel.interventions.patching import PatchingError
from attnpanel.readouts.core import PREDICTED
from attnpanel.render import patching_views
from attnpanel.render.palette import SERIES_COLORS

CURVES_HEIGHT = 260
PATCHING_NEEDS_MODEL = (
    "Patching heads between two inputs needs the model itself, not only its trace: the "
    "served demo has it; for your own, `attnpanel.explore(capture, "
    "model=attnpanel.ModelRun(model, inputs, layers=[...]))`."
)
EXPLAINED = (
    "Each cell of the map: the share of the difference of {score} between this sample and "
    "the corrupted input that taking one head's {what} from this sample into the corrupted "
    "run restores (1: all of it; negative: it widens it). A click on a head draws the "
    "prediction with it patched (dotted; solid: this sample, dashed: the corrupted input, "
    "both on this sample's positions) and opens it in the matrix."
)
PARAMETERS = ["sample", "corruption", "corrupt_sample", "corrupt_span", "patch_what"]


def patched_styles(labels: list[str]) -> dict:
    """Each series its colour: solid on the clean input, dashed on the corrupted one, dotted
    with the head patched."""
    styles, names = {}, {}
    dashes = {
        PREDICTED: "solid",
        patching_views.CORRUPTED: "dashed",
        patching_views.PATCHED: "dotted",
    }
    for label in labels:
        suffix = next((s for s in dashes if label.endswith(s)), None)
        if suffix is None:
            continue
        name = label.removesuffix(suffix)
        color = names.setdefault(name, SERIES_COLORS[len(names) % len(SERIES_COLORS)])
        styles[label] = dict(line_color=color, line_width=1.4, line_dash=dashes[suffix])
    return styles


class PatchingView(ModelHeadsSection):
    """The patching map of every head and the prediction with one head patched."""

    title = "What changes the prediction"
    shown_by = "show_patching"

    def build(self):
        if self.run is None:
            return pn.Column(
                self.heading(), pn.pane.Markdown(PATCHING_NEEDS_MODEL, margin=(0, 10)), margin=0
            )
        state = self.state
        choose = pn.widgets.Select.from_param(state.param.corruption, name="corrupted input")
        other = pn.widgets.IntSlider.from_param(state.param.corrupt_sample, name="other sample")
        span = pn.widgets.IntRangeSlider.from_param(
            state.param.corrupt_span, name="span replaced (positions)"
        )
        what = pn.widgets.Select.from_param(state.param.patch_what, name="patch each head's")

        def shown(*_events):
            other.visible = state.corruption == ANOTHER_SAMPLE
            span.visible = state.corruption in (SPAN_MEAN, SPAN_ZEROS)

        state.param.watch(shown, "corruption")
        shown()
        self.explained = pn.pane.Markdown(self.explanation(), margin=(0, 10))
        state.param.watch(
            lambda *_events: setattr(self.explained, "object", self.explanation()),
            ["patch_what", "corruption"],
        )
        return pn.Column(
            self.heading(),
            self.explained,
            pn.Row(choose, other, span, what),
            self._map(),
            pn.Row(self._curves(), sizing_mode="stretch_width"),
            self.status,
            sizing_mode="stretch_width",
        )

    def explanation(self) -> str:
        """The words above the map, for the corrupted input and what is patched."""
        how = self.state.patching
        return EXPLAINED.format(what=how.what, score=self.run.score_words(how))

    def effect(self, sel):
        """The patching map of the shown sample, or an empty map saying why there is none."""
        heads = self.run.heads()
        try:
            return patching_views.effect_map(self.run.patching(sel.sample, self.state.patching))
        except (PatchingError, ValueError) as error:
            return patching_views.no_effect(str(error), len(heads), max(heads.values()))

    def _map(self):
        raster = self.engine.add(
            "patching effect", self.effect, PARAMETERS, "patching", follows_layer=False, slow=True
        )
        return self.render_map(raster, "effect", "patching")

    def picked(self, sel) -> tuple[str, int, str]:
        """The head whose patched prediction is drawn: the clicked one, else the one of
        the largest effect; with the words the title says of it."""
        run = self.run
        layer, head = self.state.patched_head
        if layer in run.heads() and 0 <= head < run.heads()[layer]:
            return layer, head, f"{layer} head {head}"
        effect = run.patching(sel.sample, self.state.patching)
        values = effect.fillna(0).values
        row, head = divmod(int(abs(values).argmax()), values.shape[1])
        layer = str(effect["layer"].values[row])
        return layer, head, f"{layer} head {head} (the largest effect)"

    def predictions(self, sel) -> tuple[dict, str]:
        """The predictions drawn: on the clean and corrupted inputs, and with a head
        patched (NaN where there is no corrupted input or no difference to patch)."""
        run, how = self.run, self.state.patching
        clean = run.prediction(sel.sample)
        nothing = np.full_like(clean, np.nan)
        try:
            corrupted = run.corrupted_prediction(sel.sample, how)
            layer, head, words = self.picked(sel)
            patched = run.patched(sel.sample, how, layer, head)
        except (PatchingError, ValueError) as error:
            found = {"clean": clean, "corrupted": nothing, "patched": nothing}
            return found, f"nothing patched ({error})"
        into = run.describe(sel.sample, how)
        return {"clean": clean, "corrupted": corrupted, "patched": patched}, f"{into}, {words}"

    def _curves(self):
        def build(sel):
            predictions, head = self.predictions(sel)
            names = self.run.series_names(len(predictions["clean"]))
            how = self.state.patching
            other = how.other if how.how == ANOTHER_SAMPLE else None
            return patching_views.patched_curves(self.trace, sel, predictions, names, head, other)

        element = self.engine.add(
            "prediction with a head patched",
            build,
            [*PARAMETERS, "patched_head"],
            "patched prediction",
            follows_layer=False,
            slow=True,
        )
        labels = [
            f"{name}{suffix}"
            for name in self.run.series_names(len(self.run.prediction(0)))
            for suffix in (PREDICTED, patching_views.CORRUPTED, patching_views.PATCHED)
        ]
        style = dict(
            height=CURVES_HEIGHT,
            responsive=True,
            legend=True,
            legend_cols=3,
            layer_style=patched_styles(labels),
        )
        return self.engine.render(
            element,
            "patched prediction",
            style=style,
            sizing_mode="stretch_width",
            height=CURVES_HEIGHT,
        )

    def click(self, x=None, y=None) -> None:
        """A click on the map: that head's patched prediction, and the head in the matrix."""
        found = self.tapped(x, y)
        if found is None:
            return
        self.engine.soon(self.state.param.update, patched_head=found)
        self.open_head(*found)

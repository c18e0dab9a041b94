"""Every head over every sample: a survey's statistics (:func:`attnpanel.survey`).

One statistic of one layer at a time, each head's distribution over the samples
(:mod:`attnpanel.render.survey_views`): its quartiles, whiskers and every sample as a
point, the shown sample larger. A click on a point opens that sample. The survey is the
explorer's own (``explore(capture, survey=...)``), or, with the model at hand, computed
over the trace's samples the first time the section is shown.
"""

from __future__ import annotations

import panel as pn
import param
import xarray as xr
from bokeh.models import HoverTool

from attnpanel.app.sections.base import Section
from attnpanel.kernels.roles import TOKEN_ROLES
from attnpanel.render import survey_views

PLOT_SIZE = (760, 300)
NEEDS_SURVEY = (
    "A survey needs the model or a survey of it: the served demo has the model; for your "
    "own, `attnpanel.explore(capture, survey=attnpanel.survey(model, batches))` or "
    "`model=...` (the survey is then taken over this trace's samples)."
)


class SurveyView(Section):
    """One statistic of one layer, every head's distribution over the samples."""

    title = "Every head over every sample (survey)"
    shown_by = "show_survey"
    statistic = param.Selector(objects=[], doc="The statistic drawn (a survey variable).")
    layer = param.Selector(objects=[], doc="The survey's layer drawn (its name).")

    def __init__(self, **params):
        super().__init__(**params)
        self.status = pn.pane.Markdown("", margin=(0, 10))

    def survey(self) -> xr.Dataset | None:
        """The explorer's survey, else the model's over the trace's samples, else None."""
        if self.state.survey is not None:
            return self.state.survey
        if self.state.model is not None:
            return self.state.model.survey()
        return None

    def shown_layer(self, found: xr.Dataset) -> str:
        """The survey's layer of the shown trace (its own name where it has one)."""
        names = [str(n) for n in found["layer"].values]
        candidates = []
        if "layer" in self.trace.coords and self.trace["layer"].ndim == 0:
            candidates.append(str(self.trace["layer"].item()))
        if self.state.model is not None:
            candidates += list(self.state.model.layers)
        return next((name for name in candidates if name in names), names[-1])

    def values(self) -> xr.DataArray:
        """The chosen statistic of the chosen layer, ``(sample, head)``."""
        found = self.survey()
        return found[self.statistic].sel(layer=self.layer)

    def build(self):
        found = self.survey()
        if found is None:
            return pn.Column(self.heading(), pn.pane.Markdown(NEEDS_SURVEY, margin=(0, 10)))
        statistics = drawable(found)
        self.param.statistic.objects = statistics
        self.param.layer.objects = [str(n) for n in found["layer"].values]
        self.param.update(statistic=statistics[0], layer=self.shown_layer(found))
        self.param.watch(self._on_choice, ["statistic", "layer"])
        choose = pn.Row(
            pn.widgets.Select.from_param(
                self.param.statistic,
                name="Statistic",
                options={survey_views.label(name): name for name in statistics},
                width=260,
            ),
            pn.widgets.Select.from_param(self.param.layer, name="Layer", width=260),
        )
        samples = found.sizes["sample"]
        note = (
            f"{samples} samples: per head the box spans the 25th to 75th percentile, the "
            "whiskers the 5th to 95th; each point is a sample (the shown one larger). A click "
            "on a point opens its sample."
        )
        if "token_roles" in found.attrs:
            note += (
                " The duplicate-token and induction scores are not offered: this survey's "
                "inputs carried no token ids."
            )
        return pn.Column(
            self.heading(),
            pn.pane.Markdown(note, margin=(0, 10)),
            choose,
            self._plot(),
            self.status,
            margin=0,
        )

    def _plot(self):
        def build(sel):
            title = f"{self.layer}: {survey_views.label(self.statistic)}"
            return survey_views.distribution(self.values(), sel.sample).relabel(title)

        element = self.engine.add("survey", build, ["sample"], "survey", follows_layer=False)
        width, height = PLOT_SIZE
        style = dict(
            width=width,
            height=height,
            tools=("hover", "tap"),
            xticks=[(h, f"head {h}") for h in range(int(self.values().sizes["head"]))],
            layer_style={
                "whiskers": dict(fill_color="#555555", line_color=None),
                "boxes": dict(fill_color="#9ecae1", fill_alpha=0.55, line_color="#3182bd"),
                "medians": dict(fill_color="#08306b", line_color=None),
                "samples": dict(size=4, color="#636363", alpha=0.55),
                "shown": dict(size=10, color="#e6550d", line_color="black"),
            },
            cmap="Greys",
        )
        return self.engine.render(element, "survey", style=style, on_tap=self.click)

    def _on_choice(self, *_events) -> None:
        self.engine.redraw(lambda view: view.pane == "survey")
        label = survey_views.label(self.statistic)
        for found in self.engine.plots("survey").values():  # the axis and hover name it
            for handles in found:
                if handles.get("yaxis") is not None:
                    handles["yaxis"].axis_label = label
                for hover in handles["plot"].select({"type": HoverTool}):
                    if isinstance(hover.tooltips, list) and hover.tooltips:
                        hover.tooltips = [*hover.tooltips[:-1], (label, hover.tooltips[-1][1])]

    def click(self, x=None, y=None) -> None:
        """A click on a point: open its sample (one of this trace's)."""
        if x is None or y is None:
            return
        sample = survey_views.nearest_sample(self.values(), float(x), float(y))
        if sample is None:
            return
        batch = self.trace.sizes["batch"]
        if sample < batch:
            self.status.object = ""
            self.engine.soon(self.state.param.update, sample=sample)
        else:
            self.status.object = (
                f"sample {sample} of the survey is not in this trace ({batch} samples): "
                "capture it to open its map"
            )


def drawable(found: xr.Dataset) -> list[str]:
    """The statistics a survey can draw per head, in its own order; the token scores only
    where its inputs carried token ids (else they are NaN by construction)."""
    absent = TOKEN_ROLES if "token_roles" in found.attrs else ()
    return [
        name for name in found.data_vars if found[name].dims[-1] == "head" and name not in absent
    ]

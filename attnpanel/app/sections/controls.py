"""The controls: every widget is made from a parameter of the explorer's state."""

from __future__ import annotations

import panel as pn

from attnpanel.app.sections.base import Section
from attnpanel.readouts.core import layer_names
from attnpanel.readouts.quantities import reference_name
from attnpanel.render.styling import CHECKBOX_TEXT, WRAP
from attnpanel.traces.schema import STAGES
from attnpanel.traces.stages import normaliser

TOGGLES = (  # the sections' checkboxes, in the order the page shows them
    "show_projection",
    "show_merge",
    "side_by_side",
    "show_reference",
    "show_positional",
    "show_head_average",
    "show_survey",
    "show_patching",
    "show_why",
    "show_composition",
    "show_embedding",
)
STAGE_NAMES = {
    "raw scores": "raw",
    "scaled": "scaled",
    "masked": "masked",
    "softmax": "softmax",
    "value-weighted": "value_weighted",
}


def stage_names(trace) -> dict[str, str]:
    """The stage menu's words for ``trace``: a linear attention's weights are no softmax."""
    if normaliser(trace) == "softmax":
        return STAGE_NAMES
    return {("weights (row sum)" if v == "softmax" else k): v for k, v in STAGE_NAMES.items()}


# Panel waits 50 ms after a widget change for more (its class attribute ``_debounce``), a
# third of the 150 ms budget; the selection's changes are discrete, so they go at once.
# The engine coalesces its own deferred updates instead.
class ImmediateSelect(pn.widgets.Select):
    """A ``Select`` whose change is sent to the server at once."""

    _debounce = 0


class ImmediateIntSlider(pn.widgets.IntSlider):
    """An ``IntSlider`` whose change is sent to the server at once."""

    _debounce = 0


MENU_CHAR_PX = 7.5  # a menu's 13 px font, per character (measured: 7.1 to 7.4)
MENU_ARROW_PX = 40  # its padding and arrow
LAYER_MENU_MOST = 360


def layer_selector(state) -> dict:
    """``{"layer": select}`` for a trace with several layers, else ``{}``."""
    if state.layers is None:
        return {}
    options = {f"{i}: {name}": i for i, name in enumerate(layer_names(state.layers))}
    # wide enough for its longest name (it cut "3: encoder.layer.3.attention.s" at 200 px)
    longest = max(map(len, options), default=0)
    select = ImmediateSelect.from_param(
        state.param.layer,
        name="Layer",
        width=int(min(LAYER_MENU_MOST, max(120, MENU_CHAR_PX * longest + MENU_ARROW_PX))),
        options=options,
    )
    return {"layer": select}


def head_selector(state, width: int) -> ImmediateSelect:
    """The select of one head of the shown layer."""
    return ImmediateSelect.from_param(
        state.param.head,
        name="Head",
        options={f"head {h}": h for h in range(state.n_heads)},
        width=width,
    )


class WidgetRow(Section):
    """A row of widgets that drive the state: a subclass says which (``make_widgets``)."""

    def __init__(self, **params):
        super().__init__(**params)
        self._widgets = self.make_widgets(self.state)

    def make_widgets(self, state) -> dict:
        """The widgets, by the state parameter each drives."""
        raise NotImplementedError

    @property
    def widgets(self) -> dict:
        """The widgets by the state parameter they drive."""
        return dict(self._widgets)

    def build(self):
        return pn.Row(*self._widgets.values(), sizing_mode="stretch_width", margin=0)


class Controls(Section):
    """Layer, sample, head, query, mask, stage (and its player), colormap and toggles."""

    def __init__(self, **params):
        super().__init__(**params)
        state = self.state
        head_options = {f"head {h}": h for h in range(state.n_heads)}
        head_options["mean of heads"] = "mean"
        widgets = layer_selector(state)
        stages = stage_names(state.trace)
        widgets.update(
            sample=ImmediateIntSlider.from_param(state.param.sample, name="Sample", width=150),
            head=ImmediateSelect.from_param(
                state.param.head, name="Head", options=head_options, width=125
            ),
            query=ImmediateIntSlider.from_param(state.param.query, name="Query", width=220),
            mask=ImmediateSelect.from_param(state.param.mask, name="Mask", width=110),
            stage=ImmediateSelect.from_param(
                state.param.stage,
                name="Stage",
                options=stages,
                width=115 if stages is STAGE_NAMES else 150,  # ("weights (row sum)" fits)
            ),
            colormap=ImmediateSelect.from_param(state.param.colormap, name="Colormap", width=110),
        )
        player = pn.widgets.Player(
            label="Stage player",
            start=0,
            end=len(STAGES) - 1,
            value=STAGES.index(state.stage),
            interval=1200,
            loop_policy="loop",
            show_loop_controls=False,
            width=200,
            visible_buttons=["previous", "play", "pause", "next"],
        )
        player.param.watch(lambda e: state.param.update(stage=STAGES[e.new]), "value")
        state.param.watch(lambda e: setattr(player, "value", STAGES.index(e.new)), "stage")
        widgets["player"] = player
        widgets["side_by_side"] = pn.widgets.Checkbox.from_param(
            state.param.side_by_side, name="masked and unmasked side by side"
        )
        widgets["show_reference"] = pn.widgets.Checkbox.from_param(
            state.param.show_reference,
            name=f"show {reference_name(state.trace)}",
            visible="truth" in state.trace or "prediction" in state.trace,
        )
        widgets["show_positional"] = pn.widgets.Checkbox.from_param(
            state.param.show_positional, name="positional encoding"
        )
        widgets["show_projection"] = pn.widgets.Checkbox.from_param(
            state.param.show_projection, name="Q/K/V projection"
        )
        widgets["show_merge"] = pn.widgets.Checkbox.from_param(
            state.param.show_merge, name="head merge and Wo"
        )
        widgets["show_head_average"] = pn.widgets.Checkbox.from_param(
            state.param.show_head_average, name="head average"
        )
        widgets["show_embedding"] = pn.widgets.Checkbox.from_param(
            state.param.show_embedding, name="Q/K embedding"
        )
        widgets["show_survey"] = pn.widgets.Checkbox.from_param(
            state.param.show_survey, name="every sample (survey)"
        )
        widgets["show_patching"] = pn.widgets.Checkbox.from_param(
            state.param.show_patching, name="patching"
        )
        widgets["show_why"] = pn.widgets.Checkbox.from_param(
            state.param.show_why, name="why this cell"
        )
        widgets["show_composition"] = pn.widgets.Checkbox.from_param(
            state.param.show_composition, name="composition"
        )
        for widget in widgets.values():
            if isinstance(widget, pn.widgets.Checkbox):
                widget.margin = (4, 5, 4, 5)  # their row is level with the player's slider
                widget.stylesheets = [CHECKBOX_TEXT]  # a click on the text toggles it
        self._widgets = widgets

    @property
    def widgets(self) -> dict:
        """The widgets by the state parameter they drive (``player`` drives ``stage``)."""
        return dict(self._widgets)

    def build(self):
        w = self._widgets
        selectors = [w[name] for name in ("layer", "sample", "head", "query", "mask") if name in w]
        # Bokeh sizes a column by its rows' items side by side, wrapping or not: each row
        # fits 1280 px with the layer selector (a wider one widened the whole page).
        return pn.Column(
            pn.Row(*selectors, w["stage"], w["colormap"], sizing_mode="stretch_width"),
            pn.Row(
                w["player"],
                pn.Row(
                    *(w[name] for name in TOGGLES),
                    sizing_mode="stretch_width",
                    margin=(24, 0, 0, 0),  # level with the player's slider
                    stylesheets=[WRAP],  # on a narrow page they wrap beside the player
                ),
                sizing_mode="stretch_width",
            ),
            sizing_mode="stretch_width",
            margin=0,
        )

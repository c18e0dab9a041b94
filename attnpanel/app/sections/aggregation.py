"""Value aggregation for the selected query: its weights, the top values, the context."""

from __future__ import annotations

import panel as pn

from attnpanel.app.sections.base import Section
from attnpanel.app.sections.matrix import clock_key_axis, set_clock_labels
from attnpanel.readouts import core
from attnpanel.render import model_views, views

WIDTH = 300
DEPENDS = ["sample", "head", "query", "mask", "enabled_heads"]
TOKEN_LABELS_PX = 50  # the height tokens written upright under the keys take


class ValueAggregation(Section):
    """The weights of the query over every key, the most-attended values, and Σ w · v."""

    title = "Value aggregation"

    def __init__(self, **params):
        super().__init__(**params)
        self.engine.follow(self._relabel_keys, ["sample"])

    def _key_ticks(self) -> dict:
        """A token trace's keys by their tokens (the matrix's own ticks), else nothing."""
        ticks = model_views.token_ticks(self.trace, self.state.sample)
        return dict(xticks=list(ticks.items()), xrotation=90) if ticks else {}

    def _weight_plots(self) -> list:
        """The figures of the query's weights drawn so far."""
        found = self.engine.plots("aggregation weights").values()
        return list({id(h["plot"]): h["plot"] for handles in found for h in handles}.values())

    def _relabel_keys(self, *_events) -> None:
        """A clock trace's keys at the shown sample's times (the matrix's own labels)."""
        labels = core.clock_labels(self.trace, self.state.sample)
        if labels is not None:
            for figure in self._weight_plots():
                set_clock_labels(figure, labels)

    def build(self):
        ticks = self._key_ticks()
        weights = self.bars(
            "aggregation weights",
            lambda sel: views.aggregation_weights(self.trace, sel, self.cache),
            DEPENDS,
            WIDTH,
            180 + (TOKEN_LABELS_PX if ticks else 0),  # a frame as tall
            **ticks,
        )
        labels = core.clock_labels(self.trace, self.state.sample)
        if labels is not None and not ticks:
            for figure in self._weight_plots():
                clock_key_axis(figure, labels)
        return pn.Column(
            self.heading(),
            weights,
            # In a row of its own: Bokeh aligns the frames of the plots of one column, and
            # this one's key labels and colour bar would narrow the others' frames.
            pn.Row(
                self.bars(
                    "top values",
                    lambda sel: views.top_values(self.trace, sel, self.cache),
                    DEPENDS,
                    WIDTH,
                    190,
                ),
                margin=0,
            ),
            self.bars(
                "context vector",
                lambda sel: views.context_vector(self.trace, sel, self.cache),
                DEPENDS,
                WIDTH,
                140,
            ),
            width=WIDTH + 15,
        )

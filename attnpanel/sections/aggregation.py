"""Value aggregation for the selected query: its weights, the top values, the context."""

from __future__ import annotations

import panel as pn

from attnpanel import views
from attnpanel.sections.base import Section

WIDTH = 380
DEPENDS = ["sample", "head", "query", "mask", "enabled_heads"]


class ValueAggregation(Section):
    """The weights of the query over every key, the most-attended values, and Σ w · v."""

    title = "Value aggregation"

    def build(self):
        return pn.Column(
            self.heading(),
            self.bars(
                "aggregation weights",
                lambda sel: views.aggregation_weights(self.trace, sel, self.cache),
                DEPENDS,
                WIDTH,
                180,
            ),
            self.bars(
                "top values",
                lambda sel: views.top_values(self.trace, sel, self.cache),
                DEPENDS,
                WIDTH,
                190,
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

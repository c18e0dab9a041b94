"""The shape of every step of the layer, as this trace holds it."""

from __future__ import annotations

import panel as pn

from attnpanel.app.sections.base import Section
from attnpanel.render import views


class ShapeTable(Section):
    """Every step with its operation and real shape.

    The masking step names no mask: the page's Mask selector says which is shown. A table
    that named it went stale (Bokeh's DataTable kept drawing the first mask after its
    source changed), and a text pane redrawn in a notebook fetched Panel's stylesheets
    from its CDN.
    """

    title = "Shapes of every step"

    def build(self):
        table = views.shape_view(self.trace, mask="selected above")
        style = dict(width=1000, height=320)
        return pn.Column(self.heading(), self.engine.render(table, "shapes", style=style))

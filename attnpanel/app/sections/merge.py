"""Head merge and the output projection: the heads' contexts joined, Wo, the output."""

from __future__ import annotations

import panel as pn

from attnpanel.app.sections.base import Section
from attnpanel.app.sections.projection import weight_map
from attnpanel.render import views
from attnpanel.render.styling import WRAP

DEPENDS = ["sample", "query", "mask", "enabled_heads"]


class MergeOutput(Section):
    """The merged vector (switched-off heads zeroed), Wo, and the output against all heads."""

    title = "Head merge and output projection"
    shown_by = "show_merge"

    def build(self):
        merge = self.bars(
            "head merge",
            lambda sel: views.head_merge(self.trace, sel, self.cache),
            DEPENDS,
            430,
            170,
        )
        wo = weight_map(self, "w_o", 250, 250, colorbar=True)  # tall enough for its title
        output = self.bars(
            "output",
            lambda sel: views.output_change(self.trace, sel, self.cache),
            DEPENDS,
            480,
            170,
        )
        arrow = dict(margin=(60, 5))  # beside the charts' middle
        return pn.Column(
            self.heading(),
            pn.Row(
                merge,
                pn.pane.Markdown("## →", **arrow),
                wo,
                pn.pane.Markdown("## →", **arrow),
                output,
                sizing_mode="stretch_width",
                stylesheets=[WRAP],
            ),
            sizing_mode="stretch_width",
        )

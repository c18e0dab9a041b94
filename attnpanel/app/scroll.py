"""Bring a part of the page into view when the server asks: a click on a head of the model
view or of the importance map (far below the matrix) opens it in the matrix and scrolls
the matrix into view, so that what the section's words promise ("a click on the map opens a
head") is seen to happen.

:class:`ScrollTo` is a Panel ``JSComponent`` of no size laid out once per page; a section
asks for a part by its CSS class through :meth:`LiveEngine.bring_into_view
<attnpanel.app.engine.LiveEngine.bring_into_view>`."""

from __future__ import annotations

import param
from panel.custom import JSComponent

MATRIX = "attnpanel-matrix"  # the CSS class of the matrix's section


class ScrollTo(JSComponent):
    """Scrolls the page to the part whose CSS class is ``target`` at each ``request``."""

    target = param.String(default="", doc="The CSS class of the part to bring into view.")
    request = param.Integer(default=0, doc="Counts the requests: each one scrolls.")

    # every view of the page (Bokeh's index, walked as the tests' helpers walk it); the first
    # whose model has the class is scrolled to the top of the window
    _esm = """
    export function render({ model }) {
      const scroll = () => {
        const views = [];
        const walk = (v) => { views.push(v); for (const c of (v.child_views || [])) walk(c); };
        for (const root of Object.values(window.Bokeh.index)) walk(root);
        const found = views.find((v) => v.model && Array.isArray(v.model.css_classes) &&
                                        v.model.css_classes.includes(model.target));
        if (found) found.el.scrollIntoView({ behavior: "smooth", block: "start" });
      };
      model.on("request", scroll);
      return document.createElement("span");
    }
    """

    def __init__(self, **params):
        params.setdefault("width", 0)
        params.setdefault("height", 0)
        params.setdefault("margin", 0)
        super().__init__(**params)

    def bring(self, target: str) -> None:
        """Scroll the page to the part of CSS class ``target``."""
        self.param.update(target=target, request=self.request + 1)

"""What every section of the explorer is: a small ``Viewer`` over the shared state.

A :class:`Section` holds a typed reference to the explorer's state (the single source of
truth) and to its live-update engine. It registers its views with the engine, next to
where it lays them out, naming the state parameters each depends on; its own widgets and
watchers live with it. Its layout is built once, when the page first shows it.
"""

from __future__ import annotations

import holoviews as hv
import panel as pn
import param

from attnpanel.app.engine import LiveEngine
from attnpanel.app.state import ExplorerState
from attnpanel.readouts.core import MissingVariable, weights_words
from attnpanel.render import views
from attnpanel.util import untrusted


class Section(pn.viewable.Viewer):
    """One part of the explorer's page.

    Parameters
    ----------
    state : attnpanel.app.state.ExplorerState
        What the user looks at; every view reads it.
    engine : attnpanel.app.engine.LiveEngine
        Draws the section's views and redraws them when the state changes.
    """

    state = param.ClassSelector(class_=ExplorerState, doc="The state every view reads.")
    engine = param.ClassSelector(class_=LiveEngine, doc="Draws and redraws the views.")
    title = ""  # the section's heading on the page
    # A Boolean of the state that shows the section: it is built the first time that
    # parameter is on (a session that never opens it never pays for its plots).
    shown_by = ""

    def __init__(self, **params):
        super().__init__(**params)
        self._layout = None

    @property
    def trace(self):
        """The Dataset the views read now (the shown layer)."""
        return self.state.trace

    @property
    def cache(self):
        """The state's cache of recomputed stages."""
        return self.state.cache

    def build(self) -> pn.viewable.Viewable:
        """The section's layout (called once)."""
        raise NotImplementedError

    def __panel__(self):
        if self._layout is None:
            if self.shown_by:
                shown = self.state.param[self.shown_by]
                self._layout = pn.Column(visible=shown, margin=0)
                self.state.param.watch(self._show, self.shown_by)
                self._show()
            else:
                self._layout = self.build()
        return self._layout

    def _show(self, *_events) -> None:
        if not getattr(self.state, self.shown_by):
            return
        if self._layout.objects:
            self.reshown()
        else:
            self._layout.append(self.build())

    def reshown(self) -> None:
        """Called when a section shown on demand shows again: views it skipped while hidden
        redraw here."""

    def heading(self, text: str | None = None, **kw) -> pn.pane.Markdown:
        """The section's heading; ``{weights}`` in it names what the trace's weights are
        (a softmax's, or a linear attention's)."""
        words = (text or self.title).replace("{weights}", weights_words(self.trace))
        return pn.pane.Markdown(f"### {words}", margin=(0, 5), **kw)

    def missing(self, err: MissingVariable, width: int, height: int = 80) -> pn.pane.Alert:
        """An alert naming what the trace lacks, in a view's place."""
        return pn.pane.Alert(
            untrusted.html_text(err.message),
            alert_type="warning",
            width=width,
            min_height=height,
            margin=5,
        )

    def bars(self, name, build, parameters, width: int, height: int, **style):
        """A bar-chart view drawn by the engine, or an alert naming the variable it lacks."""
        try:
            element = self.engine.add(name, build, parameters, name)
        except MissingVariable as err:
            return self.missing(err, width)
        style = dict(width=width, height=height, **style)
        return self.engine.render(element, name, style=style, width=width, height=height)

    def marked(self, image: hv.Image, name: str, pane: str, **add) -> hv.Overlay:
        """``image`` with the selected query's row boxed (a view of its own)."""
        marker = self.engine.add(
            name,
            lambda sel: views.query_marker(self.trace, sel),
            ["query"],
            pane,
            title=False,
            **add,
        )
        return hv.Overlay([image, marker], label=image.label)

"""The explorer's live-update engine: views drawn once, then redrawn in place.

:class:`LiveEngine` is the one object a section talks to. It is the explorer's
:class:`~attnpanel.app.registry.ViewRegistry` (views registered with :meth:`add`, drawn
once with :meth:`render` straight into Bokeh models, their models looked up by pane) and
owns the :class:`~attnpanel.app.scheduler.Scheduler` that redraws them in place when the
state changes. No figure is rebuilt and HoloViews renders nothing on the served page: a
first render costs ~15 ms a plot where HoloViews took 40-70 ms, an update ~1 ms a plot
where a ``DynamicMap`` refresh took 25-45 ms (see ``docs/explorer.md``).
:meth:`dynamic_map` gives any view to a notebook user as a HoloViews ``DynamicMap``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from attnpanel.app.neighbours import NeighbourSamples, Warm
from attnpanel.app.registry import LINKED_GROUPS, LiveView, ViewRegistry
from attnpanel.app.scheduler import Scheduler, report
from attnpanel.app.scroll import ScrollTo
from attnpanel.app.state import ExplorerState

__all__ = ["LINKED_GROUPS", "LiveEngine", "LiveView"]


class LiveEngine(ViewRegistry):
    """Draws the registered views of one explorer and redraws them when the state changes.

    Parameters
    ----------
    state : attnpanel.app.state.ExplorerState
        The state the views read; the engine watches its selection parameters.
    background : bool
        Compute the maps and the views registered ``slow`` on worker threads
        (:class:`attnpanel.app.background.Background`): a served session's event loop never
        waits for them (the explorer of a virtual trace, whose maps may take minutes).
    """

    def __init__(self, state: ExplorerState, background: bool = False):
        super().__init__(state)
        self.scheduler = Scheduler(self, background)
        self._scroller = None
        self.neighbours = NeighbourSamples(
            state, self.when_idle, self._views_ahead, self._retain_ahead
        )

    @property
    def scroller(self) -> ScrollTo:
        """What brings a part of the page into view (the explorer lays it out)."""
        if self._scroller is None:
            self._scroller = ScrollTo()
        return self._scroller

    def bring_into_view(self, css_class: str) -> None:
        """Scroll the page to its part of CSS class ``css_class`` (once drawn)."""
        self.scroller.bring(css_class)

    @property
    def indicator(self):
        """The page's busy indicator (the explorer lays it out)."""
        return self.scheduler.indicator

    @property
    def background(self):
        """The worker threads of a background engine, or None."""
        return self.scheduler.background

    def report(self, err: BaseException, where: str) -> None:
        """Show an error as a notification and log it; the session goes on."""
        report(self.state, err, where)

    def soon(self, callback: Callable, *args, **kwargs) -> None:
        """Run ``callback`` on the document's next tick (now, outside a server)."""
        self.scheduler.soon(callback, *args, **kwargs)

    def redraw(self, where: Callable[[LiveView], bool]) -> None:
        """Redraw the views for which ``where(view)`` is true, now (what they read beside
        the selection has changed: the samples beside it are made ready again)."""
        self.neighbours.restart()
        self.scheduler.redraw(where)

    def _ahead_views(self) -> list[LiveView]:
        """The views whose elements are built ahead: the shown ones that read the sample
        (a background engine draws its maps as they come, none ahead)."""
        if self.background is not None:
            return []
        return [view for view in self.views if "sample" in view.parameters and view.shown]

    def _views_ahead(self, sel) -> list[Callable[[], None]]:
        """Build the shown views' elements of another sample, one a call."""
        return [partial(self.build_ahead, view, sel) for view in self._ahead_views()]

    def _retain_ahead(self, sels) -> None:
        """Keep the elements built ahead for ``sels`` only (a view that does not read the
        part of the selection that changed keeps its element)."""
        views = self._ahead_views()
        self.built_ahead.retain({self._ahead_key(view, sel) for sel in sels for view in views})

    def expected_seconds(self) -> float:
        """How long a change whose maps are not cached is expected to take (the sample's
        cells times a cost per cell learnt from the engine's own redraws)."""
        return self.scheduler.cost.expected_seconds()

    def when_idle(self, step: Callable[[], bool], first: bool = False) -> None:
        """Call ``step()`` while the served page is idle until it returns False, ``first``
        before the other steps (:meth:`~attnpanel.app.scheduler.Scheduler.when_idle`)."""
        self.scheduler.when_idle(step, first)

    def ahead(self, warm: Warm) -> None:
        """Compute ``warm(sel)``'s calls for the samples beside the shown one while the
        page is idle (:class:`~attnpanel.app.neighbours.NeighbourSamples`): a section's
        slow parts of a sample, ready before the user steps to it."""
        self.neighbours.add(warm)

    def start_idle(self) -> None:
        """Start the idle work once the page has loaded (a page built ahead of its session)."""
        self.scheduler.start_idle()

    def finish_idle(self) -> None:
        """Do all the idle work now (outside a server: a notebook, a test)."""
        self.scheduler.finish_idle()

    def drawing_now(self):
        """Within it, a change redraws its views before it returns, as outside a server."""
        return self.scheduler.drawing_now()

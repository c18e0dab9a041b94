"""When the explorer's views are redrawn after a change of its state, and in what order.

The :class:`Scheduler` watches the state's selection parameters. A change redraws only the
views that depend on it: outside a server (a notebook, a test) at once; on a served page
the large matrix and the query markers in the change's own message, the other views a
moment later, so that what the user acts on repaints first. A change whose maps must be
recomputed and whose redraw is expected to be slow (:class:`RedrawCost`) shows the busy
indicator first. A background engine (:class:`attnpanel.app.background.Background`)
computes the maps and the slow views on worker threads instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable
from functools import partial

import panel as pn
from panel.io.notebook import push_notebook

from attnpanel.app.background import Background
from attnpanel.app.documents import one_message, page_open, served_doc
from attnpanel.app.registry import LiveView, ViewRegistry
from attnpanel.app.state import SELECTION_PARAMS, VIEW_PARAMS, ExplorerState
from attnpanel.readouts.core import stages_cached
from attnpanel.util import untrusted

log = logging.getLogger(__name__)

IMAGE_PARAMS = {"sample", "head", "mask", "stage", "layer"}  # changes that repaint maps
CONTEXT_PARAMS = {"sample", "layer"}  # changes of what every view shows: one message
SECONDARY_DELAY_MS = 120
QUERY_DELAY_MS = 30
SLOW_DELAY_MS = 50  # the busy indicator goes out, then the slow maps are computed
MAPS_BUSY = "⏳ recomputing the maps from q and k …"
# Work done while the page is idle (maps sent ahead to the browser) waits this long after
# the last change, longer than a change's own deferred views, and goes one step a tick.
IDLE_AFTER_S = 0.25
IDLE_STEP_MS = 5
# A change whose maps are not cached and whose redraw is expected to take longer than this
# shows the busy indicator first. The expectation is the sample's attention cells (heads x
# query x key) times a cost per cell: first this guess (the demo's 1.8 M cells redraw in
# 0.06-0.10 s uncached on a 2-core machine, so its changes never wait for the indicator),
# then what the engine measured on its own uncached changes.
BUSY_AFTER_S = 0.25
SECONDS_PER_CELL = 5.5e-8
# One indicator for the page, fixed at its top right (visible wherever the page is
# scrolled): a per-plot one (Panel's ``loading``, or a style) makes BokehJS re-render each
# plot, 0.2-0.7 s apiece, longer than the recomputation it announces.
INDICATOR_STYLE = {
    "position": "fixed",
    "top": "8px",
    "right": "16px",
    "z-index": "1000",
    "background": "#fff8d6",
    "border": "1px solid #e0c060",
    "border-radius": "4px",
    "padding": "2px 10px",
    "font-size": "13px",
}


def announce_slow(doc, pending: dict, indicator: pn.pane.HTML) -> bool:
    """Where a pending view may take long (its last update took over :data:`BUSY_AFTER_S`
    on the event loop: a score attribution), show the busy indicator naming it, in a message
    of its own before it is computed. Returns whether it did."""
    slow = [view.name for view in pending.values()
            if view.slow and view.shown and view.seconds > BUSY_AFTER_S]  # fmt: skip
    if not slow or indicator.visible:
        return False
    with one_message(doc):
        indicator.object = f"⏳ computing {', '.join(slow)} …"
        indicator.visible = True
    return True


def report(state: ExplorerState, err: BaseException, where: str) -> None:
    """Show an error as a notification and log it; the session goes on."""
    message = f"{where} failed: {err}"
    log.error("%s\n%s", message, "".join(traceback.format_exception(err)))
    state.last_error = message
    if pn.state.notifications is not None:
        pn.state.notifications.error(untrusted.html_text(message), duration=8000)


class RedrawCost:
    """How long a change whose maps are not cached is expected to take to redraw.

    The sample's attention cells (heads x query x key) times a cost per cell, first
    :data:`SECONDS_PER_CELL`, then learnt from the uncached changes actually drawn.
    """

    def __init__(self, state: ExplorerState):
        self.state = state
        self.seconds_per_cell = SECONDS_PER_CELL
        self.timing: float | None = None  # seconds spent drawing the uncached change

    def cells(self) -> int:
        """The attention cells of one sample of the shown layer (heads x query x key)."""
        sizes = self.state.trace.sizes
        return sizes.get("head", 1) * sizes.get("query", 0) * sizes.get("key", 0)

    def expected_seconds(self) -> float:
        """The expected redraw time of an uncached change."""
        return self.cells() * self.seconds_per_cell

    def start(self) -> None:
        """An uncached change begins: time its redraw."""
        self.timing = 0.0

    @contextlib.contextmanager
    def timed(self):
        """Add the time spent inside to the change being timed (if one is)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.timing is not None:
                self.timing += time.perf_counter() - start

    def learn(self) -> None:
        """Fold the redraw time of the uncached change just drawn into the cost per cell."""
        cells = self.cells()
        if self.timing and cells:
            self.seconds_per_cell = 0.5 * self.seconds_per_cell + 0.5 * self.timing / cells
        self.timing = None


class Scheduler:
    """Redraws a registry's views when the state they depend on changes.

    Parameters
    ----------
    registry : attnpanel.app.registry.ViewRegistry
        The views and the models they draw into.
    background : bool
        Compute the maps and the views registered ``slow`` on worker threads: a served
        session's event loop never waits for them (a virtual trace's maps may take minutes).
    """

    def __init__(self, registry: ViewRegistry, background: bool = False):
        self.registry = registry
        self.state = registry.state
        self.cost = RedrawCost(self.state)
        self.root = None  # the layout pushed to a notebook after an update
        self._pending: dict[int, LiveView] = {}
        self._scheduled = False
        self._now = False  # draw every change at once (see drawing_now)
        self._idle: list[Callable[[], bool]] = []  # work for the idle page (when_idle)
        self._idle_doc = None  # the document whose loop runs it, once one is known
        self._idle_running = False
        self._last_change = 0.0
        # shown while maps are recomputed from q and k (the explorer lays it out)
        self.indicator = pn.pane.HTML(
            MAPS_BUSY,
            visible=False,
            styles=INDICATOR_STYLE,
            margin=0,
        )
        self.background = Background(self.indicator) if background else None
        # after the state's own followers (precedence 0): a view reads the state they leave
        # (a query moved by the slider takes back the clicked key before any view asks; in
        # a notebook the why views are then drawn twice, the second from the kept result)
        self.state.param.watch(self._on_change, [*SELECTION_PARAMS, *VIEW_PARAMS], precedence=1)

    @property
    def pending(self) -> int:
        """How many views wait to be drawn a moment after a change (its slower ones)."""
        return len(self._pending)

    def soon(self, callback: Callable, *args, **kwargs) -> None:
        """Run ``callback`` on the document's next tick (now, outside a server).

        A click's state change then goes out after the click's own message is handled.
        """
        doc = served_doc()
        if doc is None:
            callback(*args, **kwargs)
        else:
            doc.add_next_tick_callback(partial(self._in_one_message, doc, callback, args, kwargs))

    @staticmethod
    def _in_one_message(doc, callback: Callable, args, kwargs) -> None:
        with one_message(doc):
            callback(*args, **kwargs)

    def redraw(self, where: Callable[[LiveView], bool]) -> None:
        """Redraw the views for which ``where(view)`` is true, now."""
        views = [view for view in self.registry.views if where(view)]
        self._refresh_all(views, self.state.selection)
        self._push_notebook()

    def when_idle(self, step: Callable[[], bool], first: bool = False) -> None:
        """Call ``step()`` while the served page is idle, one call a tick, until it returns
        False: never while a change's views are pending, nor within :data:`IDLE_AFTER_S`
        of the last change, so that it never delays what the user does. It starts once
        the page has loaded (:meth:`start_idle`); outside a server it waits for
        :meth:`finish_idle`. Steps run in turn, ``first`` before the others."""
        if step not in self._idle:
            self._idle.insert(0 if first else len(self._idle), step)
        self._kick()

    def start_idle(self) -> None:
        """The page has loaded in its session: idle work runs on that session's loop from
        now (an explorer built ahead of its session does none before)."""
        doc = served_doc()
        if doc is not None:
            self._idle_doc = doc
            self._last_change = time.monotonic()  # the page's first paint goes first
            self._kick()

    def _kick(self) -> None:
        doc = self._idle_doc
        if doc is None or not self._idle or self._idle_running:
            return
        self._idle_running = True
        doc.add_timeout_callback(self._idle_step, IDLE_STEP_MS)

    def finish_idle(self) -> None:
        """Do all the idle work now (outside a server: a notebook, a test)."""
        while self._idle:
            if not self._idle[0]():
                self._idle.pop(0)

    def _idle_step(self) -> None:
        doc = self._idle_doc
        if not self._idle or doc.session_context is None or not page_open(doc):
            # (a closed page's idle work, its sections and maps sent ahead to nobody, ran
            # until Bokeh discarded its session: 1.3-1.8 s of the server's CPU for a page
            # closed at its first paint)
            self._idle_running = False
            return
        wait = IDLE_AFTER_S - (time.monotonic() - self._last_change)
        if self._pending or self._scheduled or wait > 0:
            doc.add_timeout_callback(self._idle_step, max(IDLE_STEP_MS, 1000 * wait))
            return
        step = self._idle[0]
        try:
            with one_message(doc):
                more = step()
        except Exception as err:  # noqa: BLE001 - idle work is a convenience: log, go on
            log.error("idle work failed\n%s", "".join(traceback.format_exception(err)))
            more = False
        if not more and self._idle and self._idle[0] is step:
            self._idle.pop(0)
        if self._idle:
            doc.add_timeout_callback(self._idle_step, IDLE_STEP_MS)
        else:
            self._idle_running = False

    @contextlib.contextmanager
    def drawing_now(self):
        """Within it, a change redraws its views before it returns, as outside a server.

        For changes made before a session's page is sent (its URL's selection, on an
        explorer built ahead): the first page must show them, not a later update.
        """
        self._now = True
        try:
            yield
        finally:
            self._now = False

    def _on_change(self, *events) -> None:
        self._last_change = time.monotonic()
        changed = {event.name for event in events}
        due = [v for v in self.registry.views if v.parameters & changed]
        followers = self.registry.followers(changed)
        sel = self.state.selection
        doc = served_doc()
        if doc is None or self._now:
            if changed & IMAGE_PARAMS and not self._cached(sel):
                self.cost.start()
            self._follow(followers)
            self._refresh_all(due, sel)
            self.cost.learn()
            self._push_notebook()
            return
        # Panel sends a change's model updates together when its callback returns: the
        # large matrix and the query markers go now, the other views later, so what the
        # user acts on repaints first. A new image takes the browser ~100 ms to map and
        # paint (software GL); the other views' updates would block that frame, so they
        # wait that long (a moved marker is cheap: 30 ms). Pending views coalesce across
        # fast events (a dragged slider). A change of what every view shows (another
        # sample or layer: ``CONTEXT_PARAMS``) goes as one message, every view and its
        # followers together: never two samples on the page at once. A change whose maps
        # must be recomputed and whose redraw is expected to be slow shows the busy
        # indicator first (``_slow``). (A background engine's workers show the indicator
        # themselves, when slow.)
        whole = bool(changed & CONTEXT_PARAMS)
        if self.background is None and changed & IMAGE_PARAMS and not self._cached(sel):
            self.cost.start()
            if self.cost.expected_seconds() > BUSY_AFTER_S:
                self._slow(doc, due, followers)
                return
        now = [view for view in due if view.first or whole]
        if whole:  # drawn now, so not again when an earlier change's wait ends
            now += [view for view in self._pending.values() if view not in now]
            self._pending.clear()
        with one_message(doc):  # one message for all of them, not one per property
            self._follow(followers)
            self._refresh_all(now, sel)
            for view in due:
                if not (view.first or whole):
                    self._pending[id(view)] = view
        if self._pending and not self._scheduled:
            self._scheduled = True
            # A timeout, not the next tick: the held priority message is flushed on a
            # next tick too and must go out before the other views are computed.
            delay = SECONDARY_DELAY_MS if changed & IMAGE_PARAMS else QUERY_DELAY_MS
            done = None
            if self.background is None and announce_slow(doc, self._pending, self.indicator):
                done, delay = self._indicator_off, max(delay, SLOW_DELAY_MS)
            doc.add_timeout_callback(partial(self._refresh_pending, doc, done=done), delay)
        elif not self._pending:
            self.cost.learn()

    def _follow(self, followers) -> None:
        for follower in followers:
            try:
                follower.callback()
            except Exception as err:  # noqa: BLE001 - any failure goes to the user
                report(self.state, err, "following the change")

    def _cached(self, sel) -> bool:
        try:
            return stages_cached(self.state.trace, sel, self.state.cache)
        except Exception:  # noqa: BLE001 - the views report their own errors
            return True

    def _slow(self, doc, due: list[LiveView], followers) -> None:
        """A change whose maps must be recomputed from q and k (a mask or sample not seen
        yet) and whose redraw is expected to take over :data:`BUSY_AFTER_S`: the page's
        busy indicator shows first, then the views are drawn together and it goes."""
        self.indicator.object = MAPS_BUSY
        self.indicator.visible = True
        for view in due:
            self._pending[id(view)] = view

        def draw():
            try:
                self._refresh_pending(doc, followers, done=self._indicator_off)
            finally:
                with one_message(doc):
                    self._indicator_off()

        # a timeout, not the next tick: the indicator's message must go out first
        doc.add_timeout_callback(draw, SLOW_DELAY_MS)

    def _push_notebook(self) -> None:
        if served_doc() is None and self.root is not None:
            # In a notebook, Bokeh models edited in place reach the page only when pushed
            # (a server session syncs them by itself).
            push_notebook(self.root)

    def _indicator_off(self) -> None:
        self.indicator.visible = False

    def _refresh_pending(self, doc, followers=(), done: Callable | None = None) -> None:
        """Draw the pending views and ``followers``, then ``done()``: one message."""
        self._scheduled = False
        pending, self._pending = list(self._pending.values()), {}
        sel = self.state.selection
        with one_message(doc):
            self._follow(followers)
            self._refresh_all(pending, sel)
            if done is not None:
                done()  # (the busy indicator goes with the views it announced)
        self.cost.learn()

    def _refresh_all(self, views: list[LiveView], sel) -> None:
        """Redraw ``views`` for ``sel``: a background engine's maps and slow views on its
        workers (drawn as each is ready), the others now, in order."""
        if self.background is None:
            for view in views:
                self._refresh(view, sel)
            return
        shown = [view for view in views if view.shown]
        element, draw = self.registry.element, self._draw_then_refine
        jobs = []
        for view in shown:
            if not view.offloadable:
                continue
            client = self.registry.client(view)
            if client is not None and client.draws(sel):  # the browser draws it: no job
                self.background.drop(id(view))  # nor the one in flight for another map
                client.follow(sel)
                continue
            jobs.append((id(view), partial(element, view, sel), partial(draw, view, sel)))
        self.background.run(jobs, self._failed)
        for view in shown:
            if not view.offloadable:
                self._refresh(view, sel)

    def _draw_then_refine(self, view: LiveView, sel, element) -> None:
        """Draw a background view, then ask for its refinement (if it has one now)."""
        self._draw_background(view, sel, element)
        built = None if view.refine is None else view.refine(sel)
        if built is not None:
            refined = partial(self.registry.element, view, sel, built)
            job = (id(view), refined, partial(self._draw_background, view, sel))
            self.background.run([job], self._failed, refine=True)

    def _draw_background(self, view: LiveView, sel, element) -> None:
        """Draw a background view's element; a map the browser may draw itself tells its
        client which map the page's own image now holds."""
        self.registry.draw(view, element)
        client = self.registry.client(view)
        if client is not None:
            client.drawn(sel)

    def _failed(self, key: int, err: BaseException) -> None:
        view = next(view for view in self.registry.views if id(view) == key)
        report(self.state, err, f"updating the {view.name}")

    def _refresh(self, view: LiveView, sel) -> None:
        if not view.shown:
            return
        started = time.perf_counter()
        with self.cost.timed():
            try:
                self.registry.update(view, sel)
            except Exception as err:  # noqa: BLE001 - any failure goes to the user, not the log only
                report(self.state, err, f"updating the {view.name}")
        view.seconds = time.perf_counter() - started

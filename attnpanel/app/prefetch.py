"""The large matrix's neighbouring maps, sent to the browser while the page is idle.

After a map is drawn, :class:`MatrixPrefetch` sends the browser, one a tick while the
page is idle (:meth:`attnpanel.app.scheduler.Scheduler.when_idle`), the maps a head, stage
or mask change would show next: every other head at the shown stage and mask, then the
shown head's other stages, then its other masks. They go as 8-bit levels, compressed
(:mod:`attnpanel.render.client_maps`), into a cache on the page; a change of head, stage or
mask whose map is there is drawn by the browser at once, and the server sends no image for
it, only the words around it (title, colour limits, the value's name), which it writes
from the same map. Every other view follows the change on the server as before.

What the cache holds shares one *context*: the sample, the layer, the enabled heads (the
mean of heads) and the zoomed window. A change of any of them empties it (the server
draws that change) and the sending starts again. The server knows exactly what the browser
holds: what it has streamed, in order, on the page's one connection, before the change
it is answering; a map still on its way is drawn by the browser when it lands.

With the query's weights bars (:mod:`attnpanel.render.client_bars`), the shown head's
weights for every query go first: a query change then redraws the bars in the browser too
(the server draws them as well, with the same numbers).

A background engine's map (a virtual trace's: from a stored overview, or a window computed
from ``q`` and ``k``) is made on its workers, one at a time and never shown as work the
user waits for, and sent when it comes back if the page still shows its context. What
goes is the map the server would draw last for that state (a window's own pixels, not the
overview's blocks drawn before them), and only where it is quick to make: a map whose
overview is not computed yet (seconds a head at L = 65,536) waits until the user goes
there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from attnpanel.app.engine import LiveEngine
from attnpanel.readouts.core import Selection, query_weights, stages_cached
from attnpanel.readouts.raster import image_limits
from attnpanel.render.client_bars import ClientBars
from attnpanel.render.client_maps import CachedMap, ClientLayer
from attnpanel.render.elements import CENTRED_GROUPS, MAP_KEY, PlotKey
from attnpanel.render.titles import fit_title
from attnpanel.render.views import weights_title

SWITCHED = ("head", "stage", "mask")  # the selection's parts a map's key names

MOST_MAPS = 200  # per context: every head x stage x mask of the demo is 9 x 5 x 3 = 135
# a map whose stages must be recomputed is sent ahead only if a change that recomputes
# them is expected this fast (an idle step holds the page's loop: a click waits for it;
# the demo's: 0.1-0.3 s, learnt from its own redraws)
STEP_BUDGET_S = 0.5


class MatrixPrefetch:
    """Sends a pane's neighbouring maps to the browser and tells the engine which changes
    the browser draws itself (the engine's :class:`~attnpanel.app.registry.BrowserDrawn`).

    Parameters
    ----------
    engine : attnpanel.app.engine.LiveEngine
        The explorer's engine (a background one's maps are made on its workers).
    pane : str
        The map's pane (``"matrix"``).
    layer : attnpanel.render.client_maps.ClientLayer
        The models on the page the maps go to.
    bars : attnpanel.render.client_bars.ClientBars, optional
        The query's weights bars the browser redraws too.
    switched : tuple of str
        The parts of the selection the page's widgets switch (of :data:`SWITCHED`): the
        neighbours vary those only.
    ready : callable, optional
        ``ready(sel)``: whether a background engine's map of ``sel`` is quick to make (a
        virtual trace's: its overview is stored); by default every map is.
    """

    def __init__(
        self,
        engine: LiveEngine,
        pane: str,
        layer: ClientLayer,
        bars: ClientBars | None = None,
        switched: tuple[str, ...] = SWITCHED,
        ready: Callable[[Selection], bool] | None = None,
    ):
        self.engine, self.pane, self.layer, self.bars = engine, pane, layer, bars
        self.switched, self.ready = switched, ready
        self._making: str | None = None  # the key a background worker is making now
        self._rows: set[str] = set()  # the heads' weights the browser holds (the bars')
        self.view = next(v for v in engine.views if v.pane == pane and v.raster is not None)
        self._sent: dict[str, CachedMap] = {}  # what the browser's cache holds (words only)
        self._skipped: set[str] = set()  # maps that could not be drawn (a missing variable)
        self._context: str | None = None
        engine.attach(pane, self)
        self.state.param.watch(self._on_ahead, "maps_ahead")

    @property
    def state(self):
        """The explorer's state (the selection, ``maps_ahead``)."""
        return self.engine.state

    def _on_ahead(self, event) -> None:
        if event.new:
            self.engine.when_idle(self.step)
        else:  # the server draws the shown map again: the page shows its exact image
            self.engine.redraw(lambda view: view is self.view)

    def context(self, sel: Selection) -> str:
        """What every map of the cache shares."""
        enabled = ",".join(map(str, sel.enabled_heads or ()))
        return f"{sel.layer}|{sel.sample}|{enabled}|{self.engine.window}"

    def key(self, sel: Selection) -> str:
        """A map's key, as the page's script builds it from the widgets."""
        return "|".join((self.context(sel), str(sel.head), sel.stage, str(sel.mask)))

    @property
    def sent(self) -> int:
        """How many maps of the current context the browser's cache holds."""
        return len(self._sent)

    def draws(self, sel: Selection) -> bool:
        """Whether the browser draws ``sel``'s map from its cache (the server sends no
        image for it)."""
        return (
            self.state.maps_ahead
            and self.context(sel) == self._context
            and self.key(sel) in self._sent
        )

    def follow(self, sel: Selection) -> None:
        """The browser draws ``sel``'s map: the server writes the words around it, and
        sends the new selection's neighbours once the page is idle."""
        self.layer.follow(self._sent[self.key(sel)])
        self.engine.when_idle(self.step)

    def drawn(self, sel: Selection) -> None:
        """The server has drawn ``sel``'s map: a new context empties the cache; the page
        learns which map its main layer holds; the neighbours follow once it is idle."""
        context = self.context(sel)
        if context != self._context:
            self._context, self._sent, self._skipped, self._rows = context, {}, set(), set()
            self.layer.reset(context)
            if self.bars is not None:
                self.bars.reset()
        self.layer.server_drew(self.key(sel))
        self.engine.when_idle(self.step)

    def shown(self, sel: Selection):
        """The map the page shows for ``sel`` if it is the browser's 8-bit copy (decoded as
        the browser decodes it), else None (the page shows the server's own image)."""
        if not self.draws(sel) or self.key(sel) == self.layer.state.server_key:
            return None
        return self._cached(sel).values()

    def neighbours(self, sel: Selection) -> list[Selection]:
        """The maps a change from ``sel`` shows next, nearest first: the other heads, then
        the head's other stages, then its other masks (each at every stage); only the parts
        the page switches (:attr:`switched`)."""

        def options(part: str) -> list:
            shown = getattr(sel, part)
            found = self.state.param[part].objects if part in self.switched else []
            return [shown, *(value for value in found if value != shown)]

        heads = [sel.with_(head=head) for head in options("head")]
        stages, masks = options("stage"), options("mask")
        others = [sel.with_(mask=mask, stage=stage) for mask in masks for stage in stages]
        return [sel, *heads, *others]

    def step(self) -> bool:
        """Send the nearest map the browser lacks; False when there is none (or the cache
        is full, or its context is no longer the shown one)."""
        sel = self.state.selection
        if not self.state.maps_ahead:
            return False
        if self.context(sel) != self._context:
            return False
        if self._send_rows(sel):
            return True
        if len(self._sent) >= MOST_MAPS:
            return False
        if self._making is not None:
            return False  # a worker is making one: the next step follows its arrival
        for near in self.neighbours(sel):
            key = self.key(near)
            if key not in self._sent and key not in self._skipped and self._cheap(near):
                break
        else:
            return False
        if self.engine.background is not None:
            self._make_on_worker(near, key)
            return self._making is None  # made at once (outside a server): the next one
        try:
            with self.state.cache.passing():  # the browser holds it: the server keeps no copy
                cached = self._cached(near)
        except Exception:  # noqa: BLE001 - no such map (a missing variable), no 8-bit copy ...
            self._skipped.add(key)  # the server draws it (and says why) if the user goes there
            return True
        self._send(cached)
        return True

    def _send(self, cached: CachedMap) -> None:
        self.layer.send(cached)
        # the server keeps the words, not the levels: it can make them again (shown)
        self._sent[cached.key] = replace(cached, blob=b"")

    def _make_on_worker(self, sel: Selection, key: str) -> None:
        """A background engine's map: made on its workers, sent once it is back if the page
        still shows its context; then the next one."""
        self._making = key

        def make() -> CachedMap:
            # (kept in the cache: what a virtual map reads there is the sample's q, k and
            # each row's lse, a few MB that every head of that mask reads again)
            return self._cached(sel)

        def arrived(cached: CachedMap) -> None:
            self._making = None
            if key.startswith(f"{self._context}|") and key not in self._sent:
                self._send(cached)
            self.engine.when_idle(self.step)

        def failed(_key, _err) -> None:
            self._making = None
            self._skipped.add(key)
            self.engine.when_idle(self.step)

        job = (("maps ahead", self.pane), make, arrived)
        self.engine.background.run([job], failed, quiet=True)

    def _cheap(self, sel: Selection) -> bool:
        """Whether ``sel``'s map is quick to make: a background engine's where
        :attr:`ready` says so; on the page's loop, where its stages are cached, or an
        uncached change is expected within :data:`STEP_BUDGET_S` (the demo's other masks;
        a trace several times its size waits until the user goes there)."""
        if self.engine.background is not None:
            return self.ready is None or self.ready(sel)
        cached = stages_cached(self.state.trace, sel, self.state.cache)
        return cached or self.engine.expected_seconds() <= STEP_BUDGET_S

    def rows_key(self, sel: Selection) -> str:
        """The key of the shown head's weights (the bars' rows), as the page's script
        builds it."""
        return "|".join((self.context(sel), str(sel.head), str(sel.mask)))

    def _send_rows(self, sel: Selection) -> bool:
        """Send the shown head's weights for every query, first (a query change is the
        most frequent); False if they are there (or there are no bars, or no weights)."""
        key = self.rows_key(sel)
        if self.bars is None or key in self._rows or key in self._skipped:
            return False
        try:
            weights = query_weights(self.state.trace, sel, self.state.cache)
        except Exception:  # noqa: BLE001 - a missing variable ...: the server draws the bars
            self._skipped.add(key)
            return True
        self.bars.send(key, weights, weights_title("{query}", sel.head))
        self._rows.add(key)
        return True

    def _cached(self, sel: Selection) -> CachedMap:
        """A map as the browser's cache holds it: the one the server draws last for
        ``sel`` (a refined view's refinement, where it has one)."""
        view = self.view
        built = None if view.refine is None else view.refine(sel)
        raster = self.engine.element(view, sel, built)
        limits = image_limits(raster.values, raster.group in CENTRED_GROUPS)
        # the title as the server writes it into the plot, and the value's name
        words = (fit_title(self.layer.handles["plot"], raster.label), raster.value_label)
        return CachedMap.of(
            self.key(sel), raster.values, raster.bounds, limits, self.layer.colours, *words
        )


def _parts(widget) -> dict[str, str]:
    """A select's value on the page (Panel sends an option's value as text, or its label
    where two values read alike) to the value as a map's key names it."""
    options = widget.options
    pairs = list(options.items()) if isinstance(options, dict) else [(o, o) for o in options]
    return {text: str(value) for label, value in pairs for text in (str(value), str(label))}


def switch_in_browser(
    engine: LiveEngine,
    widgets: dict,
    pane: str = "matrix",
    bars: str | None = None,
    ready: Callable[[Selection], bool] | None = None,
) -> MatrixPrefetch | None:
    """Let the page's head, stage and mask widgets redraw ``pane``'s map in the browser from
    maps sent ahead while the page is idle, and the query widget the query's weights bars
    drawn in pane ``bars``. Returns the :class:`MatrixPrefetch` (None where the map is not
    drawn, or the page has no head and mask widgets to tell the browser which map to draw).

    A part of the selection without a widget (a virtual trace's page has no stage) keeps
    the shown value in every key; ``ready``: see :class:`MatrixPrefetch`.
    """
    found = engine.handles(pane, MAP_KEY)
    if not found or not {"head", "mask"} <= set(widgets):
        return None
    layer = ClientLayer(found[0])
    drawn = engine.plots(bars) if bars else {}
    bar_handles = [h for key, hs in drawn.items() if key.group == "Vector" for h in hs]
    client_bars = None
    if bar_handles and "query" in widgets:
        markers = [h for key, hs in drawn.items() if key.kind == "VLine" for h in hs]
        boxes = engine.handles(pane, PlotKey("HSpan", "Marker"))
        client_bars = ClientBars(
            layer.state, bar_handles[0], (markers or [None])[0], (boxes or [None])[0]
        )
    switched = tuple(part for part in SWITCHED if part in widgets)
    prefetch = MatrixPrefetch(engine, pane, layer, client_bars, switched, ready)
    prefetch.drawn(engine.state.selection)  # the image the page opens with
    args = dict(layer.args, **(client_bars.args if client_bars else {}))
    if client_bars is not None:
        args["query"] = widgets["query"]
    shown = engine.state.selection
    for part in SWITCHED:  # a widget and its labels, or no widget and the shown value
        widget = widgets.get(part)
        args[part] = widget
        args[f"{part}s"] = _parts(widget) if widget is not None else str(getattr(shown, part))
    code = layer.widget_code() + (client_bars.widget_code() if client_bars else "")
    for part in switched:
        widgets[part].jscallback(args=args, value=code)
    if client_bars is not None:
        widgets["query"].jscallback(args=args, value=client_bars.widget_code())
    return prefetch

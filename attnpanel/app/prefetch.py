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
"""

from __future__ import annotations

from dataclasses import replace

from attnpanel.app.engine import LiveEngine
from attnpanel.readouts.core import Selection, query_weights, stages_cached
from attnpanel.readouts.raster import image_limits
from attnpanel.render.client_bars import ClientBars
from attnpanel.render.client_maps import CachedMap, ClientLayer
from attnpanel.render.elements import CENTRED_GROUPS
from attnpanel.render.views import weights_title

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
        The explorer's engine (not a background one: its maps are drawn on the page's loop).
    pane : str
        The map's pane (``"matrix"``).
    layer : attnpanel.render.client_maps.ClientLayer
        The models on the page the maps go to.
    """

    def __init__(
        self, engine: LiveEngine, pane: str, layer: ClientLayer, bars: ClientBars | None = None
    ):
        if engine.background is not None:
            raise ValueError("the maps of a background engine are not sent ahead")
        self.engine, self.pane, self.layer, self.bars = engine, pane, layer, bars
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
        the head's other stages, then its other masks (each at every stage)."""
        heads = [sel.with_(head=head) for head in self.state.param.head.objects]
        stages = list(self.state.param.stage.objects)
        masks = [sel.mask, *(m for m in self.state.param.mask.objects if m != sel.mask)]
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
        for near in self.neighbours(sel):
            key = self.key(near)
            if key not in self._sent and key not in self._skipped and self._cheap(near):
                break
        else:
            return False
        try:
            with self.state.cache.passing():  # the browser holds it: the server keeps no copy
                cached = self._cached(near)
        except Exception:  # noqa: BLE001 - no such map (a missing variable), no 8-bit copy ...
            self._skipped.add(key)  # the server draws it (and says why) if the user goes there
            return True
        self.layer.send(cached)
        # the server keeps the words, not the levels: it can make them again (shown)
        self._sent[key] = replace(cached, blob=b"")
        return True

    def _cheap(self, sel: Selection) -> bool:
        """Whether ``sel``'s map is quick to make on the page's loop: its stages are
        cached, or an uncached change is expected within :data:`STEP_BUDGET_S` (the demo's
        other masks; a trace several times its size waits until the user goes there)."""
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
        """A map as the browser's cache holds it."""
        raster = self.engine.element(self.view, sel)
        limits = image_limits(raster.values, raster.group in CENTRED_GROUPS)
        words = (raster.label, raster.value_label)  # the title, the value's name
        return CachedMap.of(
            self.key(sel), raster.values, raster.bounds, limits, self.layer.colours, *words
        )

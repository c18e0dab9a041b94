"""The samples beside the shown one, made ready while the page is idle.

A sample change redraws every view in one message (:mod:`attnpanel.app.scheduler`). What
makes it slow is what the new sample needs computed: its maps recomputed from ``q`` and
``k``, the model run again with each head off (head importance), every layer captured
(the rollout). :class:`NeighbourSamples` computes those of the next and the previous
sample while the page is idle, one piece a step
(:meth:`~attnpanel.app.scheduler.Scheduler.when_idle`: a click waits for one piece at
most, tens of milliseconds), into the caches the views read; the arrow keys' next sample
then redraws from them. Each section says what a sample needs with
:meth:`NeighbourSamples.add`: ``warm(sel) -> [call, ...]`` for a selection of another
sample, each call one piece.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from attnpanel.app.state import SELECTION_PARAMS
from attnpanel.readouts.core import Selection

Warm = Callable[[Selection], Iterable[Callable[[], object]]]


class NeighbourSamples:
    """Computes, while the page is idle, what the samples beside the shown one need.

    Parameters
    ----------
    state : attnpanel.app.state.ExplorerState
        The shown selection (its ``sample``, ``layer``, ``mask``, ``stage``).
    when_idle : callable
        The engine's :meth:`~attnpanel.app.engine.LiveEngine.when_idle`.
    views : callable
        ``views(sel) -> [call, ...]``: the views' elements of ``sel`` built ahead, after
        every section's pieces (which they read).
    retain : callable
        ``retain(sels)``: keeps the elements built ahead for the neighbours' selections
        ``sels`` only (those of a selection no longer shown go).
    """

    def __init__(self, state, when_idle: Callable, views: Warm, retain: Callable):
        self.state = state
        self._when_idle = when_idle
        self._views, self._retain = views, retain
        self._warms: list[Warm] = []
        self._queue: deque = deque()
        self._for: Selection | None = None  # the selection whose neighbours are queued
        # another selection: its neighbours' work replaces the old one's (_step); any other
        # change of the state (the reference curves shown, a section's switch) may change
        # what the views built ahead draw: they are built again
        state.param.watch(self._start, list(SELECTION_PARAMS))
        unselected = [p for p in state.param if p not in SELECTION_PARAMS and p != "name"]
        state.param.watch(self.restart, unselected)

    def add(self, warm: Warm) -> None:
        """Also compute ``warm(sel)``'s calls for the neighbours' selections ``sel``."""
        self._warms.append(warm)
        self._start()

    def samples(self) -> list[int]:
        """The neighbours of the shown sample: the next, then the previous."""
        shown, count = self.state.sample, self.state.trace.sizes.get("batch", 1)
        return [s for s in (shown + 1, shown - 1) if 0 <= s < count]

    def restart(self, *_events) -> None:
        """Drop what was built ahead and build it again (what it read has changed)."""
        self._for = None
        self._retain([])
        self._start()

    def _start(self, *_events) -> None:
        # before the other idle work (the maps of the other heads sent ahead): the next
        # sample is the slow change (its head importance alone is 25 forwards of the demo)
        self._when_idle(self._step, first=True)

    def _step(self) -> bool:
        """One piece of the neighbours' work; False once every piece is done."""
        sel = self.state.selection
        if sel != self._for:  # the user moved on: the new neighbours' work replaces it
            self._for = sel
            near = [sel.with_(sample=sample) for sample in self.samples()]
            self._retain(near)
            warms = (*self._warms, self._views)
            self._queue = deque(call for other in near for warm in warms for call in warm(other))
        if self._queue:
            self._queue.popleft()()
        return bool(self._queue)

"""Views computed on worker threads: the served page stays responsive while maps compute.

On a virtual trace a map can take from milliseconds (a window cut from a stored overview)
to minutes (the overviews of a mask not computed yet: ~10 s per head at L = 65,536 on two
cores). Computed in a Bokeh callback, that time would block the server process: the
session's own clicks, and every other session of the process, would wait for it.

:class:`Background` runs such views' builds on a small thread pool (torch and numpy
release the GIL while they compute) and hands each result back to the session's event
loop (``Document.add_next_tick_callback``, the one document method safe from another
thread), where it is drawn. A view asked again before its last result came back draws
only the newest one, and a computation superseded while it runs stops at its next step
(:mod:`attnpanel.util.cancel`) instead of holding a worker to its end. The page's busy
indicator shows once work has been in flight for :data:`IN_FLIGHT_BUSY_S`, with the number
of views still computing, and goes when all are drawn. Outside a server (a notebook,
the tests, the benchmarks) the same pool computes a change's views side by side and the
call returns once they are drawn.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import panel as pn

from attnpanel.app.documents import one_message
from attnpanel.util import cancel

log = logging.getLogger(__name__)

IN_FLIGHT_BUSY_S = 0.3  # work still in flight after this long shows the busy indicator
THREADS = min(4, os.cpu_count() or 2)


def served(doc) -> bool:
    """Whether ``doc`` is a live server session's document."""
    return doc is not None and doc.session_context is not None


class Background:
    """A session's worker threads for slow views, and the busy indicator that tells of them.

    Parameters
    ----------
    indicator : panel.pane.HTML
        The page's busy indicator (shown and hidden here; its text counts the views).
    threads : int
        Worker threads (one pool per session, so that one session's long computation never
        queues another's).
    """

    def __init__(self, indicator: pn.pane.HTML, threads: int = THREADS):
        self.indicator = indicator
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="attnpanel-views")
        # refinements (seconds each) wait for one another, never for the views
        self._refiner = ThreadPoolExecutor(1, thread_name_prefix="attnpanel-refine")
        self._tickets = itertools.count()
        self._latest: dict[Hashable, int] = {}  # key -> ticket of its newest computation
        self._in_flight = 0
        self._since = 0.0  # when the work in flight now began

    @property
    def in_flight(self) -> int:
        """Computations submitted and not yet handed back."""
        return self._in_flight

    def run(
        self,
        jobs: Sequence[tuple[Hashable, Callable, Callable]],
        failed: Callable[[Hashable, BaseException], None],
        refine: bool = False,
        quiet: bool = False,
    ) -> None:
        """Compute each job's ``compute()`` on the workers and call its ``draw(result)``.

        Parameters
        ----------
        jobs : sequence of (key, compute, draw)
            ``compute()`` runs on a worker thread; ``draw(result)`` on the session's event
            loop (in a server session), only if no newer job of the same key was submitted
            meanwhile.
        failed : callable
            ``failed(key, error)`` for a computation that raised (on the event loop).
        refine : bool
            Slow refinements of views already drawn: one at a time on a worker of their
            own, skipped if their view changed before their turn.
        quiet : bool
            Work done ahead of the user (maps sent to the browser while the page is idle):
            it never shows the busy indicator, which tells of the views the user waits for.
        """
        if not jobs:
            return
        doc = pn.state.curdoc
        pool = self._refiner if refine else self._pool
        if not served(doc):
            self._run_here(pool, jobs, failed)
            return
        for key, compute, draw in jobs:
            ticket = next(self._tickets)
            self._latest[key] = ticket
            if not quiet:
                self._started(doc)
            future = pool.submit(self._unless_superseded, key, ticket, compute)
            arrived = partial(self._arrived, doc, key, ticket, draw, failed, quiet)
            future.add_done_callback(partial(self._hand_back, doc, arrived))

    def drop(self, key: Hashable) -> None:
        """The computation of ``key`` in flight, if any, is not drawn (stopped at its next
        step): what it would draw is no longer what the page shows."""
        self._latest.pop(key, None)

    def _unless_superseded(self, key, ticket, compute):
        """On a worker: ``compute()``, stopped at its next :func:`cancel.check` once a
        newer job of the same view comes (its result would not be drawn anyway)."""

        def wanted() -> bool:
            return self._latest.get(key) == ticket

        if not wanted():
            return None  # superseded before its turn
        with cancel.while_wanted(wanted):
            try:
                return compute()
            except cancel.Superseded:
                log.debug("a superseded computation of %r stopped", key)
                return None

    def _run_here(self, pool, jobs, failed) -> None:
        """Outside a server: every job side by side on the workers, drawn in order."""
        futures = [(key, pool.submit(compute), draw) for key, compute, draw in jobs]
        for key, future, draw in futures:
            try:
                result = future.result()
            except Exception as err:  # noqa: BLE001 - reported to the user by ``failed``
                failed(key, err)
            else:
                draw(result)

    def _started(self, doc) -> None:
        if self._in_flight == 0:
            self._since = time.monotonic()
            doc.add_timeout_callback(partial(self._show, doc), 1000 * IN_FLIGHT_BUSY_S)
        self._in_flight += 1

    def _show(self, doc) -> None:
        waited = time.monotonic() - self._since
        if self._in_flight and waited >= 0.9 * IN_FLIGHT_BUSY_S:
            with one_message(doc):
                self.indicator.object = self._text()
                self.indicator.visible = True

    def _text(self) -> str:
        views = f"{self._in_flight} view{'s' if self._in_flight != 1 else ''}"
        return f"⏳ computing {views} from q and k …"

    def _hand_back(self, doc, arrived, future: Future) -> None:
        """On the worker thread: queue the result on the session's event loop."""
        try:
            doc.add_next_tick_callback(partial(arrived, future))
        except Exception:  # noqa: BLE001 - the session is gone: nothing to draw into
            log.debug("a view computed for a closed session was dropped", exc_info=True)

    def _arrived(self, doc, key, ticket, draw, failed, quiet, future: Future) -> None:
        """On the event loop: draw the result if it is the newest of its key."""
        if not quiet:  # (quiet work was never counted)
            self._in_flight -= 1
        with one_message(doc):
            if self._latest.get(key) == ticket:
                try:
                    result = future.result()
                except Exception as err:  # noqa: BLE001 - reported to the user by ``failed``
                    failed(key, err)
                else:
                    draw(result)
            if self._in_flight == 0:
                self.indicator.visible = False
            elif self.indicator.visible:
                self.indicator.object = self._text()

    def close(self) -> None:
        """Stop the workers once their current jobs end (the session is over)."""
        for pool in (self._pool, self._refiner):
            pool.shutdown(wait=False, cancel_futures=True)

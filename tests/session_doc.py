"""A document that acts as a served session's, for tests that need one without a server."""

from __future__ import annotations

import queue
import types

from bokeh.document import Document


class SessionDocument(Document):
    """A served session's document: what is scheduled on its loop (a next tick, a timeout)
    is queued in ``loop`` for the test to run, as Tornado would, or to find left unrun.

    Parameters
    ----------
    arguments : dict
        The arguments of the request that opened it (Panel's ``pn.state.session_args``).
    """

    def __init__(self, arguments: dict | None = None):
        super().__init__()
        self.loop = queue.SimpleQueue()
        self.arguments = arguments or {}
        self.connection_count = 1  # the browsers that hold its page (Bokeh's ServerSession)

    @property
    def session_context(self):
        return self  # anything but None: a live session

    @property
    def session(self):  # Bokeh's ServerSession (its connections)
        return self

    @property
    def request(self):  # the request that opened it (Panel reads its URL's arguments)
        return types.SimpleNamespace(arguments=self.arguments)

    def add_next_tick_callback(self, callback):
        self.loop.put(callback)

    def add_timeout_callback(self, callback, timeout_milliseconds):
        self.loop.put(callback)

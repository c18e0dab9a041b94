"""The served page's document: which one it is, whether its page is open, and how the
server's own changes reach it.

Panel sends a widget's update through a queue of its own (``panel.io.document.unlocked``):
written at once, or, while another write is in progress, serialized now and written later.
Bokeh's path (a held document's ``unhold``, a plain change in a callback) writes at once. A
change sent Bokeh's way could overtake a message Panel had queued before it and name a model
the page was never sent: the head tiles' role names overtook the section that holds them
("reference p1694 isn't known", one loaded page in three with two busy cores).
:func:`one_message` sends every change the server makes of itself (a draw, an idle step, a
result from a worker, a callback on the next tick) Panel's way once the page has loaded,
behind whatever Panel queued. A plain change in a callback was the one that went Bokeh's way.
"""

from __future__ import annotations

import contextlib

import panel as pn
from panel.io.state import set_curdoc


def served_doc():
    """The served session's document, or None outside a server (a notebook, a test)."""
    doc = pn.state.curdoc
    return None if doc is None or doc.session_context is None else doc


def page_open(doc) -> bool:
    """Whether a browser still holds the served document's page: Bokeh keeps a session
    whose page has closed until it discards it (up to half a minute), with no connection."""
    session = getattr(doc.session_context, "session", None)
    return session is None or session.connection_count > 0


@contextlib.contextmanager
def one_message(doc):
    """Within it, ``doc`` is the current document and the changes made reach its page as
    one message, in order with the messages Panel queued before them: Panel's ``hold`` on
    the session's own thread sends them Panel's way once the page has loaded (before, held
    and sent together by Bokeh, as Panel's own are then)."""
    with set_curdoc(doc), pn.io.hold(doc):
        yield

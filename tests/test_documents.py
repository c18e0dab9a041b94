"""The server's own changes reach a loaded page in the order they were made.

Panel serializes a widget's update as it happens and, while another write is in progress,
writes it later; Bokeh's path (a held document's ``unhold``, a plain change in a callback)
writes at once. A change sent Bokeh's way overtook a message Panel had queued before it and
named a model the page had not been sent ("reference p1694 isn't known": the head tiles'
role names, set on the next tick, overtook the section holding them; one page in three with
two busy cores, and once in CI). These tests hold a fake connection's write lock, so every
message Panel creates is queued, and check that nothing the explorer does of itself then
goes Bokeh's way.
"""

from __future__ import annotations

import threading
import types

import panel as pn
from bokeh.models import ColumnDataSource
from panel.io.state import set_curdoc
from session_doc import SessionDocument
from test_explorer import make_trace

from attnpanel.app.documents import one_message
from attnpanel.app.explorer import AttentionExplorer


class Connection:
    """A browser's connection whose socket is busy writing: Panel queues each message,
    created as the change is made (Bokeh's own ``create('PATCH-DOC', events)``)."""

    def __init__(self):
        busy = types.SimpleNamespace(_block=types.SimpleNamespace(_value=0))
        self._socket = types.SimpleNamespace(write_lock=busy)
        self.protocol = self
        self.queued: list[list] = []

    def create(self, kind, events):
        assert kind == "PATCH-DOC"
        self.queued.append([(event.model.id, getattr(event, "attr", "")) for event in events])


class BokehPath:
    """What reaches the session by Bokeh's own path (``ServerSession._document_patched``)."""

    def __init__(self, doc):
        self.sent = []
        doc.callbacks.on_change_dispatch_to(self)

    def _document_patched(self, event):
        self.sent.append((event.model.id, getattr(event, "attr", "")))


def loaded_page(doc: SessionDocument) -> Connection:
    """Mark ``doc``'s page loaded on this thread, with one busy connection (Panel's state
    of a session whose page has sent ``document_ready``)."""
    connection = Connection()
    doc._subscribed_connections = [connection]
    pn.state._loaded[doc] = True
    pn.state._connected[doc] = True
    pn.state._thread_id_[doc] = threading.get_ident()
    return connection


def run_loop(doc: SessionDocument, *, skip=("_dispatch_msgs",)) -> None:
    """Run what was scheduled on ``doc``'s loop, except Panel's writer (its socket stays
    busy in these tests)."""
    while not doc.loop.empty():
        callback = doc.loop.get()
        if getattr(callback, "func", None) is not None and callback.func.__name__ in skip:
            continue
        with set_curdoc(doc):
            callback()


def test_a_change_after_one_panel_queued_goes_behind_it():
    doc = SessionDocument()
    first, second = ColumnDataSource(dict(x=[0])), ColumnDataSource(dict(x=[0]))
    doc.add_root(first)
    doc.add_root(second)
    connection = loaded_page(doc)
    bokeh = BokehPath(doc)
    with one_message(doc):
        first.data = dict(x=[1])  # queued: the socket is busy
    with one_message(doc):
        second.data = dict(x=[2])
        second.name = "second"  # the same message as the data
    assert bokeh.sent == []
    assert connection.queued == [[(first.id, "data")], [(second.id, "data"), (second.id, "name")]]


def test_what_the_explorer_does_of_itself_on_a_loaded_page_goes_behind_panels_queue():
    """A change of the state, a callback on the next tick (the tiles' role names were one)
    and the page's idle work (the sections below the fold): all Panel's way, in order."""
    doc = SessionDocument()
    later = ColumnDataSource(dict(x=[0]))  # what the callback on the next tick changes
    with set_curdoc(doc):
        explorer = AttentionExplorer(make_trace())
        doc.add_root(explorer.__panel__().get_root(doc))
        doc.add_root(later)
    run_loop(doc)  # the page as first sent
    connection = loaded_page(doc)
    bokeh = BokehPath(doc)
    with set_curdoc(doc):
        explorer.param.update(head=1)
        explorer.engine.soon(lambda: setattr(later, "data", dict(x=[1])))
        explorer.engine.scheduler.start_idle()  # as once the page has loaded
    run_loop(doc)  # the change's later views, the callback, then the idle work
    assert explorer.later.waiting == 0  # the sections below the fold came
    assert bokeh.sent == []
    ids = [[model for model, _ in message] for message in connection.queued]
    [at] = [i for i, message in enumerate(ids) if later.id in message]
    assert at > 0  # behind the head change's message, queued before it


def test_a_sample_change_redraws_the_views_an_earlier_query_left_pending_once():
    """A query change leaves its slower views for a moment later; a sample change before
    that moment draws every view in its one message, and nothing of it again after (the
    value views and the input curve came a second time: CI saw the page send them twice)."""
    doc = SessionDocument()
    with set_curdoc(doc):
        explorer = AttentionExplorer(make_trace())
        doc.add_root(explorer.__panel__().get_root(doc))
    run_loop(doc)
    connection = loaded_page(doc)
    with set_curdoc(doc):
        explorer.param.update(query=5)
        assert explorer.engine.scheduler.pending  # the query's slower views wait
        explorer.param.update(sample=1)
    before = len(connection.queued)
    run_loop(doc)
    assert not explorer.engine.scheduler.pending
    assert connection.queued[before:] == []


def test_a_view_that_took_long_is_announced_before_it_is_drawn_again():
    """A slow view computed on the event loop (a score attribution, about 1.5 s) shows the
    page's busy indicator, naming it, in a message before it is computed; the indicator
    goes with the views drawn. One that took no time shows nothing."""
    doc = SessionDocument()
    with set_curdoc(doc):
        explorer = AttentionExplorer(make_trace(), show_head_average=True)
        doc.add_root(explorer.__panel__().get_root(doc))
    run_loop(doc)
    loaded_page(doc)
    scheduler = explorer.engine.scheduler
    with set_curdoc(doc):
        scheduler.start_idle()  # the sections below the fold come
    run_loop(doc)
    view = next(v for v in explorer.engine.views if v.slow and v.shown and "mask" in v.parameters)
    with set_curdoc(doc):
        explorer.param.update(mask="causal")
    assert not scheduler.indicator.visible  # it took milliseconds
    run_loop(doc)
    view.seconds = 1.5  # as long as a score attribution takes
    with set_curdoc(doc):
        explorer.param.update(mask="none")
    assert scheduler.indicator.visible and view.name in scheduler.indicator.object
    run_loop(doc)
    assert not scheduler.indicator.visible

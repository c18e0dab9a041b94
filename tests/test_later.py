"""The sections below the fold (attnpanel/app/later.py): out of a served page's first
paint, in their place once it is idle; in a notebook or a test, in place at once."""

from __future__ import annotations

import queue
import time

import panel as pn
from bokeh.document import Document
from panel.io.state import set_curdoc
from session_doc import SessionDocument
from test_explorer import make_trace

from attnpanel.app.explorer import BELOW_THE_FOLD, AttentionExplorer
from attnpanel.app.later import PLACEHOLDER_CLASS, LaterSections


def test_a_held_section_takes_its_place_one_step_at_a_time():
    later = LaterSections()
    assert not later.notice.visible  # nothing waits: no line
    sections = [pn.pane.Markdown("first"), pn.pane.Markdown("second")]
    holders = [later.hold(s) for s in sections]
    assert later.waiting == 2 and later.notice.visible
    assert later.notice.object == "*The sections below are drawn once the page above is painted.*"
    assert PLACEHOLDER_CLASS in later.notice.css_classes
    assert all(holder.objects == [] for holder in holders)
    assert later.fill_one() is True  # one more waits
    assert holders[0].objects == [sections[0]] and holders[1].objects == []
    assert later.notice.visible
    assert later.fill_one() is False
    assert holders[1].objects == [sections[1]] and later.waiting == 0
    assert not later.notice.visible
    assert later.fill_one() is False  # nothing left: a no-op


def shown(layout) -> list:
    return [obj for holder in layout.objects for obj in getattr(holder, "objects", [])]


def test_an_explorer_built_ahead_holds_the_sections_below_the_fold_until_shown():
    explorer = AttentionExplorer.built(make_trace())
    layout = explorer.lay_out()
    assert explorer.later.waiting == len(BELOW_THE_FOLD)
    assert explorer.later.notice in layout.objects and explorer.later.notice.visible
    for name in BELOW_THE_FOLD:  # built already: they follow the state while they wait
        assert explorer.sections[name].__panel__() not in shown(layout)
    explorer.param.update(sample=1, head=2)
    # shown outside a server (a notebook, a test): every section in its place at once
    explorer.__panel__().get_root(Document())
    assert explorer.later.waiting == 0 and not explorer.later.notice.visible
    assert all(explorer.sections[name].__panel__() in shown(layout) for name in BELOW_THE_FOLD)
    # in the order of the page
    places = [shown(layout).index(explorer.sections[n].__panel__()) for n in BELOW_THE_FOLD]
    assert places == sorted(places)


def test_the_sections_go_first_in_a_served_pages_idle_work():
    explorer = AttentionExplorer.built(make_trace())
    steps = []
    explorer.engine.when_idle(lambda: steps.append(explorer.later.waiting) and False)
    explorer.engine.when_idle(explorer.later.fill_one, first=True)
    explorer.engine.finish_idle()
    assert steps == [0]  # the other step ran after every section was in place


def test_a_closed_pages_idle_work_stops_with_it():
    """Bokeh keeps a session whose page has closed until it discards it (up to half a
    minute). Its idle work (the sections, the maps sent ahead) ran on meanwhile for no
    browser: 1.3-1.8 s of the server's CPU for a page closed at its first paint. It stops
    with the page."""
    doc = SessionDocument()
    explorer = AttentionExplorer.built(make_trace())
    steps = []
    explorer.engine.when_idle(lambda: steps.append(len(steps)) or True)  # always more to do
    with set_curdoc(doc):
        explorer.engine.start_idle()

    def run_loop(until) -> None:  # as Tornado would, the callbacks queued on the document
        deadline = time.monotonic() + 10
        while not until() and time.monotonic() < deadline:
            try:
                callback = doc.loop.get(timeout=1)
            except queue.Empty:
                return
            callback()

    run_loop(lambda: len(steps) >= 2)  # the page is open: its idle work runs
    assert len(steps) >= 2
    doc.connection_count = 0  # the page closed
    done = len(steps)
    run_loop(lambda: False)
    assert len(steps) == done and doc.loop.empty()  # nothing ran, nothing is queued

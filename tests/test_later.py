"""The sections below the fold (attnpanel/app/later.py): out of a served page's first
paint, in their place once it is idle; in a notebook or a test, in place at once."""

from __future__ import annotations

import panel as pn
from bokeh.document import Document
from test_explorer import make_trace

from attnpanel.app.explorer import BELOW_THE_FOLD, AttentionExplorer
from attnpanel.app.later import PLACEHOLDER_CLASS, LaterSections


def placeholders(layout) -> list:
    return [
        pane
        for pane in layout.select(pn.pane.Markdown)
        if PLACEHOLDER_CLASS in (pane.css_classes or [])
    ]


def test_a_held_section_takes_its_place_one_step_at_a_time():
    later = LaterSections()
    sections = [pn.pane.Markdown("first"), pn.pane.Markdown("second")]
    holders = [later.hold(f"section {i}", s) for i, s in enumerate(sections)]
    assert later.waiting == 2
    assert [h.objects[0].object for h in holders] == [
        "*section 0: drawn once the page above is painted*",
        "*section 1: drawn once the page above is painted*",
    ]
    assert later.fill_one() is True  # one more waits
    assert holders[0].objects == [sections[0]] and placeholders(holders[1])
    assert later.fill_one() is False
    assert holders[1].objects == [sections[1]] and later.waiting == 0
    assert later.fill_one() is False  # nothing left: a no-op


def test_an_explorer_built_ahead_holds_the_sections_below_the_fold_until_shown():
    explorer = AttentionExplorer.built(make_trace())
    layout = explorer.lay_out()
    assert explorer.later.waiting == len(BELOW_THE_FOLD)
    assert len(placeholders(layout)) == len(BELOW_THE_FOLD)
    shown = [obj for holder in layout.objects for obj in getattr(holder, "objects", [])]
    for name in BELOW_THE_FOLD:  # built already: they follow the state while they wait
        assert explorer.sections[name].__panel__() not in shown
    explorer.param.update(sample=1, head=2)
    # shown outside a server (a notebook, a test): every section in its place at once
    explorer.__panel__().get_root(Document())
    assert explorer.later.waiting == 0 and placeholders(layout) == []
    shown = [obj for holder in layout.objects for obj in getattr(holder, "objects", [])]
    assert all(explorer.sections[name].__panel__() in shown for name in BELOW_THE_FOLD)


def test_the_sections_go_first_in_a_served_pages_idle_work():
    explorer = AttentionExplorer.built(make_trace())
    steps = []
    explorer.engine.when_idle(lambda: steps.append("maps") and False)
    explorer.engine.when_idle(explorer.later.fill_one, first=True)
    explorer.engine.finish_idle()
    assert explorer.later.waiting == 0
    assert steps == ["maps"]  # after every section was in place

"""What every page kind holds in its link (docs/explorer.md, "What a link holds").

For each kind (the dense page, a text model's, the long page of a virtual trace, a capture
of several groups, the comparison of two captures, a recording's page with its model at
hand), every control a person can change on the page is changed, widget by widget; what it
changed must be in the page's URL, and a new page opened from that URL must show it. A
refused value is named once, with what would be accepted. The table in the docs is the
code's: a test reads it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import panel as pn
import pytest
from page_kinds import KINDS
from panel.io.location import Location

from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.groups_explorer import GroupsExplorer
from attnpanel.app.url import KEY as HEADS_OFF

DOCS = Path(__file__).resolve().parent.parent / "docs" / "explorer.md"


SERVED: dict = {}  # the location of the page opened last, as a served session's


@pytest.fixture(autouse=True)
def served(monkeypatch):
    """``pn.state.location`` is the last opened page's, as in a served session (an explorer
    a change brings, another group's, syncs with it then)."""
    monkeypatch.setattr(type(pn.state), "location", property(lambda _: SERVED.get("location")))
    yield
    SERVED.clear()


def shown(page):
    """The explorer whose selection the page shows (a groups page: its shown group's)."""
    return page.explorer if isinstance(page, GroupsExplorer) else page


def opened(make, search: str = ""):
    """A page of the kind ``make`` opened at the link ``?search``: (page, its location)."""
    SERVED["location"] = location = Location(search=search)
    page = make()
    page.__panel__()
    if shown(page) is not page:  # (a groups page lays its group's explorer out when drawn)
        shown(page).__panel__()
    return page, location


def states(page) -> dict:
    """What the page's state holds, by parameter (a groups page: its layer, and the shown
    group's selection)."""
    found = {"layer": page.layer} if isinstance(page, GroupsExplorer) else {}
    for name, value in shown(page).param.values().items():
        if name not in ("name", "last_error", "survey", "model") and name not in found:
            found[name] = value
    return found


def widgets(page) -> list:
    """Every widget on the page whose value a person can change (shown and enabled)."""
    kinds = (pn.widgets.Select, pn.widgets.IntSlider, pn.widgets.Checkbox, pn.widgets.IntInput)
    kinds += (pn.widgets.Player, pn.widgets.RadioButtonGroup, pn.widgets.CheckButtonGroup)
    kinds += (pn.widgets.IntRangeSlider,)
    layouts = {id(p): p for p in (page.__panel__(), shown(page).__panel__())}.values()
    found = {id(w): w for layout in layouts for w in layout.select(pn.widgets.Widget)}
    return [w for w in found.values() if isinstance(w, kinds) and w.visible and not w.disabled]


def options(widget) -> list:
    return list(widget.options.values() if isinstance(widget.options, dict) else widget.options)


def other_values(widget) -> list:
    """Values of ``widget`` other than its own, to set in turn (a menu: each of its others)."""
    value = widget.value
    if isinstance(widget, pn.widgets.Checkbox):
        return [not value]
    if isinstance(widget, pn.widgets.CheckButtonGroup):
        every = options(widget)
        return [every[1:]] if len(every) > 1 else []
    if isinstance(widget, (pn.widgets.Select, pn.widgets.RadioButtonGroup)):
        return [o for o in options(widget) if o != value]
    if isinstance(widget, pn.widgets.IntRangeSlider):
        low, high = value
        return [(low, (low + high) // 2)] if high - low > 1 else [(widget.start, widget.end)]
    low, high = getattr(widget, "start", None), getattr(widget, "end", None)
    if low is None or high is None:
        low, high = value - 1, value + 1
    return [v for v in (value + 1, value - 1) if low <= v <= high][:1]


def change_everything(page) -> dict:
    """Change every control of ``page``, each to each of its other values in turn, and the
    controls each change shows (the patching section's, a corruption's span) as they come;
    the page is left with every control changed. Returns the parameters each control
    changed, by a label of the control."""
    found, seen = {}, set()

    def visit():
        for widget in widgets(page):
            if id(widget) in seen:
                continue
            seen.add(id(widget))
            for new in other_values(widget):
                before = states(page)
                widget.value = new
                after = states(page)
                changed = {n for n in after if not equal(after[n], before.get(n))}
                found.setdefault(f"{type(widget).__name__} {widget.name!r}", set()).update(changed)
                visit()  # the controls this value showed

    visit()
    return {label: names for label, names in found.items() if names}


def equal(a, b) -> bool:
    try:
        return bool(np.all(a == b)) if not isinstance(a, (list, tuple)) else list(a) == list(b)
    except (TypeError, ValueError):
        return a is b


def link_arguments(page) -> dict:
    """The page's link: parameter -> its argument in the URL (the heads switched off as
    ``off``; a groups page adds its shown group's)."""
    found = {**shown(page).URL_PARAMS, **page.URL_PARAMS}
    if isinstance(shown(page), AttentionExplorer):  # (its heads' toggles: url.HeadsOffInUrl)
        found["enabled_heads"] = HEADS_OFF
    return found


def docs_table() -> dict[str, set[str]]:
    """docs/explorer.md's table: each page kind's link arguments ("as dense": dense's)."""
    text = DOCS.read_text()
    start = text.index("## What a link holds")
    rows = re.findall(r"^\| ([a-z]+) \| (.+?) \|$", text[start:], flags=re.MULTILINE)
    found = {kind: set(re.findall(r"`([a-z_]+)`", args)) for kind, args in rows}
    for kind, args in rows:
        if args.startswith("as dense"):
            found[kind] |= found["dense"]
    return {kind: args for kind, args in found.items() if kind in KINDS}


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request):
    return request.param


def test_every_change_a_person_makes_is_in_the_link_and_reopens(kind):
    """Change each control of the page; what it changed is in the URL, and a page opened
    from that URL shows it."""
    page, location = opened(KINDS[kind])
    found = change_everything(page)
    assert found, f"{kind}: no control changed the page's state"
    arguments = link_arguments(page)
    unlinked = {label: names - set(arguments) for label, names in found.items()}
    assert not any(unlinked.values()), f"{kind}: not in the link: {unlinked}"
    again, _ = opened(KINDS[kind], location.search)
    want, got = states(page), states(again)
    linked = set().union(*found.values())
    assert {n: got[n] for n in linked} == {n: want[n] for n in linked}, location.search


def test_the_docs_table_is_what_each_kind_holds(kind):
    page, _ = opened(KINDS[kind])
    assert docs_table()[kind] == set(link_arguments(page).values())


def test_a_refused_value_is_named_with_what_is_accepted(kind):
    page, _ = opened(KINDS[kind], "?head=99&sample=1")
    named = shown(page).last_error
    assert re.fullmatch(r"reading the link failed: head=99: not one of [\d, ]+(, mean)?", named)
    assert shown(page).sample == 1  # the rest of the link holds


def test_a_groups_page_mirrors_its_link_once(monkeypatch):
    """Showing a group's explorer made the page mirror its link again on each draw (one more
    watcher of the URL each time)."""
    synced = []
    monkeypatch.setattr(GroupsExplorer, "sync_url", lambda self: synced.append(self))
    page, _ = opened(KINDS["groups"])
    page.layer = page.param.layer.objects[-1]
    for _ in range(3):
        page.__panel__()
    assert len(synced) == 1

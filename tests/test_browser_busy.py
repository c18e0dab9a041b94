"""The busy indicator in the served explorer (Chromium): a change whose maps must be
recomputed and whose redraw is expected to be slow shows it first (``tests/busy_app.py``
serves the demo with the threshold at 0: the demo's own changes are too fast to need it)."""

from __future__ import annotations

import pytest
from served_app import ROOT, opened, serve

APP = ROOT / "tests" / "busy_app.py"


def matrix_js() -> str:
    return "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"


def matrix_hash(page) -> int:
    return page.evaluate(f"attn.hash({matrix_js()})")


def set_widget(page, title: str, value) -> None:
    page.evaluate("([t, v]) => { attn.widget(t).value = v; }", [title, value])


def wait_matrix_change(page, before: int) -> None:
    page.evaluate(f"(b) => attn.until_changed({matrix_js()}, b)", before)


@pytest.fixture(scope="module")
def app(browser):
    with serve(APP) as (url, _proc), opened(browser, url) as served:
        yield served


def test_a_slow_change_shows_a_busy_indicator_first(app, artifacts):
    """A sample whose maps are not computed yet shows the page's busy indicator, fixed at
    the top right of the window, before the maps are drawn, and hides it once they are; a
    change whose maps are cached shows none."""
    page, console = app
    page.evaluate(
        """(() => {
          window.__busy = [];
          Bokeh.documents[0].on_change((e) => {
            if (e.attr !== 'visible' || !String(e.model.text).includes('recomputing')) return;
            const v = attn.views().find((v) => v.model === e.model);
            const r = v.el.getBoundingClientRect();
            window.__busy.push({visible: e.model.visible, top: r.top, right: r.right,
                                width: r.width, position: getComputedStyle(v.el).position,
                                matrix: attn.plots().find(
                                  (p) => /^sample \\d+, /.test(p.model.title.text))
                                  .model.title.text});
          });
        })()"""
    )
    page.evaluate("window.scrollTo(0, 900)")  # the indicator is in view wherever one is
    before = matrix_hash(page)
    set_widget(page, "Sample", 29)  # not drawn yet
    wait_matrix_change(page, before)
    page.wait_for_function("() => window.__busy.length >= 2", timeout=30_000)
    shown, hidden = page.evaluate("window.__busy")[:2]
    assert shown["visible"] and not hidden["visible"], (shown, hidden)
    assert shown["position"] == "fixed" and 0 <= shown["top"] < 40 and shown["width"] > 100
    assert 1500 < shown["right"] <= 1600, shown  # at the window's right edge
    assert not shown["matrix"].startswith("sample 29, "), shown  # before the new maps
    assert page.evaluate(f"{matrix_js()}.model.title.text").startswith("sample 29, ")
    page.evaluate("window.__busy = []")
    before = matrix_hash(page)
    set_widget(page, "Sample", 0)  # drawn before: cached, no indicator
    wait_matrix_change(page, before)
    page.wait_for_timeout(500)
    assert page.evaluate("window.__busy") == []
    page.evaluate("window.scrollTo(0, 0)")
    assert [m for m in console if m[0] in ("error", "pageerror")] == []

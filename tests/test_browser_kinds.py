"""Every page kind walked through its controls in Chromium, its words checked in every state.

The page kinds of ``tests/page_kinds.py`` (a text model's, the long page, a capture of
several groups, the comparison of two captures, a recording's with its model; the demo page
has its own walk, ``test_browser_states.py``) are served by ``tests/kinds_app.py``. On each,
every control a person can change is changed in turn, as the page shows them (a menu to its
first, middle and last other value, a slider a step, a checkbox ticked: the sections it
opens are walked too), the page widened to 1600 px and narrowed to 1280 px at every other
change. In every state reached, ``served_app.WORDS_JS`` must find nothing: titles and axis
labels that fit (measured in their own fonts), ranges that hold their data and no more, no
table or text wider than its box, no "NaN". Every problem is collected with its state and
reported together; screenshots of each kind at both widths are written to ``artifacts/``.
"""

from __future__ import annotations

import sys

import pytest
from served_app import HELPERS_JS, LATER_JS, ROOT, WORDS_JS, free_port, serving, shot

KINDS = ("text", "long", "groups", "compare", "recording")
WIDTHS = (1280, 1600)

# The controls shown now, in page order: [title, kind, values to set in turn].
CONTROLS_JS = r"""
() => {
  const shown = (v) => v.el && v.el.isConnected && v.el.getBoundingClientRect().width > 0;
  const out = [];
  for (const v of attn.views()) {
    const m = v.model;
    if (!m || !shown(v) || m.disabled) continue;
    if (/Select$/.test(m.type) && m.title && Array.isArray(m.options)) {
      const values = m.options.map((o) => (Array.isArray(o) ? o[0] : o))
        .filter((o) => o !== m.value);
      const picked = [...new Set([values[0], values[Math.floor(values.length / 2)],
                                  values[values.length - 1]])].filter((o) => o !== undefined);
      out.push([m.title, "select", picked]);
    } else if (m.type === "Slider" && m.title) {
      const step = m.step || 1;
      out.push([m.title, "slider", [m.value + step <= m.end ? m.value + step : m.value - step]]);
    } else if (m.type === "Checkbox" && m.label && !m.active) {
      out.push([m.label, "checkbox", [true]]);
    } else if (m.type === "RadioButtonGroup") {
      const others = m.labels.map((_, i) => i).filter((i) => i !== m.active);
      out.push([m.labels.join("/"), "radio", others.slice(0, 2)]);
    }
  }
  return out;
}
"""
SET_JS = r"""
([title, kind, value]) => {
  const v = attn.views().find((v) => v.model && (
    v.model.title === title || v.model.label === title ||
    (v.model.labels && v.model.labels.join("/") === title)));
  if (kind === "checkbox") v.model.active = value;
  else if (kind === "radio") v.model.active = value;
  else v.model.value = value;
}
"""
# What the page shows now (titles, ranges, data sizes), to tell when nothing moves any more.
SNAPSHOT_JS = r"""() => JSON.stringify(attn.plots().map((v) => [v.model.title.text,
  v.model.x_range.start, v.model.x_range.end, v.model.y_range.start, v.model.y_range.end,
  ...v.model.renderers.map((r) => r.data_source &&
    Object.values(r.data_source.data).map((c) => (c && c.length) || 0))]))"""


def open_kind(browser, url: str, console: list):
    """A page of any kind opened: every plot on it drawn and every section in its place
    (the compare page has no top view, which ``served_app.opened`` waits for)."""
    page = browser.new_page(viewport={"width": WIDTHS[0], "height": 1300})
    page.on("console", lambda msg: console.append((msg.type, msg.text)))
    page.on("pageerror", lambda err: console.append(("pageerror", str(err))))
    page.goto(url, timeout=180_000)
    page.wait_for_function("() => window.Bokeh && Object.keys(Bokeh.index).length > 0")
    page.evaluate(HELPERS_JS)
    page.wait_for_function(
        f"() => attn.plots().length > 0 && Bokeh.documents[0].is_idle && ({LATER_JS})()",
        timeout=180_000,
    )
    return page


def settle(page) -> None:
    """Wait until the document is idle and no plot changes over two looks 250 ms apart."""
    before = None
    for _ in range(120):
        page.wait_for_function("() => Bokeh.documents[0].is_idle", timeout=120_000)
        now = page.evaluate(SNAPSHOT_JS)
        if now == before:
            return
        before = now
        page.wait_for_timeout(250)
    raise AssertionError("the page kept changing")


@pytest.fixture(scope="module")
def kinds_url():
    port = free_port()
    cmd = [
        sys.executable, "-m", "panel", "serve", str(ROOT / "tests" / "kinds_app.py"),
        "--port", str(port), "--address", "127.0.0.1",
        "--allow-websocket-origin", f"127.0.0.1:{port}",
    ]  # fmt: skip
    with serving(cmd, port, f"http://127.0.0.1:{port}/kinds_app") as (url, _):
        yield url


@pytest.mark.parametrize("kind", KINDS)
def test_every_control_of_every_page_kind_leaves_words_that_fit(
    browser, kinds_url, kind, artifacts
):
    problems: list[str] = []
    console: list = []
    page = open_kind(browser, f"{kinds_url}?kind={kind}", console)
    try:
        steps, seen = 0, set()

        def check(state: str) -> None:
            settle(page)
            width = WIDTHS[steps % 2]
            problems.extend(f"{kind}, {state}, {width} px: {p}" for p in page.evaluate(WORDS_JS))

        for width in WIDTHS:
            page.set_viewport_size({"width": width, "height": 1300})
            check("as opened")
            shot(page, artifacts, f"kind_{kind}_{width}")
        while True:
            fresh = [c for c in page.evaluate(CONTROLS_JS) if (c[0], c[1]) not in seen]
            if not fresh:
                break
            title, control, values = fresh[0]
            seen.add((title, control))
            for value in values:
                steps += 1
                page.set_viewport_size({"width": WIDTHS[steps % 2], "height": 1300})
                page.evaluate(SET_JS, [title, control, value])
                check(f"{title} = {value}")
    finally:
        page.close()
    errors = [m for m in console if m[0] in ("error", "pageerror")]
    assert not errors, errors
    assert steps > 3, steps  # the walk changed the page's controls
    assert problems == [], "\n".join(problems)

"""The page's "why this cell" and composition graph in real headless Chromium on the served
demo: a URL opens them on a cell; the shares the page paints are the model's own score
split the long way (``test_why_page.long_way``); a click on the matrix explains another
cell; a click on a line of the graph draws both heads and opens the later one; every title,
axis and table fits at 1280 and 1600 px (``served_app.WORDS_JS``)."""

from __future__ import annotations

import urllib.parse

import numpy as np
import pytest
from served_app import WORDS_JS, opened, shot
from test_browser_app import hover_point, hover_text
from test_why_page import long_way

from attnpanel.nilm.demo import demo_model_run

SAMPLE, HEAD, QUERY, KEY = 1, 3, 100, 90
SHARES_JS = """() => Object.fromEntries(attn.plot('why sample').model.renderers
  .filter((r) => r.glyph.type === 'Line')
  .map((r) => { const c = r.glyph.line_color, share = r.data_source.data.share;
                return [typeof c === 'string' ? c : c.value, Array.from(share)]; }))"""
# a point 70 % of the way along the first line into the last layer, and its two heads
EDGE_JS = """() => { const pv = attn.plot('K-composition');
  const r = pv.model.renderers.find((r) => r.glyph.type === 'MultiLine');
  const d = r.data_source.data; const last = Math.max(...d.x1);
  const i = d.x1.findIndex((x) => x === last), n = d.xs[i].length;
  const x = d.xs[i][Math.round(0.7 * (n - 1))], y = d.ys[i][Math.round(0.7 * (n - 1))];
  const rect = pv.el.getBoundingClientRect();
  return { x: rect.left + pv.frame.x_scale.compute(x), y: rect.top + pv.frame.y_scale.compute(y),
           earlier: d.earlier[i], later: d.later[i] }; }"""


# the left and right page x of the shares plot's frame and of the plot right above it
FRAMES_JS = """() => { const shares = attn.plot('why sample');
  const edges = (pv) => { const r = pv.el.getBoundingClientRect(), b = pv.frame.bbox;
                          return [r.left + b.left, r.left + b.right, r.top, r.bottom]; };
  const below = edges(shares);
  const above = attn.plots().filter((pv) => pv !== shares && pv.el.offsetParent !== null)
    .map(edges).filter((e) => e[3] <= below[2] + 2).sort((a, b) => b[3] - a[3])[0];
  return [below.slice(0, 2), above.slice(0, 2)]; }"""


def titled(page, words: str, timeout: int = 120_000) -> None:
    page.wait_for_function(
        "(w) => attn.plots().some((v) => v.model.title.text.replace(/\\s+/g, ' ').startsWith(w))",
        arg=words,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def app(browser, demo_url):
    query = urllib.parse.urlencode(
        {"why": "true", "composition": "true", "sample": SAMPLE, "head": HEAD}
        | {"query": QUERY, "key": KEY}
    )
    with opened(browser, f"{demo_url}?{query}") as served:
        yield served


def test_the_shares_painted_are_the_models_own_split(app, artifacts):
    page, console = app
    titled(page, f"why sample {SAMPLE}, query {QUERY} (")
    drawn = page.evaluate(SHARES_JS)  # by colour: blue the query side, vermillion the key's
    _, _, (query_side, key_side) = long_way(demo_model_run(), SAMPLE, HEAD, QUERY, KEY)
    change = abs(query_side.sum() + key_side.sum())
    np.testing.assert_allclose(drawn["#0072b2"], query_side, atol=2e-4 * change)
    np.testing.assert_allclose(drawn["#d55e00"], key_side, atol=2e-4 * change)
    rows = page.evaluate("attn.table('sum of the shares').innerText")
    assert "completeness error" in rows and "aggregate power" in page.evaluate(
        "attn.table('through the key').innerText"
    )
    for width in (1280, 1600):
        page.set_viewport_size({"width": width, "height": 1300})
        page.evaluate("attn.plot('why sample').el.scrollIntoView({block: 'center'})")
        page.wait_for_timeout(300)
        problems = page.evaluate(WORDS_JS)
        assert problems == [], "\n".join(problems)
        frames = page.evaluate(FRAMES_JS)  # the input's and the shares' on one x axis
        assert abs(frames[0][0] - frames[1][0]) <= 1 and abs(frames[0][1] - frames[1][1]) <= 1
        page.screenshot(path=str(artifacts / f"browser_why_section_{width}.png"))
    shot(page, artifacts, "why")
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_a_click_on_the_matrix_explains_that_cell(app):
    page, console = app
    titled(page, f"why sample {SAMPLE}, query {QUERY} (")
    page.set_viewport_size({"width": 1600, "height": 1300})
    matrix = f"sample {SAMPLE}, head {HEAD}"
    page.evaluate(f"attn.plot({matrix!r}).el.scrollIntoView({{block: 'center'}})")
    point = page.evaluate(f"attn.frame_point(attn.plot({matrix!r}), 201.5 / 480, 150.5 / 480)")
    page.mouse.click(point["x"], point["y"])
    titled(page, f"why sample {SAMPLE}, query 150 (")
    title = page.evaluate("attn.plot('why sample').model.title.text").replace("\n", " ")
    assert "→ key 201 (" in title
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_a_click_on_a_line_draws_both_heads(app, artifacts):
    page, console = app
    titled(page, "K-composition")
    for width in (1600, 1280):
        page.set_viewport_size({"width": width, "height": 1300})
        page.evaluate("attn.plot('K-composition').el.scrollIntoView({block: 'center'})")
        page.wait_for_timeout(300)
        edge = page.evaluate(EDGE_JS)
        page.mouse.click(edge["x"], edge["y"])
        titled(page, f"{edge['earlier']}, sample {SAMPLE}")
        titled(page, f"{edge['later']}, sample {SAMPLE}")
        problems = page.evaluate(WORDS_JS)
        assert problems == [], "\n".join(problems)
        page.screenshot(path=str(artifacts / f"browser_composition_{width}.png"))
    # a head's dot hovers as the head alone (all its lines meet there: they listed them all)
    graph = "attn.plot('K-composition')"
    dot = hover_text(page, graph, 1.0, 0.0)
    assert "OV copying score" in dot and "composition score" not in dot, dot
    line = hover_point(page, {"x": edge["x"], "y": edge["y"]})  # 70 % along a line
    assert "composition score" in line and edge["earlier"] in line, line
    later_head = edge["later"].rsplit(" ", 1)[1]
    page.wait_for_function(
        """(h) => { const w = attn.widget('Head');
                   const o = w.options.find((o) => (Array.isArray(o) ? o[0] : o) === w.value);
                   return (Array.isArray(o) ? o[1] : o) === `head ${h}`; }""",
        arg=later_head,
    )
    assert [e for e in console if e[0] in ("error", "pageerror")] == []

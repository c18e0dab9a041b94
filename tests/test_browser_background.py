"""A long trace's slow maps are computed off the server's event loop (Chromium).

``tests/slow_long_app.py`` serves the explorer of a virtual trace whose overviews under a
mask other than its own take seconds each (as they do at L = 65,536). Switching the mask
must leave the page and the server answering: a query change repaints its row while the
maps compute, another session opens and renders, the busy indicator says how many views
are computing and goes once they are drawn; the maps that arrive are the new mask's.
"""

from __future__ import annotations

import numerics
import numpy as np
import pytest
from pairs import long_layer_pair
from served_app import ROOT, image_js, open_app, opened, serve

from attnpanel.readouts import windows
from attnpanel.traces.overviews import Overviews

APP = ROOT / "tests" / "slow_long_app.py"
MATRIX = "sample 0, head 0"

WATCH_JS = """
(() => {
  window.__events = [];
  const t0 = performance.now();
  Bokeh.documents[0].on_change((e) => {
    if (e.attr === 'text' && typeof e.value === 'string') {
      if (e.value.startsWith('query ')) window.__events.push(['row', e.value]);
      if (e.value.startsWith('sample 0, head 0')) window.__events.push(['matrix', e.value]);
    }
    const said = String(e.model.text || '');
    if (e.attr === 'visible' && said.includes('computing')) {
      window.__events.push([e.model.visible ? 'busy' : 'idle', String(e.model.text)]);
    }
  });
})()
"""

IMAGE_JS = image_js(MATRIX)


@pytest.fixture(scope="module")
def app(browser):
    with serve(APP) as (url, _proc), opened(browser, url) as served:
        yield (*served, url)


def test_a_mask_whose_maps_take_seconds_leaves_the_page_and_the_server_answering(
    app, browser, artifacts
):
    page, console, url = app
    page.evaluate(WATCH_JS)
    page.evaluate("attn.widget('Mask').value = 'causal'")
    page.wait_for_function("() => window.__events.some((e) => e[0] === 'busy')", timeout=30_000)
    # while the maps compute: a query change repaints its row
    page.evaluate("attn.widget('Query (exact)').value = 123")
    page.wait_for_function(
        "() => window.__events.some((e) => e[0] === 'row' && e[1].startsWith('query 123,'))",
        timeout=30_000,
    )
    # ... and another session opens and renders
    other = open_app(browser, url, [])
    try:
        assert "mask diagonal" in other.evaluate(f"attn.plot({MATRIX!r}).model.title.text")
        arrived = page.evaluate(
            "() => window.__events.some((e) => e[0] === 'matrix' && e[1].includes('causal'))"
        )
        assert not arrived, "the other session waited for the first one's maps"
    finally:
        other.close()
    page.wait_for_function("() => window.__events.some((e) => e[0] === 'idle')", timeout=120_000)
    events = page.evaluate("window.__events")
    kinds = [kind for kind, _ in events]
    first_map = next(i for i, (k, t) in enumerate(events) if k == "matrix" and "causal" in t)
    row = next(i for i, (k, t) in enumerate(events) if k == "row" and t.startswith("query 123,"))
    assert kinds.index("busy") < row < first_map < kinds.index("idle"), events
    assert (
        "computing" in events[kinds.index("busy")][1] and "view" in events[kinds.index("busy")][1]
    )
    # the maps that arrived are the causal mask's: each pixel the maximum of its cells
    found = page.evaluate(IMAGE_JS)
    drawn = np.array([np.nan if v is None else v for v in found["values"]]).reshape(found["shape"])
    _, virtual = long_layer_pair()
    expected, _ = windows.VirtualMap(
        virtual, Overviews(virtual), 0, 0, "causal", lambda: None
    ).raster(*found["shape"][::-1])
    np.testing.assert_array_equal(np.isnan(drawn), np.isnan(expected))
    numerics.assert_same_numbers(drawn, expected)  # the page's pixels are the raster's
    assert [m for m in console if m[0] in ("error", "pageerror", "dialog")] == []


def test_a_window_cut_from_the_overview_is_then_drawn_from_its_own_cells(app, artifacts):
    """Zoomed to a window the overview shows coarser than the screen, the large map first
    shows the overview's blocks, saying it computes the window, then the window's own
    cells (computed on the refinement worker)."""
    page, console, _ = app
    page.evaluate(WATCH_JS)
    page.evaluate(
        """(() => { const p = attn.plot('sample 0, head 0').model;
                    p.x_range.setv({start: 99.5, end: 399.5});
                    p.y_range.setv({start: 449.5, end: 149.5}); })()"""
    )
    page.wait_for_function(
        "() => attn.plot('sample 0, head 0').model.title.text.includes('every cell')",
        timeout=60_000,
    )
    titles = [t for kind, t in page.evaluate("window.__events") if kind == "matrix"]
    coarse = next(i for i, t in enumerate(titles) if "computing this window" in t)
    assert "overview" in titles[coarse]
    assert coarse < next(i for i, t in enumerate(titles) if "every cell" in t), titles
    assert [m for m in console if m[0] in ("error", "pageerror", "dialog")] == []

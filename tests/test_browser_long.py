"""``attnpanel serve --demo long`` in headless Chromium: the explorer of a virtual trace.

The long demo is built once into a temporary cache (one day here, L = 1,440, so that the
test stays short; the page is the same at 45 days), then served. The page must read right
at 1280 and 1600 px, draw the stored overview, let a click pick a query (its row and top
keys follow) and a wheel zoom re-rasterize the window from q, k and lse: the pixels the
browser holds equal the window recomputed from the stored trace. A head change whose map
was sent ahead is drawn by the browser (no image from the server), with the pixels a page
opened on that head draws from the server's image; a zoomed window's heads follow once
sent, and a mask whose overviews are not computed goes to the server.
"""

from __future__ import annotations

import sys

import numerics
import numpy as np
import pytest
from client_cache import (
    Frames,
    assert_a_link_draws_the_same,
    browser_drew,
    idle_cache,
    layers_js,
)
from served_app import (
    PAGE_TEXT_JS,
    free_port,
    image_js,
    open_app,
    opened,
    page_widths,
    serving,
    shot,
)

from attnpanel.nilm.demo import stored_long_demo
from attnpanel.traces import io, virtual

DAYS = 1
LENGTH = DAYS * 24 * 60

IMAGE_JS = image_js("sample 0, head")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The long demo's server: its page's URL and the demo's cache."""
    cache = tmp_path_factory.mktemp("long-demo")
    port = free_port()
    cmd = [sys.executable, "-m", "attnpanel", "serve", "--demo", "long", "--days", str(DAYS)]
    cmd += ["--cache", str(cache), "--port", str(port)]
    with serving(cmd, port, f"http://localhost:{port}/attnpanel", timeout=400) as (url, _):
        yield url, cache


@pytest.fixture(scope="module")
def served(browser, server):
    url, cache = server
    with opened(browser, url) as page_console:
        yield (*page_console, cache)


def _title(page, prefix: str) -> str:
    return page.evaluate(f"attn.plot({prefix!r}).model.title.text")


def test_the_long_page_reads_right_at_both_widths(served, artifacts):
    page, console, _ = served
    assert page_widths(page) == {1280: 1280, 1600: 1600}  # no horizontal scroll
    for width in (1280, 1600):
        page.set_viewport_size({"width": width, "height": 1300})
        page.wait_for_timeout(800)
        shot(page, artifacts, f"long_demo_{width}")
    matrix = _title(page, "sample 0, head 0")
    assert "mask diagonal" in matrix and "overview" in matrix
    row = _title(page, "query 0, head 0")
    assert f"all {LENGTH:,} keys" in row
    text = page.evaluate(PAGE_TEXT_JS)
    assert "virtual trace" in text and "rank" in text
    assert "1 held-out day at one minute" in text  # the heading, whole and in the singular
    # clock times on the map's and the curves' axes (positions stay the coordinates)
    for prefix in ("sample 0, head", "sample 0: aggregate", "query 0"):
        kind = page.evaluate(f"attn.plot({prefix!r}).model.below[0].formatter.type")
        assert kind == "CustomJSTickFormatter", prefix
    assert [m for m in console if m[0] in ("error", "pageerror", "dialog")] == []


def test_a_click_picks_a_query_and_a_wheel_zooms_to_exact_cells(served, artifacts):
    page, console, cache = served
    page.set_viewport_size({"width": 1600, "height": 1300})
    point = page.evaluate("attn.frame_point(attn.plot('sample 0, head'), 0.5, 0.25)")
    page.mouse.click(point["x"], point["y"])
    page.wait_for_function(
        "() => !attn.plot('query ').model.title.text.startsWith('query 0,')", timeout=30_000
    )
    query = int(_title(page, "query ").split(",")[0].split()[1])
    assert abs(query - LENGTH // 4) < LENGTH // 50
    page.mouse.move(point["x"], point["y"])
    for _ in range(14):  # until the window holds fewer cells than the plot's pixels
        page.mouse.wheel(0, -240)
        page.wait_for_timeout(60)
    page.wait_for_function(
        "() => attn.plot('sample 0, head').model.title.text.includes('every cell')",
        timeout=30_000,
    )
    page.wait_for_timeout(500)
    shot(page, artifacts, "long_demo_zoomed_1600")
    found = page.evaluate(IMAGE_JS)
    x0, y0, dw, dh = found["extent"]
    rows, cols = found["shape"]
    assert (rows, cols) == (round(dh), round(dw))
    drawn = np.array([np.nan if v is None else v for v in found["values"]]).reshape(rows, cols)
    ds = io.load(stored_long_demo(days=DAYS, folder=cache))
    queries = slice(round(y0 + 0.5), round(y0 + 0.5) + rows)
    keys = slice(round(x0 + 0.5), round(x0 + 0.5) + cols)
    expected = virtual.window(ds, 0, 0, queries, keys)
    blocked = np.equal.outer(
        np.arange(queries.start, queries.stop), np.arange(keys.start, keys.stop)
    )
    np.testing.assert_array_equal(np.isnan(drawn), blocked)  # the diagonal mask, drawn apart
    # the page's window and virtual.window: tiles of the same lse, possibly cut otherwise
    logits = numerics.trace_logits(ds)
    numerics.assert_kernels_agree(drawn[~blocked], expected[~blocked], logits=logits)
    assert [m for m in console if m[0] in ("error", "pageerror", "dialog")] == []


MATRIX = "() => attn.plot('sample 0, head')"
LAYERS_JS = layers_js(MATRIX)


def test_a_head_whose_map_was_sent_ahead_is_drawn_by_the_browser_as_the_server_draws_it(
    browser, server, artifacts
):
    url, _ = server
    frames, console = Frames(), []
    page = open_app(browser, url, console, before=frames.listen)
    try:
        assert idle_cache(page, 8) == 8  # every head's stored overview (the own mask's)
        shown = {}
        for head in ("2", "5", "3"):  # (head 0: the server's own image, shown as drawn)
            after = browser_drew(page, frames, MATRIX, ("Head", head), ("head", head))
            assert after["title"].startswith(f"sample 0, head {head}, mask diagonal")
            shown[head] = after
            # the other views follow on the server: the query's row names the head
            row = page.evaluate("attn.plot('query ').model.title.text")
            assert f"head {head}" in row, row
        # a mask whose overviews are not computed: the server draws it
        received, _ = frames.mark()
        page.evaluate("attn.widget('Mask').value = 'causal'")
        page.wait_for_function(
            f"() => ({MATRIX})().model.title.text.includes('mask causal')", timeout=60_000
        )
        page.wait_for_timeout(300)
        drawn = page.evaluate(LAYERS_JS)
        assert drawn["main"] and not drawn["level"]
        assert frames.named(received, drawn["main_source"]) != []
        page.evaluate("attn.widget('Mask').value = 'diagonal'")
        page.wait_for_function(
            f"() => ({MATRIX})().model.title.text.includes('mask diagonal')", timeout=60_000
        )
        # zoomed: the window's maps of the other heads follow once sent
        page.set_viewport_size({"width": 1600, "height": 1300})
        point = page.evaluate(f"attn.frame_point(({MATRIX})(), 0.5, 0.5)")
        page.mouse.move(point["x"], point["y"])
        for _ in range(3):
            page.mouse.wheel(0, -240)
            page.wait_for_timeout(60)
        page.mouse.move(0, 0)
        page.wait_for_function(
            f"() => !({MATRIX})().model.title.text.includes('(overview)')", timeout=30_000
        )
        idle_cache(page, 8)  # the window's eight heads (a new window empties the cache)
        window = page.evaluate(f"(({MATRIX})().model.x_range.start)")
        zoomed = browser_drew(page, frames, MATRIX, ("Head", "1"), ("head", "1"))
        assert zoomed["title"].startswith("sample 0, head 1, mask diagonal")
        assert "(this window)" in zoomed["title"] or "every cell" in zoomed["title"]
        assert page.evaluate(f"(({MATRIX})().model.x_range.start)") == window
        shot(page, artifacts, "long_demo_head_in_browser_1600")
        assert [m for m in console if m[0] in ("error", "pageerror", "dialog")] == []
    finally:
        page.close()
    # the same heads opened from their links: drawn from the server's own images
    for head, seen in shown.items():
        assert_a_link_draws_the_same(browser, f"{url}?head={head}", LAYERS_JS, seen, head)

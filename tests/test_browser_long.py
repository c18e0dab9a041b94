"""``attnpanel serve --demo long`` in headless Chromium: the explorer of a virtual trace.

The long demo is built once into a temporary cache (one day here, L = 1,440, so that the
test stays short; the page is the same at 45 days), then served. The page must read right
at 1280 and 1600 px, draw the stored overview, let a click pick a query (its row and top
keys follow) and a wheel zoom re-rasterize the window from q, k and lse: the pixels the
browser holds equal the window recomputed from the stored trace.
"""

from __future__ import annotations

import sys

import numerics
import numpy as np
import pytest
from served_app import PAGE_TEXT_JS, free_port, image_js, opened, page_widths, serving, shot

from attnpanel.nilm.demo import stored_long_demo
from attnpanel.traces import io, virtual

DAYS = 1
LENGTH = DAYS * 24 * 60

IMAGE_JS = image_js("sample 0, head")


@pytest.fixture(scope="module")
def served(browser, tmp_path_factory):
    cache = tmp_path_factory.mktemp("long-demo")
    port = free_port()
    cmd = [sys.executable, "-m", "attnpanel", "serve", "--demo", "long", "--days", str(DAYS)]
    cmd += ["--cache", str(cache), "--port", str(port)]
    with (
        serving(cmd, port, f"http://localhost:{port}/attnpanel", timeout=400) as (url, _),
        opened(browser, url) as page_console,
    ):
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

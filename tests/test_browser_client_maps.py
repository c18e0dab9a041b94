"""Head, stage and mask changes drawn by the browser from maps the server sent ahead.

Once the page is idle, the server streams the matrix's neighbouring maps (8-bit levels) to
the page. A change whose map is there repaints with no image from the server: counted on
the page's websocket. The canvas it paints is the one a page opened on that state paints
from the server's exact image, pixel for pixel (over the page's white); the URL and the
other views follow.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import numpy as np
from client_cache import (
    Frames,
    assert_a_link_draws_the_same,
    browser_drew,
    idle_cache,
    layers_js,
)
from served_app import HELD_JS, PAGE_TEXT_JS, open_app, opened, shot

MATRIX = "() => attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"
LAYERS_JS = layers_js(MATRIX)
ROWS_JS = f"() => ({HELD_JS})('__rows')"  # the heads' weights it holds
# (widget title, the value a user's choice gives its page model, URL argument and value)
CHANGES = [
    ("Head", "3", ("head", "3")),
    # the mask before the raw stage: raw scores are the mask's own, and their title names
    # no mask, so a mask change there would repaint nothing
    ("Mask", "causal", ("mask", "causal")),
    ("Stage", "raw", ("stage", "raw")),
    ("Head", "mean", ("head", "mean")),
]


def test_a_change_whose_map_is_there_sends_no_image_and_paints_the_servers_pixels(
    browser, artifacts, demo_url
):
    frames, console = Frames(), []
    page = open_app(browser, demo_url, console, before=frames.listen)
    try:
        assert idle_cache(page, 23) >= 23  # every head, and the head's stages and masks
        shown = {}
        for title, value, (argument, wanted) in CHANGES:
            after = browser_drew(page, frames, MATRIX, (title, value), (argument, wanted))
            # the other views follow on the server: the query's weights name the head
            bars = page.evaluate("attn.plot('weights of query').model.title.text")
            head = page.evaluate("new URLSearchParams(location.search).get('head')")
            bars = " ".join(bars.split())  # (broken into lines where the plot is narrow)
            assert bars.endswith("(mean of heads)" if head == "mean" else f"(head {head})")
            shown[page.url.split("?", 1)[1]] = after
            idle_cache(page, 1)  # the next change's neighbours arrive while idle
        # the hover of a map drawn from the browser's copy gives its colour's range
        point = page.evaluate(f"attn.frame_point(({MATRIX})(), 0.45, 0.6)")
        page.mouse.move(point["x"], point["y"])
        page.wait_for_timeout(300)
        assert "8-bit copy drawn in the browser" in page.evaluate(PAGE_TEXT_JS)
        page.mouse.move(0, 0)
        # the map's hover button (what it sets) switches the copy's hover too
        toggled = page.evaluate(
            f"""async () => {{
              const tools = ({MATRIX})().model.toolbar.tools.filter((t) => t.type === "HoverTool");
              const shown = tools.find((t) => t.visible);
              shown.active = false;
              for (let i = 0; i < 20; i++) await Promise.resolve();
              const off = tools.map((t) => t.active);
              shown.active = true;
              for (let i = 0; i < 20; i++) await Promise.resolve();
              return [off, tools.map((t) => t.active)];
            }}"""
        )
        assert toggled == [[False, False], [True, True]]
        shot(page, artifacts, "client_maps_mean")
        assert [m for m in console if m[0] in ("error", "pageerror")] == []
    finally:
        page.close()
    # the same states, opened from their links: drawn from the server's exact images
    for query, drawn in shown.items():
        state = parse_qs(urlparse("?" + query).query)
        assert_a_link_draws_the_same(browser, f"{demo_url}?{query}", LAYERS_JS, drawn, state)


# The weights bars and the matrix's row box as they stand (columns as lists).
BARS_JS = """
() => {
  const pv = attn.plot('weights of query');
  const quad = pv.model.renderers.find((r) => r.glyph && r.glyph.type === "Quad");
  const d = quad.data_source.data;
  const box = (MATRIX)().model.center.find((m) => m.type === "BoxAnnotation" && m.top > 0);
  return { title: pv.model.title.text, y: [pv.model.y_range.start, pv.model.y_range.end],
           bottom: Array.from(d.bottom), top: Array.from(d.top), value: Array.from(d.value),
           box: box ? [box.bottom, box.top] : null, hash: attn.hash(pv) };
}
""".replace("MATRIX", MATRIX)


def test_a_query_change_redraws_its_weights_in_the_browser_with_the_servers_numbers(
    browser, demo_url
):
    with opened(browser, demo_url + "?head=2&mask=causal") as (page, console):
        page.wait_for_function(f"() => ({ROWS_JS})() >= 1")
        for query in (57, 300, 0):
            # read in the same task as the change (its callback runs in a microtask): no
            # message of the server's can be handled in between
            drawn = page.evaluate(
                f"async () => {{ attn.widget('Query').value = {query};"
                " for (let i = 0; i < 20; i++) await Promise.resolve();"
                f" return ({BARS_JS})(); }}"
            )
            assert drawn["title"] == f"weights of query {query} (head 2)"
            assert drawn["box"] == [query - 0.5, query + 0.5]
            page.wait_for_function(
                f"() => new URLSearchParams(location.search).get('query') === '{query}'"
            )
            page.wait_for_timeout(600)  # the server's own bars land
            served = page.evaluate(BARS_JS)
            assert served == {**drawn, "hash": served["hash"]}
            assert served["hash"] == page.evaluate("attn.hash(attn.plot('weights of query'))")
        weights = np.asarray(served["value"])
        assert weights[0] == 1.0 and not weights[1:].any()  # causal: query 0 sees itself
        assert [m for m in console if m[0] in ("error", "pageerror")] == []


# Every root of the page counts its layouts: BokehJS lays the whole page out again (~50 ms
# on a 2-core machine) when a view's size may have changed: an axis whose labels widen, a
# ``Div``'s new text. None of a selection change's redraws should.
COUNT_LAYOUTS_JS = """() => {
  window.attn_layouts = 0;
  const roots = Object.values(Bokeh.index).filter((view) => view.compute_layout);
  for (const root of roots) {
    const layout = root.compute_layout.bind(root);
    root.compute_layout = () => { window.attn_layouts += 1; return layout(); };
  }
  // the counter sees a layout: one of a plot's, which BokehJS computes from its root
  attn.plot('weights of query').compute_layout();
  const seen = window.attn_layouts;
  window.attn_layouts = 0;
  return [roots.length, seen];
}"""


def test_no_change_of_head_mask_query_or_colours_lays_the_page_out_again(browser, demo_url):
    """The weights bars take a new scale in the frame that repaints the map: their labels
    keep one width (a mask change's frame took 55-70 ms more while they widened), and the
    head summary's new rows are written in place (a ``Div`` laid the page out again)."""
    changes = [("Mask", "causal"), ("Mask", "none"), ("Head", "5"), ("Query", 402)]
    changes += [("Query", 3), ("Mask", "diagonal"), ("Colormap", "viridis")]
    with opened(browser, demo_url) as (page, console):
        roots, seen = page.evaluate(COUNT_LAYOUTS_JS)
        assert roots >= 1 and seen == 1  # the counter counts
        bars, summaries = set(), set()
        for title, value in changes:
            page.evaluate(
                "([title, value]) => { attn.widget(title).value = value; }", [title, value]
            )
            if title != "Colormap":  # (not in the link)
                page.wait_for_function(
                    f"() => new URLSearchParams(location.search).get('{title.lower()}')"
                    f" === '{value}'"
                )
            page.wait_for_timeout(700)  # the server's deferred views land
            bars.add(page.evaluate("attn.hash(attn.plot('weights of query'))"))
            summaries.add(page.evaluate(f"({SUMMARY_TEXT_JS})()"))
        assert page.evaluate("window.attn_layouts") == 0
        assert len(bars) >= 5 and len(summaries) >= 3  # they were redrawn, in place
        palette = page.evaluate(
            f"({MATRIX})().model.renderers.find((r) => r.glyph"
            " && r.glyph.type === 'Image').glyph.color_mapper.palette[0]"
        )
        assert palette.lower() == "#440154"  # viridis's first colour: the last change landed
        # one width for each scale's labels (as the browser writes them)
        labels = page.evaluate(
            "[[0, 0.05, 0.1, 0.15], [0, 0.0005, 0.001, 0.0015], [0, 0.5, 1]].map((ticks) =>"
            " attn.plot('weights of query').model.left[0].formatter.doFormat(ticks, {}))"
        )
        assert labels == [
            ["     0", "  0.05", "   0.1", "  0.15"],
            ["     0", "0.0005", " 0.001", "0.0015"],
            ["     0", "   0.5", "     1"],
        ]
        assert [m for m in console if m[0] in ("error", "pageerror")] == []


SUMMARY_TEXT_JS = """() => attn.table("entropy").textContent"""

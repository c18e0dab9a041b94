"""The comparison page (``attnpanel serve a.nc --compare b.nc``) and the offline report
(``attnpanel compare a.nc b.nc -o report.html``) in headless Chromium, on two checkpoints of
the zoo's NILMFormer: the three maps painted, a click on the ranking opens its head, a zoom
on one map moves the other two, no horizontal scroll at 1280 and 1600 px; the report opens
with every request off the file blocked and draws its maps. Chromium missing makes the
``browser`` fixture fail, never skip.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import zoo
from served_app import HELPERS_JS, PAGE_TEXT_JS, free_port, page_widths, serving, shot
from test_compare import NUDGE, second_checkpoint

import attnpanel
from attnpanel.cli.main import main

NAME = "nilmformer_real"
MAPS = ("A · ", "B · ", "B − A · ")
# the page has rendered: the three maps are laid out and the document is idle
DRAWN_JS = (
    "() => { try { return ['A · ', 'B · ', 'B − A · '].every((t) => "
    "attn.plot(t).canvas_view.bbox.width > 0) && Bokeh.documents[0].is_idle; } "
    "catch (e) { return false; } }"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints of the zoo's NILMFormer captured on one batch, saved as .nc."""
    folder = tmp_path_factory.mktemp("compare")
    model, args, kwargs = zoo.case(NAME).build()
    other = second_checkpoint(model, NUDGE[NAME])
    paths = folder / "a.nc", folder / "b.nc"
    for checkpoint, path in zip((model, other), paths, strict=True):
        attnpanel.save(attnpanel.capture(checkpoint, *args, **kwargs), path)
    return paths


@pytest.fixture(scope="module")
def app(browser, saved):
    a, b = saved
    port = free_port()
    cmd = [sys.executable, "-m", "attnpanel", "serve", str(a), "--compare", str(b)]
    cmd += ["--port", str(port)]
    console: list = []
    with serving(cmd, port, f"http://localhost:{port}/attnpanel") as (url, _proc):
        page = browser.new_page(viewport={"width": 1600, "height": 1300})
        page.on("console", lambda msg: console.append((msg.type, msg.text)))
        page.on("pageerror", lambda err: console.append(("pageerror", str(err))))
        page.goto(url, timeout=180_000)
        page.wait_for_function(
            "() => window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length > 0",
            timeout=180_000,
        )
        page.evaluate(HELPERS_JS)
        page.wait_for_function(DRAWN_JS, timeout=180_000)
        page.wait_for_timeout(800)
        try:
            yield page, console
        finally:
            page.close()


def title(page, prefix: str) -> str:
    return page.evaluate("(p) => attn.plot(p).model.title.text", prefix)


def image_shape(page, prefix: str) -> list[int]:
    return page.evaluate(
        "(p) => { const rv = [...attn.plot(p).renderer_views.values()].find("
        "(r) => r.model.glyph && r.model.glyph.type === 'Image');"
        " return [...rv.model.data_source.data.image[0].shape]; }",
        prefix,
    )


def most_positive_colour(page, prefix: str, masked=None) -> list[int]:
    """The RGBA painted at the cell of a map's largest value (``masked``: a level to skip)."""
    return page.evaluate(
        "([p, masked]) => { const pv = attn.plot(p); const rv = [...pv.renderer_views.values()]"
        ".find((r) => r.model.glyph && r.model.glyph.type === 'Image');"
        " const image = rv.model.data_source.data.image[0]; const [rows, cols] = image.shape;"
        " let best = -Infinity, at = 0;"
        " for (let i = 0; i < image.length; i++) {"
        "  const v = image[i]; if (Number.isNaN(v) || v === masked) continue;"
        "  if (v > best) { best = v; at = i; } }"
        " return attn.rgba_at(pv, at % cols, Math.floor(at / cols)); }",
        [prefix, masked],
    )


def colours(page, prefix: str) -> set:
    """The distinct colours painted in a plot's frame."""
    return set(
        tuple(c)
        for c in page.evaluate(
            "(p) => { const pv = attn.plot(p); const { data, width, ratio } = attn.pixels(pv);"
            " const f = pv.frame.bbox; const out = [];"
            " for (let y = f.top + 2; y < f.bottom - 2; y += 7) {"
            "  for (let x = f.left + 2; x < f.right - 2; x += 7) {"
            "   const i = 4 * (Math.floor(y * ratio) * width + Math.floor(x * ratio));"
            "   out.push([data[i], data[i + 1], data[i + 2]]); } }"
            " return out; }",
            prefix,
        )
    )


def test_the_three_maps_paint_and_the_page_fits(app, artifacts):
    page, console = app
    shot(page, artifacts, "compare_1600")
    titles = [title(page, prefix) for prefix in MAPS]
    head = titles[0].removeprefix("A · ")
    assert titles == [f"{which}{head}" for which in MAPS]  # one head, the three maps
    for prefix in MAPS:
        assert image_shape(page, prefix) == [49, 49]  # every cell (49 positions, 270 px)
        painted = colours(page, prefix)
        assert len(painted) > 20, (prefix, len(painted))
        # the diagonal NILMFormer masks is black on all three (masked, outside the scale)
        assert page.evaluate("(p) => attn.rgba_at(attn.plot(p), 20, 20)", prefix)[:3] == [0, 0, 0]
    red, green, blue, _ = most_positive_colour(page, "B − A · ")
    assert red > blue + 50 and red > green + 50, "where B attends most over A: red"
    text = " ".join(page.evaluate(PAGE_TEXT_JS).split())
    assert (
        f"{' '.join(head.split()).removeprefix('sample 0,').strip()}: rank 1 of 16" in text
        and "Jensen-Shannon divergence" in text
    )
    widths = page_widths(page)
    page.set_viewport_size({"width": 1280, "height": 1300})
    page.wait_for_timeout(800)
    shot(page, artifacts, "compare_1280")
    tops = page.evaluate(
        "(maps) => maps.map((p) => attn.plot(p).el.getBoundingClientRect().top)", list(MAPS)
    )
    assert len(set(tops)) == 1, tops  # A, B and B − A side by side at 1280 px too
    page.set_viewport_size({"width": 1600, "height": 1300})
    assert widths == {1280: 1280, 1600: 1600}  # no horizontal scroll
    assert [m for m in console if m[0] in ("error", "pageerror")] == []


def test_a_click_on_the_ranking_opens_its_head(app, artifacts):
    page, _ = app
    ranked = page.evaluate(
        "() => { const pv = attn.plots().find((v) => v.model.title.text.startsWith('every head'));"
        " const rv = [...pv.renderer_views.values()].find((r) => r.model.glyph &&"
        " r.model.glyph.type === 'Quad' && r.model.data_source.data.name);"
        " return Array.from(rv.model.data_source.data.name); }"
    )
    assert len(ranked) == 16
    before = page.evaluate("attn.hash(attn.plot('B − A · '))")
    rank = 6
    point = page.evaluate(
        "(rank) => { const pv = attn.plots().find((v) =>"
        " v.model.title.text.startsWith('every head'));"
        " const r = pv.el.getBoundingClientRect();"
        " return { x: r.left + pv.frame.x_scale.compute(0.0) + 6,"
        "          y: r.top + pv.frame.y_scale.compute(rank) }; }",
        rank,
    )
    page.mouse.click(point["x"], point["y"])
    page.wait_for_function(
        "(name) => attn.plot('A · ').model.title.text.endsWith(name)", arg=ranked[rank]
    )
    page.evaluate("(b) => attn.until_changed(attn.plot('B − A · '), b)", before)
    page.wait_for_timeout(500)
    name, head = ranked[rank].removeprefix("layer ").split(", head ")
    layer = ("EncoderBlock.0.attention_layer", "EncoderBlock.1.attention_layer").index(name)
    assert page.evaluate("attn.widget('Head').value") == str(head)
    assert page.evaluate("attn.widget('Layer').value") == str(layer)
    for prefix in MAPS:
        assert title(page, prefix).endswith(ranked[rank])
    text = " ".join(page.evaluate(PAGE_TEXT_JS).split())
    assert f"{ranked[rank]}: rank {rank + 1} of 16" in text
    shot(page, artifacts, "compare_clicked")


def test_a_zoom_on_one_map_moves_and_re_rasterizes_the_others(app, artifacts):
    page, _ = app
    before = page.evaluate("attn.hash(attn.plot('B · '))")
    box = page.evaluate("attn.frame_point(attn.plot('A · '), 0.3, 0.3)")
    page.mouse.move(box["x"], box["y"])
    for _ in range(4):
        page.mouse.wheel(0, -240)
        page.wait_for_timeout(120)
    page.evaluate("(b) => attn.until_changed(attn.plot('B · '), b)", before)
    page.wait_for_function(
        "() => { const s = [...attn.plot('B − A · ').renderer_views.values()].find((r) =>"
        " r.model.glyph && r.model.glyph.type === 'Image').model.data_source.data.image[0].shape;"
        " return s[0] < 49 && s[1] < 49; }",
        timeout=30_000,
    )
    ranges = [
        page.evaluate(
            "(p) => { const m = attn.plot(p).model; return [m.x_range.start, m.x_range.end,"
            " m.y_range.start, m.y_range.end]; }",
            prefix,
        )
        for prefix in MAPS
    ]
    assert ranges[0] == ranges[1] == ranges[2]
    x0, x1 = ranges[0][:2]
    assert x1 - x0 < 40  # zoomed in
    for prefix in MAPS:
        rows, cols = image_shape(page, prefix)
        assert cols <= np.ceil(x1 - x0) + 1 and rows < 49  # the window's cells, re-rasterized
    shot(page, artifacts, "compare_zoomed")
    page.evaluate(
        "() => { const m = attn.plot('A · ').model; m.x_range.start = -0.5; m.x_range.end = 48.5;"
        " m.y_range.start = 48.5; m.y_range.end = -0.5; }"
    )


def test_the_report_opens_offline_and_draws_the_ranked_heads(browser, saved, tmp_path, artifacts):
    a, b = saved
    report = tmp_path / "report.html"
    assert main(["compare", str(a), str(b), "-o", str(report), "--heads", "4"]) == 0
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    attempted, errors = [], []

    def block(route):
        attempted.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith("file:"), block)
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.goto(report.as_uri())
        page.wait_for_function("document.body.dataset.attnpanelReport === 'drawn'", timeout=60_000)
        page.evaluate(HELPERS_JS)
        page.wait_for_timeout(500)
        assert attempted == [] and errors == []
        text = page.evaluate(PAGE_TEXT_JS)
        assert "JS divergence (nats)" in text and text.count("layer ") >= 16
        for prefix in ("A · ", "B · ", "B − A · "):
            assert len(colours(page, prefix)) > 20, prefix  # the map inflated and painted
        red, green, blue, _ = most_positive_colour(page, "B − A · ", masked=255)
        assert red > blue + 50 and red > green + 50, "where B attends most over A: red"
        assert page.evaluate("document.documentElement.scrollWidth") == 1280
        page.screenshot(path=str(artifacts / "compare_report_1280.png"), full_page=True)
    finally:
        context.close()

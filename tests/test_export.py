"""Standalone HTML export: self-contained, bounded in size, and working offline in Chromium."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import zlib

import numerics
import numpy as np
import pytest
import torch

import attnpanel
from attnpanel.render.export import export_html
from attnpanel.render.export_maps import DISPLAY, LEVELS, MASKED, display_resolution, export_maps
from attnpanel.traces.stages import attention_stage

MAX_BYTES = 5_000_000  # 5 MB, the limit


def _trace(length: int, batch: int = 1, noise: bool = False):
    """A random layer's trace; ``noise``: white-noise input, the worst case for compression."""
    layer = attnpanel.MultiHeadSelfAttention(d_model=96, n_heads=8, mask="diagonal")
    x = torch.randn(batch, length, 96)
    if not noise:
        steps = torch.arange(length, dtype=torch.float32)[:, None]
        x = x + 3 * torch.sin(steps / 20 * torch.arange(96) / 10)
    return attnpanel.trace(layer, x)


@pytest.fixture(scope="module")
def trace_480():
    torch.manual_seed(1)
    return _trace(480, batch=2)


def test_maps_cover_every_head_and_mask_and_mark_masked_cells(trace_480):
    payload = export_maps(trace_480, sample=1, size=480)
    assert payload["masks"] == ["none", "diagonal", "causal"]
    for mask in payload["masks"]:
        assert len(payload["maps"][mask]) == 8
    diagonal = np.frombuffer(
        zlib.decompress(base64.b64decode(payload["maps"]["diagonal"][3])), np.uint8
    )
    diagonal = diagonal.reshape(480, 480)
    assert (np.diag(diagonal) == MASKED).all()
    assert (diagonal[~np.eye(480, dtype=bool)] <= LEVELS).all()
    causal = np.frombuffer(
        zlib.decompress(base64.b64decode(payload["maps"]["causal"][0])), np.uint8
    )
    causal = causal.reshape(480, 480)
    assert (causal[np.triu_indices(480, 1)] == MASKED).all()
    assert (causal[np.tril_indices(480)] <= LEVELS).all()


def test_long_sequences_are_reduced_by_the_mean():
    weights = attnpanel.trace(
        attnpanel.MultiHeadSelfAttention(16, 2, mask="none"), torch.randn(1, 96, 16)
    )
    one = weights["weights"].isel(batch=0, head=0)
    reduced = display_resolution(one, 48)
    expected = one.values.reshape(48, 2, 48, 2).mean(axis=(1, 3))
    np.testing.assert_allclose(reduced, expected, rtol=1e-5)


def test_a_masked_diagonal_stays_visible_when_reduced():
    ds = attnpanel.trace(
        attnpanel.MultiHeadSelfAttention(16, 2, mask="diagonal"), torch.randn(1, 480, 16)
    )
    one = ds["weights"].isel(batch=0, head=1)
    one = one.where(one > 0)  # masked cells as NaN, as the export passes them
    reduced = display_resolution(one, 400)
    assert reduced.shape == (400, 400)
    assert np.isnan(np.diag(reduced)).all(), "the masked diagonal must stay black"
    far = np.abs(np.subtract.outer(np.arange(400), np.arange(400))) >= 2
    assert np.isfinite(reduced[far]).all(), "only the diagonal's pixels are masked"
    visible = ~np.isnan(reduced)
    assert 0 < reduced[visible].min() and reduced[visible].max() <= one.max()


def test_resolution_drops_only_when_the_file_would_exceed_its_limit(trace_480, tmp_path):
    structured = export_html(trace_480, tmp_path / "structured.html").read_text()
    assert f"stored at {DISPLAY} x {DISPLAY}" in structured
    full = export_html(trace_480, tmp_path / "full.html", max_bytes=None)
    limit = full.stat().st_size - 400_000
    smaller = export_html(trace_480, tmp_path / "smaller.html", max_bytes=limit)
    assert smaller.stat().st_size <= limit
    stored = int(re.search(r"stored at (\d+) x", smaller.read_text()).group(1))
    assert 200 < stored < DISPLAY
    with pytest.raises(ValueError, match="max_bytes=1000"):
        export_html(trace_480, tmp_path / "never.html", max_bytes=1000)


def test_sample_out_of_range_is_refused(trace_480, tmp_path):
    with pytest.raises(ValueError, match="sample 5 is out of range"):
        export_html(trace_480, tmp_path / "x.html", sample=5)


def external_references(html: str) -> list[str]:
    """Tags of the page (not strings inside its scripts) that would load another file."""
    from html.parser import HTMLParser

    found = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for name, value in attrs:
                if name in ("src", "href") and value and not value.startswith(("data:", "#")):
                    found.append(f"<{tag} {name}={value}>")

    Tags().feed(html)
    return found


def test_export_references_no_other_file_even_with_panel_models_registered(tmp_path):
    # Panel's models carry script URLs relative to a server ("static/extensions/...");
    # Bokeh adds those of every registered model class, used or not.
    import panel as pn
    from panel.models.esm import ReactiveESM

    assert ReactiveESM.__javascript__, "panel no longer declares the script this guards against"
    pn.panel("loaded")
    torch.manual_seed(3)
    path = export_html(_trace(64), tmp_path / "small.html")
    assert external_references(path.read_text()) == []


def _open_offline(browser, path, artifacts, name):
    """Open an exported file with every non-file request blocked; return page and requests."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    attempted, errors = [], []

    def block(route):
        attempted.append(route.request.url)
        route.abort()

    context.route(re.compile(r"^(?!file:).*"), block)
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("requestfailed", lambda r: errors.append(f"{r.url[:200]}: {r.failure}"))
    page.goto(path.as_uri())
    page.wait_for_function("document.body.dataset.attnpanelView === 'diagonal/0'", timeout=60_000)
    page.wait_for_timeout(300)
    return context, page, attempted, errors


def _frame_pixels(page, points) -> list[tuple[int, int, int]]:
    """RGB at points given as fractions (key, query) of the large map's frame."""
    from PIL import Image

    left, top, width, height = page.evaluate(
        """() => {
          const view = [...Bokeh.index.all_views()].find(v => v.model.name === 'attention map');
          const el = view.el.getBoundingClientRect();
          const f = view.frame.bbox;
          return [el.left + f.left, el.top + f.top, f.width, f.height];
        }"""
    )
    image = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
    return [image.getpixel((int(left + width * fx), int(top + height * fy))) for fx, fy in points]


def _main_box(page) -> dict:
    """The large map's box on the page."""
    return page.evaluate(
        """() => {
          const view = [...Bokeh.index.all_views()].find(v => v.model.name === 'attention map');
          const r = view.el.getBoundingClientRect();
          return {x: r.left, y: r.top, width: r.width, height: r.height};
        }"""
    )


def _canvas_hash(page) -> str:
    shot = page.screenshot(clip=_main_box(page))
    return hashlib.sha1(shot).hexdigest()


@pytest.mark.parametrize("length", [480, pytest.param(4096, marks=pytest.mark.slow)])
def test_export_is_small_self_contained_and_switchable_offline(
    length, browser, artifacts, tmp_path
):
    torch.manual_seed(2)
    ds = _trace(length, noise=True)  # white noise compresses worst: the size limit's hard case
    path = export_html(ds, tmp_path / f"report_{length}.html")
    html = path.read_text()
    assert path.stat().st_size <= MAX_BYTES, f"{path.stat().st_size / 1e6:.2f} MB at L={length}"
    stored = int(re.search(r"stored at (\d+) x", html).group(1))
    assert 200 <= stored <= DISPLAY, f"maps stored at {stored} x {stored}"
    assert external_references(html) == [], "a tag of the file loads another file"

    context, page, attempted, errors = _open_offline(browser, path, artifacts, length)
    try:
        assert attempted == [], f"requests left the file: {attempted[:5]}"
        assert errors == []
        before = _canvas_hash(page)
        page.screenshot(path=str(artifacts / f"export_{length}_head0.png"))
        page.locator("select").select_option("5")
        page.wait_for_function("document.body.dataset.attnpanelView === 'diagonal/5'")
        page.wait_for_timeout(300)
        after_head = _canvas_hash(page)
        assert after_head != before, "switching the head did not change the picture"
        page.get_by_role("button", name="causal").click()
        page.wait_for_function("document.body.dataset.attnpanelView === 'causal/5'")
        page.wait_for_timeout(300)
        assert _canvas_hash(page) != after_head, "switching the mask did not change the picture"
        page.screenshot(path=str(artifacts / f"export_{length}_causal5.png"))
        upper_right, lower_left = _frame_pixels(page, [(0.85, 0.15), (0.15, 0.85)])
        assert upper_right == (0, 0, 0), "keys after the query must be drawn black (query 0 on top)"
        assert lower_left != (0, 0, 0), "keys before the query must be visible"
        assert attempted == []
    finally:
        context.close()


def test_zoom_is_linked_across_heads(trace_480, browser, artifacts, tmp_path):
    path = export_html(trace_480, tmp_path / "linked.html")
    context, page, attempted, _ = _open_offline(browser, path, artifacts, "linked")
    try:
        ranges = page.evaluate(
            """() => {
              const doc = Bokeh.documents[0];
              const plots = [...doc.all_models].filter(
                m => m.type === 'Figure' && m.name !== 'sequence');
              return plots.map(p => [p.x_range.id, p.y_range.id]);
            }"""
        )
        assert len(ranges) == 9  # the large map and one per head
        assert len({tuple(r) for r in ranges}) == 1, "every map must share one x and one y range"
        box = _main_box(page)
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.wheel(0, -400)
        page.wait_for_timeout(500)
        start, end = page.evaluate(
            """() => { const p = [...Bokeh.documents[0].all_models].find(
                         m => m.name === 'attention map');
                       return [p.x_range.start, p.x_range.end]; }"""
        )
        assert end - start < 479, "the wheel zoom did not zoom"
        page.screenshot(path=str(artifacts / "export_linked_zoom.png"))
        assert attempted == []
    finally:
        context.close()


def test_the_export_needs_neither_holoviews_nor_panel():
    import subprocess
    import sys

    code = (
        "import sys, attnpanel.render.export; "
        "assert 'holoviews' not in sys.modules and 'panel' not in sys.modules, "
        "[m for m in ('holoviews', 'panel') if m in sys.modules]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_export_keeps_the_power_curve_and_a_query_selection(browser, artifacts, tmp_path):
    """A NILM trace's export shows the sample's power (aggregate, each appliance's truth and
    prediction) with the selected query's stored weights behind it; the query slider (the
    explorer's query when saved) moves the row marked on every map and the weights."""
    ds = attnpanel.demo().isel(batch=slice(0, 2), query=slice(0, 200), key=slice(0, 200))
    ds = ds.isel(position=slice(0, 200)) if "position" in ds.dims else ds
    path = export_html(ds, tmp_path / "power.html", sample=1, query=37, size=200)
    context, page, attempted, errors = _open_offline(browser, path, artifacts, "power")
    try:
        curve = page.evaluate(
            """() => {
              const fig = [...Bokeh.documents[0].all_models].find(m => m.name === 'sequence');
              const lines = fig.renderers.filter(r => r.glyph.type === 'Line');
              return {n: lines.length, first: Array.from(lines[0].data_source.data.y),
                      legend: fig.center.concat(fig.right).filter(a => a.type === 'Legend')
                        .flatMap(l => l.items.map(i => i.label.value))};
            }"""
        )
        numerics.assert_same_numbers(curve["first"], ds["signal"].values[1])
        swatch = page.evaluate(  # the weights' legend item draws a fixed colour, at any query
            """() => {
              const fig = [...Bokeh.documents[0].all_models].find(m => m.name === 'sequence');
              const legend = fig.center.concat(fig.right).find(a => a.type === 'Legend');
              const item = legend.items.find(i => i.label.value.includes('weight'));
              const glyph = item.renderers[0].glyph;
              return {alpha: glyph.fill_alpha, hides: item.renderers.length};
            }"""
        )
        assert swatch["alpha"]["value"] == 0.6 and swatch["hides"] == 2, swatch
        channels = list(ds["series"].values)
        assert curve["n"] == 1 + 2 * len(channels)  # signal, truth, prediction
        assert "fridge (predicted)" in curve["legend"]

        def band_and_rows():
            return page.evaluate(
                """() => {
                  const all = [...Bokeh.documents[0].all_models];
                  const band = all.find(m => m.type === 'ColumnDataSource' && 'alpha' in m.data);
                  const rows = all.filter(m => m.name === 'query row');
                  const shown = all.find(m => m.type === 'ColumnDataSource' && 'flat' in m.data);
                  return {weight: Array.from(band.data.weight), top: shown.data.top[0],
                          rows: rows.map(b => [b.bottom, b.top])};
                }"""
            )

        def expected(query, top):  # head 0, diagonal mask: the trace's own softmax row,
            # as stored: 8 bits up to the colour scale's top (p99.5), heavier cells at the top
            row = attention_stage(ds, "softmax", mask="diagonal", batch=1, head=0).values[query]
            return np.minimum(np.where(np.eye(200, dtype=bool)[query], 0.0, row), top)

        found = band_and_rows()
        assert {tuple(r) for r in found["rows"]} == {(36.5, 37.5)}
        assert len(found["rows"]) == 1 + ds.sizes["head"]  # the large map and every head
        step = found["top"] / LEVELS  # 8-bit storage
        np.testing.assert_allclose(found["weight"], expected(37, found["top"]), atol=step)
        page.evaluate(
            """() => { [...Bokeh.documents[0].all_models]
                         .find(m => m.type === 'Slider').value = 150; }"""
        )
        page.wait_for_timeout(300)
        found = band_and_rows()
        assert {tuple(r) for r in found["rows"]} == {(149.5, 150.5)}
        np.testing.assert_allclose(found["weight"], expected(150, found["top"]), atol=step)
        page.screenshot(path=str(artifacts / "export_power_query.png"), full_page=True)
        assert errors == [] and attempted == []
    finally:
        context.close()

"""Linked zoom and box selection of the attention maps, in the served explorer (Chromium).

A wheel zoom over the matrix must move every map (the matrix and the eight head tiles) and
re-rasterize each one's visible window from the full array at its pixel size; a box drawn
on one head's tile must be marked on every map and tile and give per-head mass bars equal
to a numpy computation on the trace.
"""

from __future__ import annotations

import numerics
import numpy as np
import pytest
from served_app import opened

import attnpanel
from attnpanel.app import linked
from attnpanel.app.sections.heads import HEAD_MAP_SIZE as SIZE

# Every linked map with its image: title, x/y range, image extent and shape, box
# annotation. The large matrices are figures of their own; the head maps are tiles of one
# figure ("head maps"), which shows the window named by its "head maps window" source.
MAPS_JS = r"""
(valuesOf = null) => {
  const round = (v) => (typeof v === "number" ? Math.round(v * 1000) / 1000 : null);
  const read = (title, img, extent, box, x = null, y = null) => ({
    title, x, y, extent,
    shape: img.shape ? [...img.shape] : [img.length],
    values: title === valuesOf ? Array.from(img, (v) => (Number.isNaN(v) ? null : v)) : null,
    box,
  });
  const out = [];
  for (const pv of attn.plots()) {
    if (pv.model.name === "head maps") {
      const doc = pv.model.document;
      const w = doc.get_model_by_name("head maps window").data;
      const [l, b, r, t] = [w.left[0], w.bottom[0], w.right[0], w.top[0]];
      const outline = doc.get_model_by_name("head maps box").data;
      for (const renderer of pv.model.renderers.filter((r) => /^head \d+$/.test(r.name))) {
        const head = Number(renderer.name.slice(5));
        const g = renderer.glyph;
        const at = (spec) => (typeof spec === "number" ? spec : spec.value);
        const [ox, oy] = [at(g.x), at(g.y)];
        const box = outline.left.length === 0 ? [false, null, null, null, null] : [
          true,
          round(l + (outline.left[head] - ox) * (r - l)),
          round(l + (outline.right[head] - ox) * (r - l)),
          round(b + (outline.bottom[head] - oy) * (t - b)),
          round(b + (outline.top[head] - oy) * (t - b)),
        ];
        out.push(read(renderer.name, renderer.data_source.data.image[0],
                      [l, b, r - l, t - b], box));
      }
      continue;
    }
    const rv = [...pv.renderer_views.values()].find(
      (r) => r.model.glyph && r.model.glyph.type === "Image");
    if (!rv || !/^sample \d+, /.test(pv.model.title.text)) continue;
    const d = rv.model.data_source.data;
    const a = pv.model.center.find((a) => a.name === "box selection");
    // Numbers only: an unset side is a Bokeh model (the frame's edge), not a coordinate.
    const box = a ? [a.visible, ...[a.left, a.right, a.bottom, a.top].map(round)] : null;
    out.push(read(pv.model.title.text, d.image[0], [d.x[0], d.y[0], d.dw[0], d.dh[0]], box,
                  [pv.model.x_range.start, pv.model.x_range.end],
                  [pv.model.y_range.start, pv.model.y_range.end]));
  }
  return out;
}
"""


@pytest.fixture(scope="module")
def trace():
    return attnpanel.demo()


@pytest.fixture(scope="module")
def app(browser, demo_url):
    with opened(browser, demo_url) as served:
        yield served


def maps(page, values_of: str | None = None) -> dict:
    """The linked maps by title; ``values_of``: the title of a map whose pixels to read."""
    return {m["title"].split(" (")[0]: m for m in page.evaluate(MAPS_JS, values_of)}


def zoom_out(page) -> None:
    """Show the whole map again (as the matrix's reset does) and wait for every map."""
    page.evaluate(
        "(() => { const p = attn.plot('sample 0, '); "
        "p.model.x_range.setv({start: -0.5, end: 479.5}); "
        "p.model.y_range.setv({start: 479.5, end: -0.5}); })()"
    )
    # both axes: the two ranges reach the server one message each, and it may draw the
    # window between them (every column, the zoomed rows)
    page.wait_for_function(
        f"() => ({MAPS_JS})().every((m) => Math.min(Math.abs(m['extent'][2]),"
        " Math.abs(m['extent'][3])) >= 479)",
        timeout=20_000,
        polling=100,
    )


def head_weights(trace, head: int, sample: int = 0) -> np.ndarray:
    """What a head map shows: the trace's softmax weights, blocked cells NaN."""
    weights = trace["weights"].values[sample, head].astype(np.float32).copy()
    mask = trace.attrs.get("mask", "none")
    if mask != "none":
        from attnpanel.readouts.core import drawn_masked

        blocked = drawn_masked(trace, mask)
        if blocked is not None:
            weights[blocked] = np.nan
    return weights


def test_wheel_zoom_on_the_matrix_rerasterizes_every_map(app, trace, artifacts):
    page, console = app
    before = maps(page)
    heads = [t for t in before if t.startswith("head ") and t[5:].isdigit()]
    assert len(heads) == trace.sizes["head"]
    assert before["head 3"]["shape"] == [SIZE, SIZE]  # 480 cells in 140 px: downsampled
    target = page.evaluate(
        "(() => { const p = attn.plot('sample 0, '); return attn.frame_point(p, 0.3, 0.6); })()"
    )
    page.mouse.move(target["x"], target["y"])
    for _ in range(12):  # wheel steps until the window holds fewer cells than SIZE pixels
        page.mouse.wheel(0, -240)
        page.wait_for_timeout(60)
        span = page.evaluate(
            "(() => { const r = attn.plot('sample 0, ').model.x_range; "
            "return Math.abs(r.end - r.start); })()"
        )
        if span < 120:
            break
    assert span < 120
    # Wait until the server's re-rasterized windows arrived in every map.
    page.wait_for_function(
        f"() => ({MAPS_JS})().every((m) => Math.abs(m['extent'][2]) < {SIZE})",
        timeout=20_000,
        polling=100,
    )
    page.wait_for_timeout(300)
    after = maps(page, "head 3")
    page.screenshot(path=str(artifacts / "browser_linked_zoom.png"), full_page=True)
    ranges = {(tuple(m["x"]), tuple(m["y"])) for m in after.values() if m["x"] is not None}
    assert len(ranges) == 1, ranges  # one shared window
    ((x_range, y_range),) = ranges
    assert x_range != (-0.5, 479.5)
    for title, m in after.items():
        left, bottom, width, height = m["extent"]
        # The image covers the window snapped to whole cells, cell for cell.
        assert left <= min(x_range) + 1e-9 and left + width >= max(x_range) - 1e-9, title
        assert bottom <= min(y_range) + 1e-9 and bottom + height >= max(y_range) - 1e-9, title
        assert m["shape"] == [round(height), round(width)], (title, m["shape"], m["extent"])
    m = after["head 3"]
    left, bottom, width, height = m["extent"]
    c0, r0 = round(left + 0.5), round(bottom + 0.5)
    expected = head_weights(trace, 3)[r0 : r0 + round(height), c0 : c0 + round(width)]
    shown = np.array([np.nan if v is None else v for v in m["values"]], dtype=np.float32)
    numerics.assert_same_numbers(shown.reshape(expected.shape), expected)  # the trace's cells
    # More detail than the magnified image: the map's full width went to the window alone.
    assert m["shape"][1] > SIZE * width / 480
    assert [e for e in console if e[0] in ("error", "pageerror")] == []
    zoom_out(page)
    assert maps(page)["head 3"]["shape"] == [SIZE, SIZE]


def test_box_select_marks_every_map_and_shows_mass_per_head(app, trace, artifacts):
    page, console = app
    start = page.evaluate("attn.tile_point(5, 0.25, 0.3)")
    end = page.evaluate("attn.tile_point(5, 0.6, 0.7)")
    page.mouse.move(start["x"], start["y"])
    page.mouse.down()
    page.mouse.move((start["x"] + end["x"]) / 2, (start["y"] + end["y"]) / 2, steps=4)
    page.mouse.move(end["x"], end["y"], steps=4)
    page.mouse.up()
    page.wait_for_function(
        "() => Bokeh.documents[0].get_model_by_name('head maps shares').data.text.length > 0",
        timeout=20_000,
        polling=100,
    )
    page.wait_for_timeout(300)
    page.screenshot(path=str(artifacts / "browser_linked_box.png"), full_page=True)
    boxes = {tuple(m["box"]) for m in maps(page).values()}
    assert len(boxes) == 1, boxes  # the same box on every map, the matrix and every tile
    ((visible, left, right, bottom, top),) = boxes
    assert visible and left < right and bottom < top
    # under each head's tile: a bar of its share and the share's value
    bars = page.evaluate(
        "(() => { const d = Bokeh.documents[0].get_model_by_name('head maps shares').data; "
        "return {height: Array.from(d.bottom, (b, i) => b - d.top[i]), "
        "left: Array.from(d.left), text: Array.from(d.text), color: Array.from(d.color), "
        "title: attn.plot('head maps').model.title.text}; })()"
    )
    weights = trace["weights"].values[0].astype(np.float64)  # (head, query, key)
    rows, cols = linked.box_cells((left, right), (bottom, top), *weights.shape[1:])
    inside = weights[:, rows, cols].sum(axis=(1, 2))
    expected = inside / weights[:, rows, :].sum(axis=(1, 2))
    np.testing.assert_allclose([float(t) for t in bars["text"]], expected, atol=0.0051)
    np.testing.assert_allclose(
        np.array(bars["height"]) / max(bars["height"]), expected / expected.max(), rtol=1e-4
    )
    assert bars["left"] == sorted(bars["left"])  # head 0 first, left to right
    assert bars["title"].startswith(f"{linked.SHARE_LABEL}: queries {rows.start}-")
    assert 0 < min(expected) and max(expected) <= 1
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_hover_on_a_head_tile_names_the_head_and_whole_positions(app, trace):
    page, console = app
    zoom_out(page)
    fx, fy = 0.3, 0.6
    point = page.evaluate("([x, y]) => attn.tile_point(3, x, y)", [fx, fy])
    page.mouse.move(point["x"] - 3, point["y"] - 3)
    page.mouse.move(point["x"], point["y"], steps=2)
    tooltip = page.locator(".bk-tooltip-content").filter(has_text="key")
    tooltip.first.wait_for(timeout=10_000)
    text = tooltip.first.inner_text()
    assert "head 3" in text, text
    fields = dict(
        line.split(":", 1) for line in text.replace(":\n", ":").splitlines() if ":" in line
    )
    key, query = int(fields["key"].strip()), int(fields["query"].strip())
    # whole positions, where the pointer is (to the pixel: 480 positions on 140 pixels)
    assert abs(key - fx * 480) <= 4 and abs(query - fy * 480) <= 4, text
    # the weight shown is the tile's own pixel under the pointer (a mean of ~3 x 3 cells)
    shown = float(fields["weight"])
    weights = head_weights(trace, 3)
    near = weights[max(0, query - 4) : query + 5, max(0, key - 4) : key + 5]
    assert np.nanmin(near) - 1e-4 <= shown <= np.nanmax(near) + 1e-4, (text, near)
    assert [e for e in console if e[0] in ("error", "pageerror")] == []

"""A capture with several kinds of attention, served, in headless Chromium.

``nn.Transformer`` comes back as a DataTree (encoder self-attention, causal decoder
self-attention, cross-attention of 7 queries over 10 keys). A person sees one layer picker
over every group, picks a cross-attention layer and sees a 7 x 10 matrix of that layer,
(``tests/test_zoo.py`` checks that what the explorer draws for this model is the model's
own attention, layer by layer). Chromium missing makes the ``browser`` fixture fail,
never skip.
"""

from __future__ import annotations

import pytest
from served_app import ROOT, opened, serve, shot

APP = ROOT / "tests" / "tree_app.py"


@pytest.fixture(scope="module")
def app(browser):
    with serve(APP) as (url, _proc), opened(browser, url) as served:
        yield served


def options(page) -> list[str]:
    return page.evaluate(
        "attn.widget('Layer (every group)').options.map((o) => Array.isArray(o) ? o[1] : o)"
    )


def matrix_title(page) -> str:
    return page.evaluate(
        "attn.plots().map((v) => v.model.title.text).find((t) => /^sample \\d+, /.test(t))"
    )


def matrix_extent(page) -> dict:
    """The data extent of the matrix plot's ranges (keys on x, queries on y)."""
    return page.evaluate(
        "(() => { const p = attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text));"
        " const x = p.model.x_range, y = p.model.y_range;"
        " return {x: [x.start, x.end],"
        " y: [Math.min(y.start, y.end), Math.max(y.start, y.end)]}; })()"
    )


def test_one_picker_over_every_group_and_cross_attention_drawn(app, artifacts):
    page, console = app
    shot(page, artifacts, "tree_encoder_1600")
    names = options(page)
    groups = {name.rsplit(".", 2)[0] for name in names}
    assert len(names) == 6, names  # 2 encoder self, 2 decoder self, 2 cross
    assert any("encoder" in n for n in names) and any("multihead_attn" in n for n in names)
    assert len(groups) >= 2
    first = matrix_extent(page)
    assert first["x"][1] - first["x"][0] == pytest.approx(10, abs=0.01)  # encoder: 10 x 10
    assert first["y"][1] - first["y"][0] == pytest.approx(10, abs=0.01)
    encoder_title = matrix_title(page)
    cross = next(n for n in names if "multihead_attn" in n)
    page.evaluate(
        "(name) => { const w = attn.widget('Layer (every group)'); const o = w.options.find("
        "(o) => (Array.isArray(o) ? o[1] : o) === name); w.value = Array.isArray(o) ? o[0] : o; }",
        cross,
    )
    page.wait_for_function(
        "() => { try { const p = attn.plots().find((v) => /^sample \\d+, /.test("
        "v.model.title.text)); const y = p.model.y_range;"
        " return Math.abs(y.end - y.start) < 8 && p.canvas_view.bbox.width > 0; }"
        " catch (e) { return false; } }",
        timeout=60_000,
    )
    page.wait_for_timeout(1000)
    extent = matrix_extent(page)
    assert extent["x"][1] - extent["x"][0] == pytest.approx(10, abs=0.01)  # 10 keys
    assert extent["y"][1] - extent["y"][0] == pytest.approx(7, abs=0.01)  # 7 queries
    assert matrix_title(page) != encoder_title
    shot(page, artifacts, "tree_cross_1600")
    page.set_viewport_size({"width": 1280, "height": 1300})
    page.wait_for_timeout(1000)
    shot(page, artifacts, "tree_cross_1280")
    assert [m for m in console if m[0] in ("error", "pageerror")] == []

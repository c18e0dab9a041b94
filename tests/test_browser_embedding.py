"""The query-key embedding in the served demo (Chromium): its checkbox draws it, its points
paint in their two hues, and a box dragged over them marks exactly their queries and keys
on the matrix (rows and columns), which the matrix then paints."""

from __future__ import annotations

import numpy as np
import pytest
from served_app import PAGE_TEXT_JS, click_checkbox, opened, page_widths, shot

import attnpanel
from attnpanel.render.embedding_view import EMBEDDING_NAME, MARKS_NAMES, WASH_ALPHA

# Frame pixels of the embedding by colour: violet (a query), orange (a key), grey (another
# sample's point), as the canvas shows them.
PAINTED_JS = r"""
() => {
  const pv = attn.plot(NAME);
  const { data, width, ratio } = attn.pixels(pv);
  const f = pv.frame.bbox;
  const found = { violet: 0, orange: 0, grey: 0 };
  for (let y = Math.ceil(f.y * ratio); y < Math.floor((f.y + f.height) * ratio); y++) {
    for (let x = Math.ceil(f.x * ratio); x < Math.floor((f.x + f.width) * ratio); x++) {
      const i = 4 * (y * width + x);
      const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
      if (r === 255 && g === 255 && b === 255) continue;
      if (Math.abs(r - g) < 4 && Math.abs(g - b) < 4) found.grey++;
      else if (b > g + 20) found.violet++;
      else if (g > b + 20) found.orange++;
    }
  }
  return found;
}
""".replace("NAME", repr(EMBEDDING_NAME))

# The box the server drew on the embedding, and the matrix rows and columns it marked.
MARKS_JS = f"""
() => {{
  const doc = Bokeh.documents[0];
  const pv = attn.plot({EMBEDDING_NAME!r});
  const box = pv.model.center.find((a) => a.type === "BoxAnnotation" && a.visible);
  const rows = doc.get_model_by_name({MARKS_NAMES[0]!r}).data;
  const cols = doc.get_model_by_name({MARKS_NAMES[1]!r}).data;
  const edges = (mid, size) => [Array.from(mid, (m, i) => m - size[i] / 2),
                                Array.from(mid, (m, i) => m + size[i] / 2)];
  return {{
    box: box ? [box.left, box.right, box.bottom, box.top] : null,
    rows: edges(rows.y, rows.height),
    cols: edges(cols.x, cols.width),
    title: pv.model.title.text,
  }};
}}
"""
MATRIX = "attn.plot('sample 0, ')"


@pytest.fixture(scope="module")
def trace():
    return attnpanel.demo()


@pytest.fixture(scope="module")
def app(browser, demo_url):
    with opened(browser, demo_url) as served:
        yield served


def positions(runs) -> list[int]:
    """The whole positions inside bands given as ``[starts, ends]`` edges."""
    return [p for a, b in zip(*runs, strict=True) for p in range(int(np.ceil(a)), int(b) + 1)]


def interior(chosen: list[int], inside: bool) -> int:
    """A position (past the edge ticks) that is, with both neighbours, in ``chosen`` or not."""
    chosen = set(chosen)
    return next(
        p for p in range(12, 478) if all((q in chosen) == inside for q in (p - 1, p, p + 1))
    )


def pixel(page, key: int, query: int) -> np.ndarray:
    """The matrix's painted RGB at a cell."""
    return np.array(page.evaluate(f"attn.rgba_at({MATRIX}, {key}, {query})")[:3], dtype=float)


def test_a_box_of_points_marks_their_queries_and_keys_on_the_matrix(app, trace, artifacts):
    page, console = app
    click_checkbox(page, "Q/K embedding")
    page.wait_for_function(
        f"() => {{ try {{ return attn.plot({EMBEDDING_NAME!r}).canvas_view.bbox.width > 0 "
        "&& Bokeh.documents[0].is_idle; } catch (e) { return false; } }",
        timeout=60_000,
    )
    page.wait_for_timeout(500)
    painted = page.evaluate(PAINTED_JS)
    # the shown sample's 480 queries and 480 keys, 3 x 3 pixels each where not overlapping,
    # over the other 31 samples' points in grey
    assert painted["violet"] > 480 and painted["orange"] > 480, painted
    assert painted["grey"] > 2000, painted
    title = page.evaluate(MARKS_JS)["title"]
    assert title == "head 0, sample 0 · grey: the other samples", title

    matrix_before = page.evaluate(f"attn.hash({MATRIX})")
    page.evaluate(f"attn.plot({EMBEDDING_NAME!r}).el.scrollIntoView({{block: 'center'}})")
    start = page.evaluate(f"attn.frame_point(attn.plot({EMBEDDING_NAME!r}), 0.35, 0.3)")
    end = page.evaluate(f"attn.frame_point(attn.plot({EMBEDDING_NAME!r}), 0.6, 0.65)")
    page.mouse.move(start["x"], start["y"])
    page.mouse.down()
    page.mouse.move((start["x"] + end["x"]) / 2, (start["y"] + end["y"]) / 2, steps=4)
    page.mouse.move(end["x"], end["y"], steps=4)
    page.mouse.up()
    page.wait_for_function(f"() => ({MARKS_JS})().box !== null", timeout=20_000, polling=100)
    page.wait_for_function(
        f"(h) => attn.hash({MATRIX}) !== h", arg=matrix_before, timeout=20_000, polling=100
    )
    page.wait_for_timeout(300)
    found = page.evaluate(MARKS_JS)
    left, right, bottom, top = found["box"]
    assert left < right and bottom < top
    embedding = attnpanel.qk_embedding(trace, head=0)
    x, y = embedding["x"].values, embedding["y"].values
    inside = (x >= left) & (x <= right) & (y >= bottom) & (y <= top)
    inside &= embedding["sample"].values == 0
    kinds, where = embedding["kind"].values, embedding["position"].values
    queries = sorted(set(where[inside & (kinds == "query")].tolist()))
    keys = sorted(set(where[inside & (kinds == "key")].tolist()))
    assert 0 < len(queries) < 480 and 0 < len(keys) < 480
    assert positions(found["rows"]) == queries
    assert positions(found["cols"]) == keys
    text = page.evaluate(PAGE_TEXT_JS)
    assert f"{len(queries)} queries and {len(keys)} keys of sample 0" in text
    # cells inside and outside the box's rows and columns (each inside a run of its kind,
    # clear of the edge ticks and of the query marker on row 0), read before the box is
    # cleared: a cell of neither is washed twice, of one once, of both not at all
    cells = {
        (in_row, in_col): (key, query)
        for in_row, query in ((True, interior(queries, True)), (False, interior(queries, False)))
        for in_col, key in ((True, interior(keys, True)), (False, interior(keys, False)))
    }
    washed = {kind: pixel(page, *cell) for kind, cell in cells.items()}

    for width in (1600, 1280):
        page.set_viewport_size({"width": width, "height": 1300})
        page.wait_for_timeout(600)
        page.evaluate(f"attn.plot({EMBEDDING_NAME!r}).el.scrollIntoView({{block: 'center'}})")
        page.wait_for_timeout(300)
        path = artifacts / f"browser_embedding_{width}.png"
        page.screenshot(path=str(path))
        assert path.stat().st_size > 10_000
    assert page_widths(page) == {1280: 1280, 1600: 1600}  # no horizontal scroll
    shot(page, artifacts, "embedding_page")
    page.get_by_role("button", name="Clear box of points").click()
    page.wait_for_function(f"() => ({MARKS_JS})().box === null", timeout=20_000, polling=100)
    page.wait_for_timeout(300)
    assert page.evaluate(MARKS_JS)["rows"] == [[], []]
    for (in_row, in_col), cell in cells.items():
        times = 2 - in_row - in_col  # washes over this cell
        kept = (1 - WASH_ALPHA) ** times
        expected = kept * pixel(page, *cell) + (1 - kept) * 255.0
        np.testing.assert_allclose(washed[in_row, in_col], expected, atol=3, err_msg=str(cell))
    assert [e for e in console if e[0] in ("error", "pageerror")] == []

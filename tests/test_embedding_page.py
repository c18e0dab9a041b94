"""The page's query-key embedding (``attnpanel.app.sections.embedding``), read from the Bokeh
models the page draws: its pixels are the points of ``qk_embedding`` of the shown layer and
head (placed the long way, pixel by pixel), a box of them marks exactly its queries and keys
on the matrix, and every change of head, layer, sample or zoom redraws it."""

from __future__ import annotations

import holoviews as hv
import numpy as np
import pytest
from bokeh.document import Document

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.sections.embedding import MEAN_HEAD, NO_BOX, VIEW
from attnpanel.readouts.embedding import qk_embedding
from attnpanel.render.elements import PlotKey
from attnpanel.render.embedding_view import KEY_COLORS, QUERY_COLORS, ramp

IMAGE_KEY = PlotKey("EmbeddingImage", "Embedding")
MARKS_KEY = PlotKey("BoxedPositions", "EmbeddingBox")


@pytest.fixture(scope="module")
def trace():
    return attnpanel.demo(n_windows=4)


@pytest.fixture(scope="module")
def page(trace):
    explorer = AttentionExplorer(trace)
    explorer.__panel__().get_root(Document())
    return explorer


@pytest.fixture
def explorer(page):
    """The module's page with the section shown, at its start, without a box."""
    page.reset()
    page.show_embedding = True
    page.sections["embedding"].clear()
    return page


def drawn_image(explorer) -> tuple[np.ndarray, tuple]:
    """The embedding's RGBA pixels ``(height, width, 4)`` as the page holds them (rows by
    ascending y) and the window they cover, ``((x0, x1), (y0, y1))``."""
    data = explorer.engine.plots("embedding")[IMAGE_KEY][0]["source"].data
    image = np.asarray(data["image"][0], dtype=np.uint32)
    x0, y0, dw, dh = (float(data[k][0]) for k in ("x", "y", "dw", "dh"))
    pixels = image.view(np.uint8).reshape(*image.shape, 4)
    return pixels, ((x0, x0 + dw), (y0, y0 + dh))


def in_bands(starts, ends) -> list[int]:
    """The whole positions inside bands given by their edges."""
    edges = zip(starts, ends, strict=True)
    return [p for a, b in edges for p in range(int(np.ceil(a)), int(np.floor(b)) + 1)]


def marked(explorer) -> tuple[list[int], list[int]]:
    """The matrix rows and columns the page marks as the box's (its ticks), after checking
    that every other row and column, and only those, is washed out."""
    handles = explorer.engine.plots("matrix")[MARKS_KEY][0]
    found = []
    for name, centre, size, low, high, count in (
        ("rows", "y", "height", "y0", "y1", explorer.trace.sizes["query"]),
        ("cols", "x", "width", "x0", "x1", explorer.trace.sizes["key"]),
    ):
        ticks = handles[name].data
        mid, span = np.asarray(ticks[centre]), np.asarray(ticks[size])
        np.testing.assert_array_equal(ticks["edge"], -0.5)  # at the map's left or top
        inside = in_bands(mid - span / 2, mid + span / 2)
        washed = handles[f"{name}_out"].data
        outside = in_bands(washed[low], washed[high])
        if inside or outside:  # a box: what is not in it is washed out
            assert sorted(inside + outside) == list(range(count))
        found.append(inside)
    return found[0], found[1]


def occupied(embedding, chosen: np.ndarray, window, shape) -> np.ndarray:
    """The pixels holding at least one of the chosen points, the long way."""
    (x0, x1), (y0, y1) = window
    height, width = shape
    x, y = embedding["x"].values[chosen], embedding["y"].values[chosen]
    cols = np.floor((x - x0) / (x1 - x0) * width).astype(int)
    rows = np.floor((y - y0) / (y1 - y0) * height).astype(int)
    inside = (cols >= 0) & (cols < width) & (rows >= 0) & (rows < height)
    grid = np.zeros(shape, dtype=bool)
    grid[rows[inside], cols[inside]] = True
    return grid


def grown(grid: np.ndarray) -> np.ndarray:
    """Each pixel and its eight neighbours."""
    padded = np.pad(grid, 1)
    rows, cols = grid.shape
    return np.any(
        [
            padded[1 + dy : 1 + dy + rows, 1 + dx : 1 + dx + cols]
            for dy in (-1, 0, 1)
            for dx in (-1, 0, 1)
        ],
        axis=0,
    )


def assert_the_points_of(explorer, embedding, sample: int) -> None:
    """Every pixel of the drawn image is what the embedding's points put there: the shown
    sample's queries violet (over its keys, orange), each spread to 3 x 3 pixels; every other
    sample's points grey; nothing else."""
    pixels, window = drawn_image(explorer)
    shape = pixels.shape[:2]
    red, green, blue, alpha = (pixels[..., i].astype(int) for i in range(4))
    shown = embedding["sample"].values == explorer.trace["batch"].values[sample]
    kinds = embedding["kind"].values
    queries = grown(occupied(embedding, shown & (kinds == "query"), window, shape))
    keys = grown(occupied(embedding, shown & (kinds == "key"), window, shape)) & ~queries
    others = occupied(embedding, ~shown, window, shape) & ~queries & ~keys
    grey = (alpha > 0) & (red == green) & (green == blue)
    np.testing.assert_array_equal(alpha > 0, queries | keys | others)
    np.testing.assert_array_equal(grey, others)
    np.testing.assert_array_equal(~grey & (alpha > 0) & (blue > green), queries)
    np.testing.assert_array_equal(~grey & (alpha > 0) & (blue < green), keys)
    assert queries.any() and keys.any()


def test_the_section_costs_nothing_until_it_is_shown(trace):
    explorer = AttentionExplorer(trace)
    explorer.__panel__().get_root(Document())
    assert "embedding" not in explorer.engine.panes()
    assert VIEW not in [view.name for view in explorer.engine.views]
    assert MARKS_KEY not in explorer.engine.plots("matrix")
    explorer.show_embedding = True
    assert "embedding" in explorer.engine.panes()
    assert MARKS_KEY in explorer.engine.plots("matrix")
    assert explorer.URL_PARAMS["show_embedding"] == "embedding"


@pytest.mark.parametrize(("head", "sample"), [(0, 0), (5, 2)])
def test_the_drawn_points_are_the_embedding_of_the_shown_head(explorer, trace, head, sample):
    explorer.param.update(head=head, sample=sample)
    embedding = qk_embedding(trace, head=head)
    assert_the_points_of(explorer, embedding, sample)
    assert (
        explorer.engine.title("embedding")
        == f"head {head}, sample {sample} · grey: the other samples"
    )
    first, second = embedding.attrs["explained_variance"]
    axes = explorer.sections["embedding"].figure.figure
    assert axes.xaxis[0].axis_label == f"PC 1 ({100 * first:.0f}% of the variance)"
    assert axes.yaxis[0].axis_label == f"PC 2 ({100 * second:.0f}%)"
    assert explorer.last_error == ""


def test_each_point_takes_its_kinds_colour_at_its_position(explorer, trace):
    """A point alone among its 5 x 5 pixels shows its own position's colour of the ramp."""
    explorer.param.update(head=1, sample=3)
    embedding = qk_embedding(trace, head=1)
    pixels, window = drawn_image(explorer)
    shape = pixels.shape[:2]
    shown = embedding["sample"].values == 3
    counts = np.zeros(shape, int)
    (x0, x1), (y0, y1) = window
    cols = np.floor((embedding["x"].values - x0) / (x1 - x0) * shape[1]).astype(int)
    rows = np.floor((embedding["y"].values - y0) / (y1 - y0) * shape[0]).astype(int)
    np.add.at(counts, (rows[shown], cols[shown]), 1)
    checked = 0
    for i in np.nonzero(shown)[0]:
        r, c = rows[i], cols[i]
        if not (2 <= r < shape[0] - 2 and 2 <= c < shape[1] - 2):
            continue
        if counts[r - 2 : r + 3, c - 2 : c + 3].sum() != 1:
            continue
        colors = QUERY_COLORS if embedding["kind"].values[i] == "query" else KEY_COLORS
        level = embedding["position"].values[i] / (trace.sizes["query"] - 1)
        expected = ramp(colors)[int(round(level * 255))]
        rgb = [int(expected[j : j + 2], 16) for j in (1, 3, 5)]
        np.testing.assert_allclose(pixels[r, c, :3], rgb, atol=2)
        checked += 1
    assert checked > 20


def test_changing_the_head_redraws_the_embedding(explorer, trace):
    explorer.head = 2
    before, _ = drawn_image(explorer)
    explorer.head = 6
    after, _ = drawn_image(explorer)
    assert not np.array_equal(before, after)
    assert_the_points_of(explorer, qk_embedding(trace, head=6), 0)
    explorer.head = "mean"
    pixels, _ = drawn_image(explorer)
    assert not pixels[..., 3].any()  # nothing drawn, and the title says why
    assert " ".join(explorer.engine.title("embedding").split()) == MEAN_HEAD
    assert marked(explorer) == ([], [])


def in_box(trace, embedding, sample: int, box) -> tuple[list[int], list[int]]:
    """The sample's query and key positions whose points lie in the box, the long way."""
    (x0, x1), (y0, y1) = box
    x, y = embedding["x"].values, embedding["y"].values
    inside = (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
    inside &= embedding["sample"].values == trace["batch"].values[sample]
    positions = embedding["position"].values  # the demo's labels are the positions
    found = [
        sorted(set(positions[inside & (embedding["kind"].values == kind)].tolist()))
        for kind in ("query", "key")
    ]
    return found[0], found[1]


def quantile_box(embedding, low: float, high: float) -> tuple:
    x, y = embedding["x"].values, embedding["y"].values
    return (
        tuple(np.quantile(x, [low, high]).tolist()),
        tuple(np.quantile(y, [low, high]).tolist()),
    )


def test_a_box_marks_exactly_its_queries_and_keys_on_the_matrix(explorer, trace):
    explorer.param.update(head=3, sample=1)
    section = explorer.sections["embedding"]
    embedding = qk_embedding(trace, head=3)
    box = quantile_box(embedding, 0.3, 0.6)
    assert marked(explorer) == ([], []) and section.status.object == NO_BOX
    matrix = explorer.drawn("matrix")
    section.select(box[0][::-1], box[1])  # as drawn: the box's corners in any order
    queries, keys = in_box(trace, embedding, 1, box)
    assert 0 < len(queries) < 480 and 0 < len(keys) < 480
    assert marked(explorer) == (queries, keys)
    status = section.status.object
    assert f"{len(queries)} queries and {len(keys)} keys of sample 1" in status
    outline = section.figure.box
    assert outline.visible
    assert (outline.left, outline.right, outline.bottom, outline.top) == (*box[0], *box[1])
    # the marks are drawn over the matrix: its image is the head's, untouched
    np.testing.assert_array_equal(explorer.drawn("matrix"), matrix)
    assert explorer.engine.title("matrix").startswith("sample 1, head 3")
    # the box stays on the plane when the sample changes: the new sample's points in it
    explorer.sample = 2
    assert marked(explorer) == in_box(trace, embedding, 2, box)
    # another head is another plane: the box and its marks go
    explorer.head = 4
    assert marked(explorer) == ([], [])
    assert not section.figure.box.visible and section.status.object == NO_BOX
    explorer.head = 3  # and coming back finds no box
    assert marked(explorer) == ([], [])
    section.select(*box)
    assert marked(explorer) == in_box(trace, embedding, 2, box)
    explorer.show_embedding = False  # the matrix shows no marks of a hidden box
    assert marked(explorer) == ([], [])
    explorer.show_embedding = True
    assert marked(explorer) == in_box(trace, embedding, 2, box)
    section.clear()
    assert marked(explorer) == ([], [])


def test_a_zoom_aggregates_the_points_of_the_window_again(explorer, trace):
    explorer.head = 0
    section = explorer.sections["embedding"]
    embedding = qk_embedding(trace, head=0)
    (x0, x1), (y0, y1) = quantile_box(embedding, 0.4, 0.7)
    side = max(x1 - x0, y1 - y0)
    section.figure.figure.x_range.update(start=x0, end=x0 + side)
    section.figure.figure.y_range.update(start=y0, end=y0 + side)
    _, window = drawn_image(explorer)
    np.testing.assert_allclose(window, ((x0, x0 + side), (y0, y0 + side)))
    assert_the_points_of(explorer, embedding, 0)  # the window's points at full resolution
    explorer.head = 1  # another plane: every point again
    _, window = drawn_image(explorer)
    x = qk_embedding(trace, head=1)["x"].values
    assert window[0][0] < x.min() and window[0][1] > x.max()


def test_it_follows_the_layer_of_a_capture_with_padding():
    """A padded batch of two layers: the plane of the shown layer, without padded points,
    and a box marks the matrix rows and columns of those positions."""
    import zoo

    model, args, kwargs = zoo.case("bert_padding").build()  # samples of 12 and 8 tokens
    capture = attnpanel.capture(model, *args, **kwargs)
    explorer = AttentionExplorer(capture, layer=0, head=2, sample=1, show_embedding=True)
    explorer.__panel__().get_root(Document())
    assert_the_points_of(explorer, qk_embedding(capture, layer=0, head=2), 1)
    explorer.layer = 1
    embedding = qk_embedding(capture, layer=1, head=2)
    assert_the_points_of(explorer, embedding, 1)
    section = explorer.sections["embedding"]
    everything = ((-1e9, 1e9), (-1e9, 1e9))
    section.select(*everything)
    assert marked(explorer) == (list(range(8)), list(range(8)))  # the sample's 8 tokens
    assert explorer.last_error == ""


def test_a_notebook_gets_the_same_image(explorer):
    explorer.param.update(head=4, sample=0)
    image = explorer.dynamic_map(VIEW)[()]
    assert isinstance(image, hv.RGB)
    pixels, _ = drawn_image(explorer)
    for channel, name in enumerate("RGBA"):
        shown = image.dimension_values(name, flat=False)  # rows by ascending y
        np.testing.assert_array_equal(shown, pixels[..., channel], err_msg=name)


def test_a_trace_without_q_and_k_says_so(trace):
    explorer = AttentionExplorer(trace.drop_vars(["q", "k"]), show_embedding=True)
    explorer.__panel__().get_root(Document())
    column = explorer.sections["embedding"].__panel__()
    assert "needs the trace's q and k" in column.objects[0].objects[1].object
    assert "embedding" not in explorer.engine.panes()


def test_the_page_of_a_virtual_trace_has_no_embedding():
    from pairs import long_layer_pair

    from attnpanel.app.explore import explore

    _, lazy = long_layer_pair(200)
    explorer = explore(lazy)
    assert "embedding" not in explorer.sections


def test_the_page_with_the_embedding_passes_bokehs_validation(trace):
    """Servers skip Bokeh's document validation (``serving.skip_document_validation``); the
    page with the section shown and a box drawn is validated here."""
    from bokeh.core.validation.check import check_integrity

    explorer = AttentionExplorer(trace, show_embedding=True)
    doc = Document()
    doc.add_root(explorer.__panel__().get_root(doc))
    explorer.sections["embedding"].select((-1.0, 1.0), (-1.0, 1.0))
    issues = check_integrity(doc.roots)
    assert issues.error == [] and issues.warning == [], (issues.error, issues.warning)


def test_labelled_positions_and_samples_are_placed_by_index():
    """A trace whose positions and samples carry labels of their own (steps 100, 102, ...;
    samples "a", "b"): the box's points are placed on the matrix by index."""
    import torch

    from attnpanel.readouts.embedding import box_positions, matrix_positions

    torch.manual_seed(0)
    layer = attnpanel.MultiHeadSelfAttention(d_model=16, n_heads=2, mask="causal")
    labelled = attnpanel.trace(layer, torch.randn(2, 10, 16))
    steps = 100 + 2 * np.arange(10)
    labelled = labelled.assign_coords(position=steps, query=steps, key=steps, batch=["a", "b"])
    embedding = qk_embedding(labelled, head=1)
    np.testing.assert_array_equal(matrix_positions(labelled, embedding), np.tile(np.arange(10), 4))
    x, y = embedding["x"].values, embedding["y"].values
    box = ((x.min(), np.median(x)), (y.min(), y.max()))
    queries, keys = box_positions(labelled, embedding, 1, *box)
    chosen = (x <= np.median(x)) & (embedding["sample"].values == "b")
    kinds = embedding["kind"].values
    expected = [(steps.tolist().index(p)) for p in embedding["position"].values]
    expected = np.array(expected)
    np.testing.assert_array_equal(queries, np.unique(expected[chosen & (kinds == "query")]))
    np.testing.assert_array_equal(keys, np.unique(expected[chosen & (kinds == "key")]))
    assert 0 < len(queries) < 10

"""The explorer of a virtual trace (attnpanel.app.long_explorer, attnpanel.readouts.windows).

What the page draws is checked against the model's own attention: the dense trace of the
same layer and input holds the weights the model computed; the virtual one holds only
each row's lse. Maps show each pixel's maximum, blocked cells NaN.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numerics
import numpy as np
import pytest
import torch
import xarray as xr
from bokeh.models import HoverTool
from pairs import padded_pair

from attnpanel.app import linked
from attnpanel.app.explore import explore
from attnpanel.app.long_explorer import LongExplorer
from attnpanel.kernels import masks as masks_module
from attnpanel.kernels import tiles
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.kernels.masks import build_mask
from attnpanel.readouts import windows
from attnpanel.readouts.raster import raster_values
from attnpanel.render.client_maps import palette_index
from attnpanel.render.elements import MAP_KEY, PlotKey
from attnpanel.traces import overviews, virtual
from attnpanel.traces.build import trace
from attnpanel.traces.stages import masked_cells, recompute_weights

LENGTH = 700


@pytest.fixture(scope="module")
def pair():
    """The same diagonal layer and input, traced dense (the model's weights) and virtual."""
    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(48, 4, "diagonal").eval()
    x = torch.randn(2, LENGTH, 48, generator=torch.Generator().manual_seed(1)) * 2
    return trace(layer, x, dense=True), trace(layer, x, dense=False)


@pytest.fixture(scope="module")
def page(pair):
    explorer = LongExplorer(pair[1])
    explorer.__panel__()
    yield explorer


@pytest.fixture
def explorer(page):
    page.reset()
    page.linked.clear()
    page.linked.zoom((-0.5, LENGTH - 0.5), (-0.5, LENGTH - 0.5))
    page.engine.window = None
    return page


def _pixel_max(dense: np.ndarray, rows: int, cols: int, blocked=None) -> np.ndarray:
    """The reference: each pixel's cells (the overview's bins) reduced by max; a pixel
    whose every cell is blocked NaN."""
    row_of = np.repeat(
        np.arange(rows), np.diff(np.append(tiles.pixel_starts(len(dense), rows), len(dense)))
    )
    n_keys = dense.shape[1]
    col_of = np.repeat(
        np.arange(cols), np.diff(np.append(tiles.pixel_starts(n_keys, cols), n_keys))
    )
    out = np.full((rows, cols), -np.inf)
    np.maximum.at(out, (row_of[:, None], col_of[None, :]), dense)
    if blocked is not None:
        open_cells = np.zeros((rows, cols))
        np.add.at(open_cells, (row_of[:, None], col_of[None, :]), ~blocked)
        out[open_cells == 0] = np.nan
    return out


def _agree(drawn, expected, dense: xr.Dataset, mask: str = "diagonal") -> None:
    """What the page draws from the virtual trace's tiles (the fused kernel's lse) against
    the dense trace's softmax: two float32 kernels, within their derived bound."""
    key = (id(dense), mask)
    if key not in _LOGITS:
        _LOGITS[key] = numerics.trace_logits(dense, mask)
    numerics.assert_kernels_agree(drawn, expected, logits=_LOGITS[key])


_LOGITS: dict = {}


def _blocked(mode: str, length: int) -> np.ndarray:
    found = build_mask(mode, length)
    return np.zeros((length, length), bool) if found is None else found.numpy()


def test_a_virtual_trace_opens_the_long_explorer(pair):
    dense, lazy = pair
    assert isinstance(explore(lazy), LongExplorer)
    assert not isinstance(explore(dense), LongExplorer)
    with pytest.raises(ValueError, match="virtual trace"):
        LongExplorer(dense)
    with pytest.raises(ValueError, match="one head at a time"):
        LongExplorer(lazy, head="mean")


def test_the_whole_map_is_each_pixels_maximum_of_the_models_weights(pair, explorer):
    """At 700 positions on 480 pixels, each pixel is the max of its 1-2 x 1-2 cells of the
    weights the model computed; the stored overview gives the same numbers."""
    dense, _ = pair
    explorer.param.update(sample=1, head=2)
    drawn = explorer.drawn()
    weights = dense["weights"].isel(batch=1, head=2).values
    blocked = _blocked("diagonal", LENGTH)
    _agree(drawn, _pixel_max(weights, 480, 480, blocked), dense)
    assert "overview" in explorer.engine.title("matrix")
    bounds = (-0.5, -0.5, LENGTH - 0.5, LENGTH - 0.5)
    for head in range(4):
        tile = explorer.drawn(f"head {head}", "HeadMap")
        own = _pixel_max(dense["weights"].isel(batch=1, head=head).values, 480, 480, blocked)
        # the small tile: datashader's max of the overview's pixels under each of its own
        expected, _ = raster_values(own, bounds, *tile.shape[::-1], agg="max")
        _agree(tile, expected, dense)


def test_a_zoomed_window_shows_its_own_cells_and_marks_blocked_ones(pair, explorer):
    dense, _ = pair
    explorer.param.update(sample=0, head=1)
    explorer.linked.zoom((99.5, 399.5), (149.5, 449.5))  # 300 x 300 cells on 480 pixels
    drawn = explorer.drawn()
    weights = dense["weights"].isel(batch=0, head=1).values[150:450, 100:400]
    blocked = _blocked("diagonal", LENGTH)[150:450, 100:400]
    np.testing.assert_array_equal(np.isnan(drawn), blocked)
    _agree(drawn[~blocked], weights[~blocked], dense)
    assert "every cell" in explorer.engine.title("matrix")
    # the head maps (140 px) reduce the same window to their pixels, by max
    tile = explorer.drawn("head 1", "HeadMap")
    expected = _pixel_max(np.where(blocked, -np.inf, weights), *tile.shape)
    _agree(tile, expected, dense)


def test_a_window_larger_than_the_exact_limit_is_cut_from_the_overview_then_refined(
    pair, explorer, monkeypatch
):
    """Over EXACT_CELLS, a window is first cut from the overview (each pixel the max of its
    block, coarser than the screen here), then the large map is refined to the window's
    own pixels; the small head tiles keep the overview's blocks."""
    dense, _ = pair
    monkeypatch.setattr(windows, "EXACT_CELLS", 100 * 100)
    window = ((-0.5, 349.5), (-0.5, 349.5))
    weights = dense["weights"].isel(batch=0, head=0).values
    blocked = _blocked("diagonal", LENGTH)
    whole = _pixel_max(weights, 480, 480, blocked)
    found = explorer.source.virtual_map(explorer.selection)
    quick, _ = found.raster(480, 480, window)
    # the overview's pixels over the window: each still the max of its own cells
    _agree(quick, whole[: quick.shape[0], : quick.shape[1]], dense)
    assert found.refined(480, 480, window) is not None
    assert found.refined(480, 480, None) is None  # the whole map: the overview is exact
    explorer.linked.zoom(*window)
    drawn = explorer.drawn()
    assert "every cell" in explorer.engine.title("matrix")
    np.testing.assert_array_equal(np.isnan(drawn), blocked[:350, :350])
    shown = ~blocked[:350, :350]
    _agree(drawn[shown], weights[:350, :350][shown], dense)
    tile = explorer.drawn("head 0", "HeadMap")  # 140 px: the overview's blocks suffice
    expected, _ = found.raster(*tile.shape[::-1], window)
    _agree(tile, expected, dense)


def test_an_exact_window_is_each_pixels_maximum_over_its_own_cells(pair, monkeypatch):
    """Over EXACT_CELLS, a map made exact (what a refinement draws) computes each pixel's
    max of the model's weights over its own cells of the window."""
    dense, lazy = pair
    monkeypatch.setattr(windows, "EXACT_CELLS", 100 * 100)
    found = windows.VirtualMap(
        lazy,
        overviews.Overviews(lazy),
        1,
        3,
        "diagonal",
        lambda: virtual.row_lse(lazy, "diagonal", 1),
    )
    window = ((49.5, 649.5), (99.5, 399.5))  # 600 keys x 300 queries on 200 x 100 pixels
    # 3 x 3 cells a pixel: the overview's 2 x 2 blocks are fine enough, no refinement
    assert found.refined(200, 100, window) is None
    exact = dataclasses.replace(found, exact=True)
    values, bounds = exact.raster(200, 100, window)
    weights = dense["weights"].isel(batch=1, head=3).values[100:400, 50:650]
    blocked = _blocked("diagonal", LENGTH)[100:400, 50:650]
    expected = _pixel_max(np.where(blocked, -np.inf, weights), *values.shape)
    _agree(values, expected, dense)
    assert "(this window)" in exact.describe(200, 100, window)


def test_another_mask_is_recomputed_from_q_and_k(pair, explorer):
    dense, _ = pair
    explorer.param.update(mask="causal", head=3)
    explorer.linked.zoom((199.5, 519.5), (299.5, 619.5))
    drawn = explorer.drawn()
    expected = recompute_weights(dense, "causal", batch=0).isel(head=3).values[300:620, 200:520]
    blocked = _blocked("causal", LENGTH)[300:620, 200:520]
    np.testing.assert_array_equal(np.isnan(drawn), blocked)
    _agree(drawn[~blocked], expected[~blocked], dense, mask="causal")
    assert "mask causal" in explorer.engine.title("matrix")


def test_a_query_click_draws_its_row_and_heaviest_keys(pair, explorer):
    dense, _ = pair
    explorer.sections["matrix"].click(x=10.0, y=412.3)
    assert explorer.query == 412
    explorer.param.update(head=2)
    row = dense["weights"].isel(batch=0, head=2, query=412).values
    curve = explorer.engine.plots("query row")
    source = next(h[0]["source"] for k, h in curve.items() if k.group == "QueryRow")
    _agree(source.data["weight"], row, dense)
    from drawn import table_rows

    listed = table_rows(explorer, "top keys")
    expected = np.argsort(-row, kind="stable")[: windows.TOP_KEYS]
    assert [int(r["key"]) for r in listed] == expected.tolist()
    assert float(listed[0]["weight"]) == pytest.approx(row[expected[0]], abs=1e-5)
    assert list(listed[0]) == ["rank", "key", "weight"]  # no clock: no (empty) time column
    assert f"heaviest key {expected[0]}" in explorer.engine.title("query row")
    # its weight axis keeps one width for any query (0.000015 fits): no page layout
    plot = next(h[0]["plot"] for k, h in curve.items() if k.group == "QueryRow")
    formatter = plot.yaxis[0].formatter
    assert formatter.args["chars"] == 8 and plot.yaxis[0].major_label_text_font == "monospace"


def test_a_row_is_recomputed_as_a_softmax_only(pair):
    """A linear attention's weights (rows over their sums) are held dense, never recomputed
    as a softmax: asked for a row or a box's mass, each says so."""
    linear = pair[1].assign_attrs(normaliser="row sum")
    with pytest.raises(ValueError, match="a query's row is .* formed by 'row sum'"):
        windows.query_row(linear, 0, 0, 3, "diagonal")
    with pytest.raises(ValueError, match="a box's attention mass is .* formed by 'row sum'"):
        windows.streamed_mass_share(linear, 0, [0], "diagonal", None, slice(0, 2), slice(0, 2))


def test_a_box_compares_the_heads_attention_mass(pair, explorer):
    dense, _ = pair
    box = ((99.5, 299.5), (199.5, 259.5))
    explorer.linked.select(*box)
    expected = linked.mass_share(dense["weights"].isel(batch=0).values, *box)
    grid = explorer.sections["heads"].grid  # the shares are bars under the head tiles
    np.testing.assert_allclose(grid.drawn_shares(), expected, rtol=0, atol=1e-5)
    assert "queries 200-259 on keys 100-299" in grid.figure.title.text


def test_the_padded_keys_stay_blocked_on_every_view():
    """Per-sample padding: the model never computed attention on padded keys; the page
    draws them as blocked (NaN), hides padded queries' rows as the dense page does, and
    the row gives padded keys 0."""
    dense, lazy = padded_pair()
    explorer = LongExplorer(lazy, sample=1, head=2)
    explorer.__panel__()
    drawn = explorer.drawn()
    weights = dense["weights"].isel(batch=1, head=2).values
    padded = np.asarray(lazy["padding"].isel(batch=1))
    blocked = _blocked("diagonal", 300) | padded[None, :] | padded[:, None]
    np.testing.assert_array_equal(blocked, masked_cells(dense, batch=1, head=2))
    np.testing.assert_array_equal(np.isnan(drawn), blocked)
    _agree(drawn[~blocked], weights[~blocked], dense)
    explorer.param.update(query=17)
    row = explorer.sections["query row"].row(explorer.selection)
    assert (row[-40:] == 0).all()
    _agree(row, weights[17], dense)


def test_live_rows_follow_the_mask():
    padding = torch.zeros(1, 6, dtype=torch.bool)
    padding[0, 1:] = True  # only key 0 is open
    for mode, expected in (
        ("none", [True] * 6),
        ("diagonal", [False, True, True, True, True, True]),
        ("causal", [True] * 6),
    ):
        masking = masks_module.Masking(mode, key_padding=padding)
        assert windows.live_rows(masking, slice(0, 6), 6).tolist() == expected
    masking = masks_module.Masking("causal", key_padding=torch.tensor([[True, False, False]]))
    assert windows.live_rows(masking, slice(0, 3), 3).tolist() == [False, True, True]


def test_the_envelope_keeps_each_bins_extremes_in_order():
    rng = np.random.default_rng(0)
    ys = rng.normal(size=10_000)
    ys[1234] = 50.0  # a single sharp peak
    xs = np.arange(ys.size, dtype=float)
    ex, ey = windows.envelope(xs, ys, 100)
    assert ex.size == ey.size == 200 and (np.diff(ex) >= 0).all()
    assert ey.max() == 50.0 and ey.min() == ys.min()
    starts = tiles.pixel_starts(ys.size, 100)
    bins = np.split(ys, starts[1:])
    picks = ex.astype(int)
    assert (np.searchsorted(starts, picks[0::2], "right") == np.arange(1, 101)).all()
    np.testing.assert_array_equal(
        np.sort(ey.reshape(-1, 2), axis=1), np.array([[b.min(), b.max()] for b in bins])
    )
    short = np.arange(10.0)
    assert windows.envelope(short, short, 100)[1] is short


def test_top_keys_are_the_heaviest_first():
    row = np.array([0.1, 0.5, 0.05, 0.3, 0.05], dtype=np.float32)
    keys, weights = windows.top_keys(row, 3)
    assert keys.tolist() == [1, 3, 0] and weights.tolist() == pytest.approx([0.5, 0.3, 0.1])


def test_a_virtual_map_is_exact_beside_a_dense_recomputation_for_random_windows(pair):
    """Property: random windows of a random head, any shape, against the model's weights."""
    dense, lazy = pair
    rng = np.random.default_rng(7)
    from attnpanel.traces.overviews import Overviews

    overviews = Overviews(lazy)
    for _ in range(12):
        sample, head = int(rng.integers(2)), int(rng.integers(4))
        lse = virtual.row_lse(lazy, "diagonal", sample)
        found = windows.VirtualMap(lazy, overviews, sample, head, "diagonal", lse)
        y0, x0 = rng.integers(0, LENGTH - 20, size=2)
        y1, x1 = y0 + rng.integers(10, LENGTH - y0), x0 + rng.integers(10, LENGTH - x0)
        width, height = int(rng.integers(20, 300)), int(rng.integers(20, 300))
        window = ((x0 - 0.5, x1 - 0.5), (y0 - 0.5, y1 - 0.5))
        raster, bounds = found.raster(width, height, window)
        cells = dense["weights"].isel(batch=sample, head=head).values[y0:y1, x0:x1]
        blocked = _blocked("diagonal", LENGTH)[y0:y1, x0:x1]
        expected = _pixel_max(np.where(blocked, -np.inf, cells), *raster.shape)
        expected[np.isneginf(expected)] = np.nan
        _agree(raster, expected, dense)
        assert bounds == (x0 - 0.5, y0 - 0.5, x1 - 0.5, y1 - 0.5)


def test_another_masks_whole_map_and_rows_need_no_pass_for_its_lse(pair, monkeypatch):
    """Switching the mask shows the other mode's overview and a query's row without the
    fused kernel's pass over every row (30 s at 64,800 for 8 heads); a zoomed window asks
    for it."""
    dense, lazy = pair
    explorer = LongExplorer(lazy)
    explorer.__panel__()
    asked = []
    real = virtual.row_lse
    monkeypatch.setattr(virtual, "row_lse", lambda *a, **k: asked.append(a[1]) or real(*a, **k))
    explorer.param.update(mask="none", query=123, head=1)
    assert asked == []
    expected = recompute_weights(dense, "none", batch=0).isel(head=1).values
    _agree(explorer.drawn(), _pixel_max(expected, 480, 480), dense, mask="none")
    row = explorer.sections["query row"].row(explorer.selection)
    _agree(row, expected[123], dense, mask="none")
    explorer.linked.zoom((9.5, 109.5), (9.5, 109.5))
    assert asked == ["none"]  # once, for every head's window
    _agree(explorer.drawn(), expected[10:110, 10:110], dense, mask="none")


def test_clock_axes_follow_the_sample(pair):
    """With a clock per sample, the map's, the curve's and the row's axes and hover read
    times from that sample's start (computed in the browser from start + step)."""
    _, lazy = pair
    start = np.array(["2026-01-01T06:00", "2026-03-02T14:00"], dtype="datetime64[m]")
    steps = np.arange(LENGTH).astype("timedelta64[m]")
    timed = lazy.assign_coords(time=(("batch", "position"), start[:, None] + steps[None, :]))
    explorer = LongExplorer(timed)
    explorer.__panel__()
    figures = {
        name: explorer.engine.handles(pane, key)[0]["plot"]
        for name, pane, key in (
            ("matrix", "matrix", PlotKey("Image", "Attention")),
            ("row", "query row", PlotKey("Curve", "QueryRow")),
        )
    }
    figures["sequence"] = next(iter(explorer.engine.plots("sequence").values()))[0]["plot"]

    def starts():
        found = set()
        for figure in figures.values():
            found.add(figure.xaxis[0].formatter.args["start"])
            hover = figure.select({"type": HoverTool})[0]
            found |= {f.args["start"] for k, f in hover.formatters.items() if k in ("$x", "$y")}
        return found

    ms = start.astype("datetime64[ms]").astype(np.int64)
    assert starts() == {int(ms[0])}
    assert figures["matrix"].yaxis[0].formatter.args["step"] == 60_000
    explorer.param.update(sample=1)
    assert starts() == {int(ms[1])}


def test_a_trace_without_its_input_shows_the_query_norm_without_a_pass_over_the_map(
    monkeypatch,
):
    """A virtual trace holding neither the input nor the power: the sequence is each
    position's query norm (what 'attention received' would need is every cell)."""
    dense, lazy = padded_pair()
    assert "x" not in lazy and "signal" not in lazy

    def every_cell(*args, **kwargs):
        raise AssertionError("the sequence computed the lazy weights")

    monkeypatch.setattr(tiles, "weights_tile", every_cell)
    explorer = LongExplorer(lazy, sample=1)
    explorer.__panel__()
    assert explorer.engine.title("sequence").startswith("sample 1: query vector norm")
    expected = np.linalg.norm(dense["q"].isel(batch=1).values, axis=-1).mean(0)
    (curve,) = [
        handles
        for key, found in explorer.engine.plots("sequence").items()
        if key.kind == "Curve"
        for handles in found
    ]
    ys = np.asarray(curve["source"].data["norm"])
    np.testing.assert_allclose(np.nanmax(ys), expected.max(), rtol=1e-6)
    np.testing.assert_allclose(np.nanmin(ys), expected.min(), rtol=1e-6)


def test_the_long_page_saves_what_it_shows_from_the_overviews_it_drew(pair, tmp_path, monkeypatch):
    """``save`` writes the offline page of the sample, mask and query shown, from the
    overviews the page already holds: no map is computed again."""
    from test_export_virtual import _payload

    from attnpanel.traces import overviews

    explorer = LongExplorer(pair[1], sample=1, head=2, query=345, mask="causal")
    explorer.__panel__()

    def computed(task):
        raise AssertionError("the export computed a map the page holds")

    monkeypatch.setattr(overviews, "compute", computed)
    path = explorer.save(tmp_path / "long.html")
    payload = _payload(path)
    assert payload["masks"] == ["causal"]
    assert len(payload["maps"]["causal"]) == explorer.n_heads
    assert path.stat().st_size <= 5_000_000
    text = path.read_text("utf-8")
    assert "sample 1" in text and '"value":345' in text.replace(" ", "")


def _levels(values: np.ndarray, explorer) -> np.ndarray:
    """The palette index each cell is painted with, on ``explorer``'s matrix's scale."""
    mapper = explorer.engine.handles("matrix", MAP_KEY)[0]["color_mapper"]
    return palette_index(values, mapper.low, mapper.high, len(mapper.palette))


def _bar_title(explorer) -> str:
    return explorer.engine.handles("matrix", MAP_KEY)[0]["colorbar"].title


def test_a_heads_map_sent_ahead_is_drawn_by_the_browser_in_the_servers_colours(pair):
    """Once idle, every head's map of the shown window goes ahead (its overview at hand);
    a head change then writes no image, and the browser paints each cell the colour the
    server's own image of that head gets; a mask whose overviews are not computed waits
    for the user, and the server draws it."""
    _, lazy = pair
    explorer = LongExplorer(lazy)
    explorer.__panel__()
    prefetch = explorer.sections["matrix"].prefetch
    main = explorer.engine.handles("matrix", MAP_KEY)[0]["source"]
    first_bar = _bar_title(explorer)
    explorer.engine.finish_idle()
    assert prefetch.sent == 4  # the four heads under the trace's own mask
    image = main.data["image"][0]
    explorer.head = 2
    assert main.data["image"][0] is image  # no image written: the browser draws it
    served = LongExplorer(lazy, head=2)
    served.__panel__()
    assert explorer.engine.title("matrix") == served.engine.title("matrix")
    assert _bar_title(explorer) == _bar_title(served) == first_bar  # the same words
    exact = served.drawn()
    np.testing.assert_array_equal(_levels(explorer.drawn(), served), _levels(exact, served))
    np.testing.assert_array_equal(np.isnan(explorer.drawn()), np.isnan(exact))
    # another mask: its overviews are not at hand, nothing went ahead; the server draws it
    explorer.mask = "causal"
    assert main.data["image"][0] is not image
    assert "mask causal" in explorer.engine.title("matrix")


def test_a_refined_windows_heads_go_ahead_as_the_server_draws_them_last(pair, monkeypatch):
    """Zoomed over EXACT_CELLS, the server draws the overview's blocks, then the window's
    own pixels: what goes ahead for the other heads is the latter."""
    monkeypatch.setattr(windows, "EXACT_CELLS", 100 * 100)
    _, lazy = pair
    window = ((-0.5, 349.5), (-0.5, 349.5))
    explorer = LongExplorer(lazy)
    explorer.__panel__()
    explorer.linked.zoom(*window)
    explorer.engine.finish_idle()
    assert explorer.sections["matrix"].prefetch.sent == 4
    explorer.head = 3
    served = LongExplorer(lazy, head=3)
    served.__panel__()
    served.linked.zoom(*window)
    assert "every cell" in served.engine.title("matrix")
    assert explorer.engine.title("matrix") == served.engine.title("matrix")
    exact = served.drawn()
    np.testing.assert_array_equal(_levels(explorer.drawn(), served), _levels(exact, served))


def test_without_maps_ahead_the_long_page_sends_none_and_its_link_says_so(pair):
    _, lazy = pair
    assert LongExplorer.URL_PARAMS["maps_ahead"] == "ahead"  # ?ahead=false
    explorer = LongExplorer(lazy, maps_ahead=False)
    explorer.__panel__()
    explorer.engine.finish_idle()
    assert explorer.sections["matrix"].prefetch.sent == 0
    main = explorer.engine.handles("matrix", MAP_KEY)[0]["source"]
    image = main.data["image"][0]
    explorer.head = 1
    assert main.data["image"][0] is not image  # the server drew it


def test_the_long_pages_benchmark_runs_on_the_page_as_it_is(pair, monkeypatch):
    """``benchmarks/long_explorer.py``'s server-side steps on a small page: a benchmark is
    not run by the suite, and one broke unseen when the page's sources moved."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "long_explorer.py"
    spec = importlib.util.spec_from_file_location("attnpanel_long_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(windows, "EXACT_CELLS", 100 * 100)  # 300^2 windows are refined
    explorer = LongExplorer(pair[1])
    explorer.__panel__()
    times = bench.zoom_during_refinement(explorer, repeats=1, side=300)
    assert set(times) == {"stopped (cancel)", "run to its end (baseline)"}
    assert all(len(found) == 1 and found[0] > 0 for found in times.values())

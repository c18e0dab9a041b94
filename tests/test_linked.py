"""Linked zoom and box selection (``attnpanel.app.linked``): mass shares and windowed rasters."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from bokeh.document import Document

from attnpanel.app import linked
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.registry import LINKED_GROUPS
from attnpanel.readouts.raster import snap_window, window_raster
from attnpanel.render import palette


def small_trace(n: int = 40, heads: int = 3) -> xr.Dataset:
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(2, heads, n, n))
    weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    return xr.Dataset({"weights": (("batch", "head", "query", "key"), weights.astype(np.float32))})


def test_mass_share_matches_a_hand_computation():
    weights = np.zeros((2, 4, 4))
    weights[0] = [
        [0.5, 0.5, 0.0, 0.0],
        [0.1, 0.2, 0.3, 0.4],
        [0.25, 0.25, 0.25, 0.25],
        [1.0, 0.0, 0.0, 0.0],
    ]
    weights[1] = np.eye(4)
    # Keys 1-2 (cell centres 1, 2 in [0.6, 2.4]) of queries 1-2 (centres in [0.7, 2.2]).
    share = linked.mass_share(weights, (0.6, 2.4), (2.2, 0.7))
    # head 0: (0.2 + 0.3 + 0.25 + 0.25) / (1 + 1); head 1: (1 + 1) / 2
    np.testing.assert_allclose(share, [0.5, 1.0])
    # Query 3 only, keys 1-3: head 0 puts nothing there, head 1 all of its mass.
    np.testing.assert_allclose(linked.mass_share(weights, (0.5, 3.5), (2.5, 3.5)), [0.0, 1.0])


def test_mass_share_of_an_empty_box_or_a_massless_row_is_nan():
    weights = np.zeros((1, 3, 3))
    weights[0, 0] = [0.2, 0.3, 0.5]
    assert np.isnan(linked.mass_share(weights, (0.2, 0.8), (0.2, 0.8))).all()  # no centre
    assert np.isnan(linked.mass_share(weights, (0, 2), (1, 2))).all()  # rows carry no mass
    assert linked.box_cells((-5, 99), (1.5, 1.6), 3, 3) == (slice(2, 2), slice(0, 3))


def test_snap_window_clips_to_whole_cells_and_scales_the_pixels():
    bounds, shape = (-0.5, -0.5, 479.5, 479.5), (480, 480)
    # Window 100.2-219.7 in a 150 px frame: the cells 100..220 that it touches, on
    # 150 px x 121 / 119.5.
    width, height, x_range, y_range = snap_window(
        bounds, shape, 150, 150, (100.2, 219.7), (300.0, 180.0)
    )
    assert x_range == (99.5, 220.5) and width == 152
    assert y_range == (179.5, 300.5) and height == 151
    # Zoomed out past the data: only the data is rasterized, on its share of the frame.
    width, height, x_range, y_range = snap_window(
        bounds, shape, 150, 150, (-480, 960), (-0.5, 479.5)
    )
    assert x_range == (-0.5, 479.5) and width == 50 and height == 150
    assert snap_window(bounds, shape, 150, 150, (600, 700), (0, 10)) is None


@pytest.fixture(scope="module")
def explorer():
    ex = AttentionExplorer(small_trace())
    doc = Document()
    doc.add_root(ex.__panel__().get_root(doc))
    return ex


def images(ex) -> dict:
    out = {}
    for pane in ex.engine.panes():
        for key, found in ex.engine.plots(pane).items():
            # The head average is hidden (and not redrawn) until show_head_average.
            if key.kind == "Image" and key.group in LINKED_GROUPS and pane != "head average":
                out[pane] = found[0]
    return out


def test_maps_share_ranges_and_a_zoom_rerasterizes_the_window(explorer):
    maps = images(explorer)
    assert {"matrix", "head 0", "head 1", "head 2"} <= set(maps)
    grid = explorer.sections["heads"].grid
    # The matrices share one pair of ranges (linked in the browser); the head tiles are one
    # figure that follows the window the matrices show.
    figures = [h["plot"] for p, h in maps.items() if not p.startswith("head ")]
    assert len({id(f.x_range) for f in figures}) == 1
    assert len({id(f.y_range) for f in figures}) == 1
    assert {id(maps[f"head {h}"]["plot"]) for h in range(3)} == {id(grid.figure)}
    weights = explorer.trace["weights"].values[0]
    explorer.linked.zoom((4.6, 20.2), (30.4, 10.0))
    for pane, found in maps.items():
        data = found["source"].data
        if pane.startswith("head "):
            # 16 x 21 cells on a 140 px tile: the image is the array's window itself.
            np.testing.assert_array_equal(data["image"][0], weights[int(pane[5:]), 10:31, 5:21])
        else:
            assert (data["x"][0], data["y"][0], data["dw"][0], data["dh"][0]) == (4.5, 9.5, 16, 21)
    assert grid.window_bounds == (4.5, 9.5, 20.5, 30.5)
    assert figures[0].x_range.start == 4.6 and figures[0].y_range.end == 10.0
    explorer.linked.zoom((-0.5, 39.5), (39.5, -0.5))
    head = maps["head 1"]["source"].data["image"][0]
    np.testing.assert_array_equal(head, weights[1])
    assert grid.window_bounds == (-0.5, -0.5, 39.5, 39.5)


def test_windowed_raster_downsamples_with_datashader_when_cells_exceed_pixels():
    values = np.arange(480 * 480, dtype=np.float32).reshape(480, 480)
    raster, bounds = window_raster(values, 150, 150, ((-0.5, 299.5), (-0.5, 299.5)))
    assert raster.shape == (150, 150) and bounds == (-0.5, -0.5, 299.5, 299.5)
    expected = values[:300, :300].reshape(150, 2, 150, 2).mean(axis=(1, 3))
    np.testing.assert_allclose(raster, expected, rtol=1e-6)
    # 100 cells <= 150 px: the slice itself
    raster, bounds = window_raster(values, 150, 150, ((99.5, 199.5), (9.5, 109.5)))
    np.testing.assert_array_equal(raster, values[10:110, 100:200])
    assert bounds == (99.5, 9.5, 199.5, 109.5)


def test_box_select_marks_every_map_and_fills_the_mass_bars(explorer):
    explorer.linked.select((20.4, 5.2), (3.0, 12.6))
    for box in explorer.linked.boxes:
        assert box.visible and (box.left, box.right, box.bottom, box.top) == (5.2, 20.4, 3, 12.6)
    grid = explorer.sections["heads"].grid  # the shares are bars under the head tiles
    weights = explorer.trace["weights"].values[explorer.sample].astype(np.float64)
    expected = weights[:, 3:13, 6:21].sum(axis=(1, 2)) / weights[:, 3:13].sum(axis=(1, 2))
    np.testing.assert_allclose(grid.drawn_shares(), expected, rtol=1e-5)
    assert grid.shares.data["text"] == [f"{v:.2f}" for v in expected]
    assert list(grid.shares.data["color"]) == list(palette.HEAD_COLORS[:3])
    assert grid.figure.title.text == f"{linked.SHARE_LABEL}: queries 3-12 on keys 6-20"
    explorer.sample = 1  # the bars follow the sample
    weights = explorer.trace["weights"].values[1].astype(np.float64)
    expected = weights[:, 3:13, 6:21].sum(axis=(1, 2)) / weights[:, 3:13].sum(axis=(1, 2))
    np.testing.assert_allclose(grid.drawn_shares(), expected, rtol=1e-5)
    outline = grid.box.data  # the box on every head's tile
    for head in range(3):
        keys, queries = grid.to_window(
            (outline["left"][head], outline["right"][head]),
            (outline["bottom"][head], outline["top"][head]),
        )
        assert keys == pytest.approx((5.2, 20.4)) and queries == pytest.approx((3.0, 12.6))
    explorer.linked.clear()
    assert not any(box.visible for box in explorer.linked.boxes)
    assert len(grid.drawn_shares()) == 0 and len(grid.box.data["left"]) == 0
    assert grid.figure.title.text == linked.NO_BOX_LABEL


def test_a_box_drawn_on_a_head_tile_selects_its_keys_and_queries(explorer):
    grid = explorer.sections["heads"].grid
    x0, y0 = grid.origin(2)
    # Keys 10.3-20.6 and queries 5.3-15.6 of the 40-position window (cells 11-20 and
    # 6-15), drawn on head 2's tile: read through that tile, whichever way it was dragged.
    grid.select((x0 + 21.1 / 40, x0 + 10.8 / 40), (y0 + 5.8 / 40, y0 + 16.1 / 40))
    keys, queries = explorer.linked.box
    assert keys == pytest.approx((10.3, 20.6)) and queries == pytest.approx((5.3, 15.6))
    weights = explorer.trace["weights"].values[explorer.sample].astype(np.float64)
    expected = weights[:, 6:16, 11:21].sum(axis=(1, 2)) / weights[:, 6:16].sum(axis=(1, 2))
    np.testing.assert_allclose(grid.drawn_shares(), expected, rtol=1e-5)
    explorer.linked.clear()


def test_one_head_grid_leaves_room_for_the_box_title():
    """A grid of one head is one tile wide; the figure is still wide enough for the title
    that names the box (a 140 px figure clipped it)."""
    from attnpanel.render.head_grid import MIN_WIDTH_PX

    ex = AttentionExplorer(small_trace(heads=1))
    ex.__panel__().get_root(Document())
    grid = ex.sections["heads"].grid
    assert grid.columns == grid.rows == 1
    assert grid.figure.width >= MIN_WIDTH_PX
    ex.linked.select((3.0, 10.0), (2.0, 12.0))
    assert grid.figure.title.text.endswith("queries 2-12 on keys 3-10")
    assert len(grid.drawn_shares()) == 1

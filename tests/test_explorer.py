"""AttentionExplorer driven headlessly: set params, check the Bokeh models it drew into."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import panel as pn
import pytest
import torch
from bokeh.document import Document
from bokeh.models import Legend
from drawn import handles, shown_matrix, table_rows

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.readouts import core
from attnpanel.render import views

LENGTH = 40


def make_trace(n_batch=2):
    torch.manual_seed(0)
    layer = attnpanel.MultiHeadSelfAttention(d_model=96, n_heads=8, mask="diagonal")
    time = np.datetime64("2025-06-02T06:00") + np.arange(LENGTH) * np.timedelta64(1, "m")
    ds = attnpanel.trace(
        layer, torch.randn(n_batch, LENGTH, 96), time=time.astype("datetime64[ns]")
    )
    rng = np.random.default_rng(0)
    # reference series (docs/trace.md): an input signal, two channels' truth and prediction
    ds["signal"] = (("batch", "position"), rng.random((n_batch, LENGTH)).astype(np.float32))
    ds["signal"].attrs.update(long_name="aggregate power", units="W")
    ds["truth"] = (
        ("batch", "series", "position"),
        rng.random((n_batch, 2, LENGTH)).astype(np.float32),
    )
    ds["prediction"] = (
        ("batch", "series", "position"),
        rng.random((n_batch, 2, LENGTH)).astype(np.float32),
    )
    return ds.assign_coords(series=["fridge", "kettle"])


@pytest.fixture(scope="module")
def trace():
    return make_trace()


@pytest.fixture(scope="module")
def rendered(trace):
    # every section shown (projection and merge are drawn on demand)
    explorer = AttentionExplorer(trace, show_projection=True, show_merge=True)
    explorer.__panel__().get_root(Document())
    return explorer


@pytest.fixture
def explorer(rendered):
    """The module's rendered explorer, back at its start (rendering one takes seconds)."""
    rendered.reset()
    return rendered


def test_reset_goes_back_to_the_start(rendered):
    start = rendered.param.values()
    rendered.param.update(head="mean", query=7, mask="causal", enabled_heads=[1], colormap="fire")
    rendered.reset()
    assert rendered.param.values() == start
    np.testing.assert_array_equal(
        shown_matrix(rendered), core.attention_values(rendered.trace, rendered.selection)
    )


def test_parameters_follow_the_trace(explorer, trace):
    assert explorer.param.sample.bounds == (0, 1)
    assert explorer.param.query.bounds == (0, LENGTH - 1)
    assert explorer.param.head.objects == list(range(8)) + ["mean"]
    assert explorer.mask == "diagonal"
    assert explorer.enabled_heads == list(range(8))
    assert attnpanel.AttentionExplorer is AttentionExplorer
    with pytest.raises(ValueError, match="at most 1"):
        explorer.sample = 5


def test_initial_params_are_applied(trace):
    explorer = AttentionExplorer(trace, sample=1, head="mean", query=12, mask="causal")
    assert explorer.selection == core.Selection(
        sample=1,
        head="mean",
        query=12,
        mask="causal",
        stage="softmax",
        enabled_heads=tuple(range(8)),
        layer=0,
    )


def test_head_mask_stage_redraw_the_matrix(explorer, trace):
    for change in (
        dict(head=3),
        dict(mask="causal"),
        dict(stage="raw"),
        dict(head="mean"),
        dict(sample=1),
    ):
        explorer.param.update(**change)
        expected = core.attention_values(trace, explorer.selection)
        np.testing.assert_array_equal(shown_matrix(explorer), expected, err_msg=str(change))
    assert explorer.engine.title("matrix") == (
        "sample 1, mean of heads: raw scores q·k (before the mask)"
    )
    bar = handles(explorer, "matrix", "Image", "Attention")["colorbar"]
    assert bar.title == "raw scores q·k (±p99.5 of |value|)"
    assert explorer.last_error == ""


def test_masked_cells_are_nan_under_diagonal_mask(explorer):
    explorer.param.update(mask="diagonal", stage="softmax", head=0)
    image = shown_matrix(explorer)
    assert np.isnan(np.diag(image)).all()
    assert np.isfinite(image[~np.eye(LENGTH, dtype=bool)]).all()
    mapper = handles(explorer, "matrix", "Image", "Attention")["color_mapper"]
    assert mapper.low >= 0 and mapper.high <= 1  # the -1e4 fill never reaches the scale


def test_query_moves_the_markers_and_the_aggregation(explorer, trace):
    explorer.query = 17
    box = handles(explorer, "matrix", "HSpan")["glyph"]
    assert (box.bottom, box.top) == (16.5, 17.5)
    assert box.level == "overlay"
    grid = explorer.sections["heads"].grid
    length = trace.sizes["key"]
    band = handles(explorer, "head maps", "HSpan")["source"].data
    assert len(band["top"]) == trace.sizes["head"]
    for head in range(trace.sizes["head"]):  # every head's tile bands the same row, whole
        keys, queries = grid.to_window(
            (band["left"][head], band["right"][head]), (band["bottom"][head], band["top"][head])
        )
        assert band["left"][head] == grid.origin(head)[0]  # on the head's own tile
        assert keys == pytest.approx((-0.5, length - 0.5))
        assert queries == pytest.approx((16.5, 17.5))
    bars = handles(explorer, "aggregation weights", "Rectangles")["source"].data
    np.testing.assert_allclose(
        bars["top"], trace["weights"].isel(batch=0, head=0, query=17), rtol=1e-7, atol=0
    )
    factors = handles(explorer, "top values", "HeatMap")["y_range"].factors
    best = int(np.argmax(trace["weights"].isel(batch=0, head=0, query=17).values))
    clock = core.clock_labels(trace, 0)[best]  # the key by its time, as the matrix's ticks
    assert factors[-1].startswith(f"{clock}: w ")  # drawn at the top
    span = handles(explorer, "sequence", "VLine")["glyph"]
    assert span.location == pytest.approx(
        trace["time"].values[17].astype("datetime64[ms]").astype(np.int64)
    )


def test_tapping_the_curve_and_the_matrix_select_the_query(explorer, trace):
    explorer.sections["sequence"].click(x=trace["time"].values[23])
    assert explorer.query == 23
    explorer.sections["matrix"].click(x=3.2, y=9.4)
    assert explorer.query == 9


def test_switching_heads_off_recomputes_the_output(explorer, trace):
    explorer.query = 5
    plot = handles(explorer, "output", "Rectangles")["plot"]
    assert "changed 0.0%" in plot.title.text
    toggles = explorer.sections["heads"].toggles
    toggles.value = [h for h in toggles.value if h != 2]
    assert explorer.enabled_heads == [0, 1, 3, 4, 5, 6, 7]
    assert "changed 0.0%" not in plot.title.text
    bars = handles(explorer, "output", "Rectangles")["source"].data
    _, _, expected = core.merged_output(trace, explorer.selection)
    np.testing.assert_allclose(bars["value"], expected, rtol=1e-5)
    palettes = [
        handles(explorer, f"head {h}", "Image", "HeadMap")["color_mapper"].palette for h in (1, 2)
    ]
    assert palettes[0][-1] != "#8a8a8a" and palettes[1][-1] == "#8a8a8a"  # head 2 is grey
    explorer.enabled_heads = list(range(8))
    assert toggles.value == list(range(8))
    assert "changed 0.0%" in plot.title.text


def test_sample_change_moves_the_time_axis(explorer, trace):
    trace_time = trace["time"]
    assert trace_time.ndim == 1  # shared timestamps here: same axis for both samples
    explorer.sample = 1
    curve = handles(explorer, "sequence", "Curve", "Sequence")["source"].data
    np.testing.assert_allclose(curve["signal"], trace["signal"].isel(batch=1))


def test_show_reference_hides_their_curves(explorer):
    found = explorer.engine.plots("sequence")
    reference = [k for k in found if k.group == "Sequence" and k.label != "aggregate power"]
    assert len(reference) == 4  # truth and prediction of each
    explorer.show_reference = False
    assert not any(found[k][0]["glyph_renderer"].visible for k in reference)
    explorer.show_reference = True
    assert all(found[k][0]["glyph_renderer"].visible for k in reference)


def test_a_curve_switched_off_leaves_the_legend_and_the_legend_refits_the_axis(explorer, trace):
    """A reference series switched off is no longer written: its legend entry showed it
    again, the sample it was drawn for over another sample (the demo: sample 0's fridge
    beside sample 3's power). It now leaves the legend with its curve. And a curve hidden or
    shown from the legend (in the browser) refits the value axis: one shown again was drawn
    beyond an axis fitted without it."""
    from attnpanel.render.axes import CHART_PAD, DRAWN_EXTENT, LEGEND_ITEM

    found = explorer.engine.plots("sequence")
    curves = {k.label: found[k][0] for k in found if k.group == "Sequence"}
    reference = [h for label, h in curves.items() if label != "aggregate power"]
    assert all(h[LEGEND_ITEM].visible for h in curves.values())
    explorer.show_reference = False
    assert not any(h[LEGEND_ITEM].visible for h in reference)
    explorer.sample = 1  # the hidden curves keep sample 0: not in the legend to be shown
    assert not any(h[LEGEND_ITEM].visible for h in reference)
    assert curves["aggregate power"][LEGEND_ITEM].visible
    explorer.show_reference = True  # written again, for sample 1, and in the legend again
    assert all(h[LEGEND_ITEM].visible for h in reference)
    truth = trace["truth"].isel(batch=1, series=0).values
    assert any(np.array_equal(h["source"].data["signal"], truth) for h in reference)

    signal = curves["aggregate power"]
    y_range = signal["plot"].y_range  # (the range the server writes, render/axes.py)

    def fitted():  # the rule: the shown layers' extents, 6 % of their span beyond each end
        shown = [
            h[DRAWN_EXTENT][0]
            for handles in found.values()
            for h in handles
            if h.get("glyph_renderer") is not None
            and h["glyph_renderer"].visible
            and h[DRAWN_EXTENT][0] is not None
        ]
        lo, hi = min(e[0] for e in shown), max(e[1] for e in shown)
        start = lo - CHART_PAD * (hi - lo)  # never below 0 for power, which is not
        return pytest.approx((max(start, 0.0) if lo >= 0 else start, hi + CHART_PAD * (hi - lo)))

    with_signal = (y_range.start, y_range.end)
    assert with_signal == fitted()
    signal["glyph_renderer"].visible = False  # the legend's click, from the browser
    assert (y_range.start, y_range.end) == fitted() != with_signal
    signal["glyph_renderer"].visible = True
    assert (y_range.start, y_range.end) == pytest.approx(with_signal)
    # hidden from the legend, a curve stays hidden in the next sample (a push brought it
    # back), in the legend to be shown again, and out of the axis' fit
    signal["glyph_renderer"].visible = False
    explorer.sample = 0
    assert not signal["glyph_renderer"].visible and signal[LEGEND_ITEM].visible
    assert (y_range.start, y_range.end) == fitted()
    explorer.show_reference = False  # the others switched off and on: it stays hidden
    explorer.show_reference = True
    assert not signal["glyph_renderer"].visible
    assert all(h["glyph_renderer"].visible and h[LEGEND_ITEM].visible for h in reference)


def test_player_and_colormap(explorer):
    explorer.widgets["player"].value = 0
    assert explorer.stage == "raw"
    explorer.stage = "masked"
    assert explorer.widgets["player"].value == 2
    explorer.colormap = "viridis"
    palette = handles(explorer, "matrix", "Image", "Attention")["color_mapper"].palette
    assert palette[0].lower().startswith("#44")


def test_side_by_side_shows_the_unmasked_matrix(explorer, trace):
    explorer.param.update(side_by_side=True, head=1, stage="softmax", mask="diagonal")
    unmasked = handles(explorer, "unmasked", "Image", "Attention")["source"].data["image"][0]
    np.testing.assert_array_equal(
        unmasked, core.attention_values(trace, explorer.selection.with_(mask="none"))
    )
    assert np.isfinite(unmasked).all()


def test_shape_table_never_names_a_stale_mask(explorer):
    """The masking step points at the Mask selector instead of naming a mask that a
    switch would leave stale (it kept saying "mask diagonal" after switching to causal)."""

    def masking_step():  # as the page's table shows it
        rows = table_rows(explorer, "shapes")
        return {row["step"]: row["operation"] for row in rows}["masked"]

    own = explorer.trace.attrs["mask"]
    for mask in ("causal", "none", "diagonal"):
        explorer.mask = mask
        assert masking_step() == (
            f"blocked cells filled with −10000 by the model (its own mask: {own}); "
            "other masks recomputed with −10000"
        )


def test_a_failing_view_is_reported_and_the_session_goes_on(explorer, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    view = next(v for v in explorer.engine.views if v.name == "context vector")
    monkeypatch.setattr(view, "build", broken)
    explorer.query = 30
    assert "context vector" in explorer.last_error and "boom" in explorer.last_error
    box = handles(explorer, "matrix", "HSpan")["glyph"]
    assert box.bottom == 29.5  # the other views still updated


def test_a_trace_without_some_variables_names_them(trace):
    weights_only = attnpanel.build_trace(weights=trace["weights"].values, mask="diagonal")
    explorer = AttentionExplorer(weights_only, show_projection=True, show_merge=True)
    layout = explorer.__panel__()
    layout.get_root(Document())
    alerts = [a.object for a in layout.select(pn.pane.Alert)]
    text = " ".join(alerts)
    for name in ("`x`", "`q`", "`k`", "`v`", "`w_q`", "`w_k`", "`w_v`", "`w_o`"):
        assert name in text, (name, alerts)
    assert explorer.param.mask.objects == ["diagonal"]
    explorer.param.update(head=4, query=6)
    assert explorer.last_error == ""
    np.testing.assert_array_equal(
        shown_matrix(explorer), core.attention_values(weights_only, explorer.selection)
    )


def test_importing_attnpanel_does_not_import_panel():
    code = (
        "import sys, attnpanel; assert 'panel' not in sys.modules; "
        "assert 'holoviews' not in sys.modules; attnpanel.AttentionExplorer; "
        "assert 'panel' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def mapper_limits(explorer, pane, group):
    mapper = handles(explorer, pane, "Image", group)["color_mapper"]
    return mapper.low, mapper.high


def test_colour_scales_do_not_depend_on_history(explorer):
    """One rule for every render: the first paint spans what a later one of the same
    selection does (weights from 0 to the 99.5th percentile, scores centred on 0), and the
    colour bar's title says so."""
    first = mapper_limits(explorer, "matrix", "Attention")
    first_head = mapper_limits(explorer, "head 2", "HeadMap")
    drawn = explorer.drawn("matrix")
    assert first[0] == 0.0
    assert first[1] == pytest.approx(np.nanpercentile(drawn, 99.5), rel=1e-5)
    assert first_head[0] == 0.0
    bar = handles(explorer, "matrix", "Image", "Attention")["colorbar"]
    assert bar.title == "softmax weights (0 to p99.5)"
    explorer.param.update(stage="scaled")
    low, high = mapper_limits(explorer, "matrix", "Attention")
    assert low == -high and bar.title == "scaled scores q·k / √E (±p99.5 of |value|)"
    explorer.param.update(stage="softmax")
    assert bar.title == "softmax weights (0 to p99.5)"
    explorer.param.update(head=5, mask="causal")
    explorer.param.update(head=0, mask="diagonal")
    assert mapper_limits(explorer, "matrix", "Attention") == pytest.approx(first)
    assert mapper_limits(explorer, "head 2", "HeadMap") == pytest.approx(first_head)


def test_maps_hover_whole_positions_and_charts_leave_the_wheel_to_the_page(trace):
    from bokeh.models import ColorBar, HoverTool, PrintfTickFormatter, WheelZoomTool
    from bokeh.plotting import figure

    explorer = AttentionExplorer(trace)
    root = explorer.__panel__().get_root(Document())
    figures = {f.title.text: f for f in root.select({"type": figure})}
    matrix = next(f for t, f in figures.items() if t.startswith("sample 0, head 0"))
    hover = next(iter(matrix.select({"type": HoverTool})))
    # with clock times: the position and its time ("17 (06:17)"), ticks read as times
    assert ("key", "$x{custom}") in hover.tooltips and ("query", "$y{custom}") in hover.tooltips
    assert hover.formatters["$x"].args["labels"][17] == "06:17"
    assert matrix.xaxis[0].formatter.args["labels"][:2] == ["06:00", "06:01"]
    untimed = AttentionExplorer(trace.drop_vars("time"))
    untimed_root = untimed.__panel__().get_root(Document())
    untimed_matrix = next(
        f
        for f in untimed_root.select({"type": figure})
        if f.title.text.startswith("sample 0, head 0")
    )
    hover = next(iter(untimed_matrix.select({"type": HoverTool})))
    assert ("key", "$x{0}") in hover.tooltips and ("query", "$y{0}") in hover.tooltips
    colorbar = next(iter(matrix.select({"type": ColorBar})))
    assert isinstance(colorbar.formatter, PrintfTickFormatter)
    assert colorbar.formatter.format == "%.3g"
    bars = next(f for t, f in figures.items() if t.startswith("weights of query"))
    assert not isinstance(bars.toolbar.active_scroll, WheelZoomTool)  # the page scrolls
    assert isinstance(matrix.toolbar.active_scroll, WheelZoomTool)  # maps zoom together


def test_every_view_is_a_dynamic_map_that_follows_the_state(trace):
    """A notebook user composes the page's views with their own HoloViews objects."""
    import holoviews as hv

    explorer = AttentionExplorer(trace)
    matrix = explorer.dynamic_map("attention matrix")
    context = explorer.dynamic_map("context vector")
    assert isinstance(matrix, hv.DynamicMap) and isinstance(context, hv.DynamicMap)
    for change in (dict(), dict(head=3, mask="causal"), dict(stage="scaled", sample=1)):
        explorer.param.update(**change)
        image = matrix[()]  # rasterized by datashader (no more cells than pixels: the cells)
        np.testing.assert_array_equal(
            image.dimension_values(2, flat=False),
            core.attention_values(trace, explorer.selection),
            err_msg=str(change),
        )
    bars = context[()]
    expected = views.context_vector(trace, explorer.selection)
    np.testing.assert_array_equal(
        bars.dimension_values("value"), expected.dimension_values("value")
    )
    overlay = matrix * hv.HLine(5)  # composes like any HoloViews object
    from bokeh.plotting import figure

    assert isinstance(hv.render(overlay), figure)
    with pytest.raises(KeyError, match="no view named 'nope'; the views are: .*attention matrix"):
        explorer.dynamic_map("nope")


def test_the_power_curve_shows_the_query_weights_and_the_predictions(explorer, trace):
    from attnpanel.render.styling import shade

    explorer.param.update(query=17, head=2, sample=1)
    band = handles(explorer, "sequence", "Rectangles", "QueryWeights")
    weights = trace["weights"].isel(batch=1, head=2, query=17).values  # the model's own
    assert list(band["source"].data["color"]) == shade(weights)
    time = trace["time"].values
    left = band["source"].data["left"]
    assert left[1] == time[0] + (time[1] - time[0]) / 2  # one band per key, between steps
    explorer.param.update(head="mean", mask="causal")
    recomputed = core.attention_values(trace, explorer.selection)[17]
    assert list(band["source"].data["color"]) == shade(np.nan_to_num(recomputed))
    (legend,) = band["plot"].select({"type": Legend})
    (item,) = [i for i in legend.items if i.label.value == "selected query's weights"]
    swatch, drawn = item.renderers  # a dark-red swatch (the band's first row may be white)
    assert drawn is band["glyph_renderer"] and swatch.glyph.fill_color == shade([1.0])[0]
    box = swatch.data_source.data  # one row, of no area: nothing on the plot
    assert list(box["left"]) == list(box["right"]) and list(box["top"]) == list(box["bottom"])
    curves = explorer.engine.plots("sequence")
    predicted = [k for k in curves if k.label.endswith("(predicted)")]
    assert [k.label for k in predicted] == ["fridge (predicted)", "kettle (predicted)"]
    glyph = curves[predicted[0]][0]["glyph"]
    assert glyph.line_dash == [6]  # Bokeh's "dashed"
    fridge = curves[next(k for k in curves if k.label == "fridge")][0]["glyph"]
    assert glyph.line_color == fridge.line_color  # the same colour as its truth
    data = curves[predicted[1]][0]["source"].data
    np.testing.assert_array_equal(
        data["signal"], trace["prediction"].isel(batch=1, series=1).values
    )


def test_head_summary_table_follows_sample_and_mask(explorer, trace):
    from attnpanel.readouts.core import head_patterns

    for change in (dict(), dict(sample=1, mask="causal")):
        explorer.param.update(**change)
        weights = core.stage_heads(trace, explorer.selection.with_(stage="softmax"))
        expected = head_patterns(np.nan_to_num(weights))
        rows = table_rows(explorer, "head summary")  # as the page shows it
        distance = [float(row["distance (steps)"]) for row in rows]
        np.testing.assert_allclose(distance, np.round(expected["distance"], 1))
        np.testing.assert_array_equal([int(row["top lag"]) for row in rows], expected["lag"])
        assert [row["head"] for row in rows] == [f"head {h}" for h in range(8)]
        assert rows[0]["distance (time)"].endswith(("min", "s"))  # one-minute steps: a time


def test_positional_encoding_is_drawn_when_first_shown(explorer):
    layout = explorer.sections["positional"].__panel__()
    assert not layout.visible and layout.select(pn.pane.HoloViews) == []
    explorer.show_positional = True
    assert layout.visible and len(layout.select(pn.pane.HoloViews)) == 1
    notes = [pane.object for pane in layout.select(pn.pane.Markdown)]
    assert any("declares no positional encoding" in note for note in notes)


def test_the_guided_walk_steps_through_one_query(explorer, trace):
    from attnpanel.app.sections.walk import STEP_STAGES

    walk = explorer.sections["walk"]
    assert walk.text.object == ""
    explorer.param.update(query=12, head=3)
    scaled = core.stage_heads(trace, explorer.selection.with_(stage="scaled"))[3, 12]
    for step in range(1, 8):
        explorer.step = step
        assert explorer.stage == STEP_STAGES[step - 1]
        assert walk.text.object.startswith(f"**{step} ·")
        assert explorer.last_error == ""
        if step == 2:  # the trace's own scale and the row's own peak
            assert f"{trace.attrs['scale']:.4g}" in walk.text.object
            assert f"peaks at {np.nanmax(scaled):.3g}" in walk.text.object
        if step == 3:  # the diagonal mask blocks one key of the row
            assert (
                "attend to itself" in walk.text.object
                and "(1 of the row's 40 keys" in walk.text.object
            )
        if step == 4:
            weights = trace["weights"].isel(batch=0, head=3, query=12).values
            assert f"Key {int(np.argmax(weights))} takes {weights.max():.3f}" in walk.text.object
        if step in (4, 5):  # names the section it points to: it is right of or below the matrix
            assert "*value aggregation*" in walk.text.object
            assert "on the right" not in walk.text.object
        if step == 6:
            assert "features 36-47" in walk.text.object
    explorer.query = 13  # the text follows the selection
    assert "query 13" in walk.text.object
    explorer.step = 0
    assert walk.text.object == ""


def test_the_walk_steers_only_while_walking_and_closes_what_it_opened(trace):
    explorer = AttentionExplorer(trace)
    explorer.__panel__().get_root(Document())
    walk = explorer.sections["walk"]
    assert [b.visible for b in walk.steering] == [False, False, False]
    assert not explorer.show_projection and not explorer.show_merge
    explorer.step = 1
    assert [b.visible for b in walk.steering] == [True, True, True]
    assert explorer.show_projection  # step 1 talks about the projections: opened
    explorer.step = 7
    assert explorer.show_merge
    explorer.step = 0
    assert [b.visible for b in walk.steering] == [False, False, False]
    assert not explorer.show_projection and not explorer.show_merge  # closed with the walk
    explorer.show_merge = True  # opened by the user: the walk leaves it open
    explorer.step = 6
    explorer.step = 0
    assert explorer.show_merge


def test_the_busy_indicator_waits_for_changes_expected_to_be_slow(trace):
    """Only a change whose redraw is expected to take over BUSY_AFTER_S shows the busy
    indicator first; the expectation scales with the sample's attention cells and learns
    from the uncached changes the engine drew."""
    from attnpanel.app import scheduler

    state = AttentionExplorer(trace.copy())  # a cache of its own: nothing drawn yet
    state.__panel__().get_root(Document())
    cost = state.engine.scheduler.cost
    cells = trace.sizes["head"] * trace.sizes["query"] * trace.sizes["key"]
    assert cost.expected_seconds() == pytest.approx(cells * scheduler.SECONDS_PER_CELL)
    # the demo (8 x 480 x 480) redraws in about 0.1 s: no indicator
    assert 8 * 480 * 480 * scheduler.SECONDS_PER_CELL < scheduler.BUSY_AFTER_S
    # 8 heads at L = 2,048: seconds, so the indicator goes out first
    assert 8 * 2048 * 2048 * scheduler.SECONDS_PER_CELL > scheduler.BUSY_AFTER_S
    cost.seconds_per_cell = 1.0
    assert cost.expected_seconds() == cells
    cost.seconds_per_cell = scheduler.SECONDS_PER_CELL
    state.sample = 1  # not drawn yet: its redraw time is learnt
    assert cost.seconds_per_cell != scheduler.SECONDS_PER_CELL
    learnt = cost.seconds_per_cell
    state.sample = 0  # cached: nothing learnt
    assert cost.seconds_per_cell == learnt


def test_the_short_q_k_v_bar_charts_keep_their_value_labels_apart(explorer):
    """112 px tall: about 3 value ticks (eight ran into one black blob); taller charts keep
    Bokeh's default."""
    for pane in ("Q vector", "K vector", "V vector"):
        (handles, *_) = next(iter(explorer.engine.plots(pane).values()))
        assert handles["yaxis"].ticker.desired_num_ticks == 3
    (handles, *_) = next(iter(explorer.engine.plots("sequence").values()))
    assert handles["yaxis"].ticker.desired_num_ticks != 3


def test_the_maps_hover_names_the_stage_shown_and_a_blocked_cell_in_words(explorer):
    """The matrix's hover names the value the map holds now (a raw score is not "softmax
    weights", also when the page opens on another stage), and a cell the mask blocks
    (drawn blank, NaN in the image) reads "blocked by the mask", not NaN."""
    for stage in ("raw", "scaled", "masked", "softmax", "value_weighted", "raw"):
        with explorer.engine.drawing_now():
            explorer.param.update(stage=stage, mask="causal", head=1)
        matrix = handles(explorer, "matrix", "Image", "Attention")
        name, field = matrix["hover"].tooltips[-1]
        assert name == core.STAGE_LABELS[stage], stage
        assert field == "$image_index{custom}"  # its cell: BokehJS shows a NaN value as "NaN"
    formatter = matrix["hover"].formatters["$image_index"]
    assert formatter.args["blank"] == "blocked by the mask: weight 0 after the softmax"
    assert "blank" in formatter.code and "toFixed(4)" in formatter.code
    with explorer.engine.drawing_now():
        explorer.param.update(stage="softmax")
    image = shown_matrix(explorer)
    assert np.isnan(image[0, 1:]).all()  # causal: query 0 sees key 0 only; the rest blank
    opened = AttentionExplorer(make_trace(), stage="raw")
    opened.__panel__().get_root(Document())
    first = handles(opened, "matrix", "Image", "Attention")
    assert first["hover"].tooltips[-1][0] == core.STAGE_LABELS["raw"]


def test_a_links_refused_value_is_named_and_the_others_hold():
    """Panel's ``Location.sync`` applies a link's values together and drops them all,
    silently, when one is refused: ``?sample=1&stage=bogus`` opened on sample 0. Each value
    is now applied alone; the refused ones are named (the state's ``last_error``)."""
    from attnpanel.app.url import apply_each

    explorer = AttentionExplorer(make_trace(n_batch=3))
    told = []
    mapped = {"sample": 1, "stage": "bogus", "query": "abc", "head": 9, "mask": "causal"}
    apply_each(explorer, mapped, AttentionExplorer.URL_PARAMS, later=lambda *a: told.append(a))
    assert (explorer.sample, explorer.mask, explorer.stage) == (1, "causal", "softmax")
    assert explorer.query == 0 and explorer.head == 0
    (callback, state, error, where) = told[0]
    callback(state, error, where)  # report: the state's last_error, a log line
    assert explorer.last_error == (
        "reading the link failed: stage=bogus: not one of raw, scaled, masked, softmax, "
        "value_weighted; query=abc: not a whole number; head=9: not one of 0, 1, 2, 3, 4, 5, "
        "6, 7, mean"
    )
    told.clear()
    apply_each(explorer, {"sample": 2}, AttentionExplorer.URL_PARAMS, later=told.append)
    assert explorer.sample == 2 and told == []  # nothing refused: nothing said


def test_a_links_refused_value_leaves_the_url_and_is_named_once():
    """The URL kept ``?sample=99`` over a page of sample 0 (a copied link reopened on the
    refusal), and the browser, handing the link over again as it connected, had the
    refusal named twice. The URL now gives the state's own value, and a refusal is named
    once."""
    from panel.io.location import Location

    from attnpanel.app.url import apply_each

    explorer = AttentionExplorer(make_trace(n_batch=3), head=1)
    location = Location(search="?sample=99&head=3&stage=raw")
    said, told = set(), []

    def later(callback, *args):
        told.append(callback.__name__)
        callback(*args)

    mapped = {"sample": 99, "head": 3, "stage": "raw"}
    for _ in range(2):  # as the session is made, then as the browser connects
        apply_each(explorer, mapped, AttentionExplorer.URL_PARAMS, later, location, said)
    assert (explorer.sample, explorer.head, explorer.stage) == (0, 3, "raw")
    assert location.query_params == {"sample": 0, "head": 3, "stage": "raw"}
    assert told == ["show_in_url", "report", "show_in_url"]  # named once, shown each time
    assert explorer.last_error == "reading the link failed: sample=99: outside 0 to 2"


@pytest.mark.parametrize(
    ("source", "title"),
    [
        ("a short source\nits second line", "a short source"),
        # the long demo's own (107 characters): whole, not cut in a word
        (
            "NILMFormer demo (nilmformer.pt), layer encoder.2.attention of 3 encoder layers, "
            "1 held-out day at one minute",
            "NILMFormer demo (nilmformer.pt), layer encoder.2.attention of 3 encoder layers, "
            "1 held-out day at one minute",
        ),
        ("word " * 60, ("word " * 32).strip() + " …"),  # cut after a whole word
        ("", "trace"),
        # a module's repr (attnpanel.trace's source): its name, not "MultiHeadSelfAttention("
        ("MultiHeadSelfAttention(\n  (wq): Linear(...)\n)", "MultiHeadSelfAttention"),
    ],
)
def test_the_heading_is_the_sources_first_line_cut_only_after_a_whole_word(trace, source, title):
    explorer = AttentionExplorer(trace.assign_attrs(source=source))
    assert explorer.title == title
    assert len(explorer.title) <= 162


def counted_builds(explorer, monkeypatch) -> list[str]:
    """The names of the views built from now (each view's build wrapped)."""
    built: list[str] = []
    for view in explorer.engine.views:

        def build(sel, view=view, inner=view.build):
            built.append(view.name)
            return inner(sel)

        monkeypatch.setattr(view, "build", build)
    return built


def test_the_next_sample_is_drawn_from_views_built_while_the_page_was_idle(
    explorer, trace, monkeypatch
):
    """A served page builds the next sample's views while idle (attnpanel.app.neighbours):
    the step to it builds none, and draws that sample."""
    explorer.engine.finish_idle()  # what a served page does while idle
    built = counted_builds(explorer, monkeypatch)
    explorer.sample = 1
    assert built == []
    assert explorer.engine.title("matrix").startswith("sample 1, ")
    curve = handles(explorer, "sequence", "Curve", "Sequence")["source"].data
    np.testing.assert_allclose(curve["signal"], trace["signal"].isel(batch=1))
    np.testing.assert_allclose(
        shown_matrix(explorer),
        core.attention_values(trace, explorer.selection, explorer.cache)[:LENGTH, :LENGTH],
        rtol=1e-5,
    )


def test_views_built_ahead_are_forgotten_when_what_they_read_changes(explorer, monkeypatch):
    """An element built ahead reads more than the selection (the reference series shown):
    a change of that drops it, and the step to the next sample builds its views anew."""
    from attnpanel.render.axes import LEGEND_ITEM

    explorer.engine.finish_idle()
    explorer.show_reference = False
    built = counted_builds(explorer, monkeypatch)
    explorer.sample = 1
    assert "sequence view" in built
    found = explorer.engine.plots("sequence")
    reference = [
        found[k][0] for k in found if k.group == "Sequence" and k.label != "aggregate power"
    ]
    assert reference and not any(h[LEGEND_ITEM].visible for h in reference)


def test_every_control_of_the_page_is_in_its_link(explorer):
    """What a person can change on the page round-trips through its URL (the heads switched
    off as ``off=``): the layer, the colour map and the section switches were not in it."""
    linked = set(AttentionExplorer.URL_PARAMS) | {"enabled_heads"}
    driven = {name for name in explorer.widgets if name in explorer.param}  # (player: stage)
    assert {"colormap", "side_by_side", "show_reference"} <= driven
    assert driven <= linked, driven - linked


def test_a_query_change_rebuilds_ahead_only_the_views_that_read_the_query(explorer, monkeypatch):
    """The next sample's views built while idle are kept across a change they do not read:
    after another query, only the views that read it are built again."""
    explorer.engine.finish_idle()
    built = counted_builds(explorer, monkeypatch)
    explorer.query = 7
    built.clear()  # the change's own redraw of the shown sample
    explorer.engine.finish_idle()
    reads = {v.name for v in explorer.engine.views if "query" in v.parameters}
    assert built and set(built) <= reads, set(built) - reads
    built.clear()
    explorer.sample = 1
    assert built == []


def test_a_clicked_key_belongs_to_the_query_clicked_with_it(trace):
    """A click picks a query and a key together; the query moved by other means (the
    slider) goes back to the key it attends most, and a link keeps both."""
    explorer = AttentionExplorer(trace, query=5, why_key=7)
    assert (explorer.query, explorer.why_key) == (5, 7)
    explorer.param.update(query=10, why_key=20)  # a click on the matrix
    explorer.why_key = 25  # a click on the same row
    assert (explorer.query, explorer.why_key) == (10, 25)
    explorer.query = 11  # the slider
    assert explorer.why_key == -1

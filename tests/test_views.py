"""The views: pure functions (trace, selection) -> HoloViews element, checked on their data."""

from __future__ import annotations

import holoviews as hv
import numerics
import numpy as np
import pytest
import torch

import attnpanel
from attnpanel.readouts import core, raster
from attnpanel.readouts.core import MissingVariable, Selection, StageCache
from attnpanel.render import palette, styling, views

LENGTH = 32


@pytest.fixture(scope="module")
def trace():
    torch.manual_seed(0)
    layer = attnpanel.MultiHeadSelfAttention(d_model=96, n_heads=8, mask="diagonal")
    time = np.datetime64("2025-06-02T06:00") + np.arange(LENGTH) * np.timedelta64(1, "m")
    ds = attnpanel.trace(layer, torch.randn(3, LENGTH, 96), time=time.astype("datetime64[ns]"))
    ds["signal"] = (("batch", "position"), np.random.default_rng(0).random((3, LENGTH)))
    ds["signal"].attrs.update(long_name="aggregate power", units="W")
    return ds


@pytest.fixture(scope="module")
def weights_only(trace):
    return attnpanel.build_trace(weights=trace["weights"].values, mask="diagonal")


def test_attention_values_softmax_matches_trace_and_blanks_masked_cells(trace):
    sel = Selection(sample=1, head=2, mask="diagonal", stage="softmax")
    values = core.attention_values(trace, sel)
    expected = trace["weights"].isel(batch=1, head=2).values
    assert values.dtype == np.float32
    assert np.isnan(np.diag(values)).all()
    off = ~np.eye(LENGTH, dtype=bool)
    numerics.assert_same_numbers(values[off], expected[off])  # the trace's own weights


def test_masked_stage_uses_nan_not_fill_so_colours_keep_their_range(trace):
    values = core.attention_values(trace, Selection(stage="masked", mask="causal"))
    blocked = np.triu(np.ones((LENGTH, LENGTH), dtype=bool), 1)
    assert np.isnan(values[blocked]).all()
    assert np.isfinite(values[~blocked]).all()
    assert np.nanmin(values) > -1e3  # the -1e4 fill is not in the colour range


def test_raw_and_scaled_stages_are_q_dot_k(trace):
    raw = core.attention_values(trace, Selection(sample=0, head=1, stage="raw"))
    scaled = core.attention_values(trace, Selection(sample=0, head=1, stage="scaled"))
    np.testing.assert_allclose(
        raw, trace["scores"].isel(batch=0, head=1).values, rtol=1e-5, atol=1e-5
    )
    numerics.assert_products_agree(scaled, raw * trace.attrs["scale"], terms=12)  # q . k, E = 12


def test_mean_of_heads_averages_only_enabled_heads(trace):
    sel = Selection(head="mean", mask="none", enabled_heads=(0, 3))
    values = core.attention_values(trace, sel)
    per_head = core.stage_heads(trace, sel)
    np.testing.assert_allclose(values, per_head[[0, 3]].mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(values.sum(axis=1), 1.0, rtol=1e-5)


def test_cache_reuses_results_and_stays_bounded(trace):
    cache = StageCache(max_bytes=3 * 8 * LENGTH * LENGTH * 4)
    sel = Selection(mask="causal")
    first = core.stage_heads(trace, sel, cache)
    assert core.stage_heads(trace, sel, cache) is first
    for mask in ("none", "diagonal"):
        for stage in ("raw", "softmax"):
            core.stage_heads(trace, sel.with_(mask=mask, stage=stage), cache)
    assert cache.nbytes <= cache.max_bytes
    # keys: (kind, layer, sample, mask, stage); the oldest went, the newest stayed
    assert ("stage", 0, 0, "causal", "softmax") not in cache
    assert ("stage", 0, 0, "none", "raw") not in cache
    assert ("stage", 0, 0, "diagonal", "softmax") in cache


def test_attention_matrix_orientation_and_rasterized_keeps_full_resolution(trace):
    sel = Selection(head=0, mask="causal", stage="softmax")
    image = views.attention_matrix(trace, sel)
    assert isinstance(image, hv.Image)
    assert image.kdims == ["key", "query"]
    # query 0 attends only to key 0 under causal masking
    assert image[0, 0] == pytest.approx(1.0)
    assert np.isnan(image[5, 0])
    raster = views.rasterized(image, 500, 500)
    assert raster.dimension_values(2, flat=False).shape == (LENGTH, LENGTH)
    np.testing.assert_array_equal(
        np.isnan(raster.dimension_values(2, flat=False)),
        np.isnan(image.dimension_values(2, flat=False)),
    )
    small = views.rasterized(image, 8, 8)
    assert small.dimension_values(2, flat=False).shape == (8, 8)


def test_query_and_position_markers(trace):
    sel = Selection(sample=2, query=7)
    assert list(views.query_marker(trace, sel).data) == [6.5, 7.5]
    assert views.position_marker(trace, sel).data == trace["time"].values[7]
    assert views.position_from_x(trace, sel, trace["time"].values[7]) == 7
    ms = trace["time"].values[9].astype("datetime64[ms]").astype(np.int64)
    assert views.position_from_x(trace, sel, float(ms)) == 9


def test_sequence_curve_shows_the_input_signal(trace):
    overlay = views.sequence_curve(trace, Selection(sample=1))
    curve = overlay.get(0)
    np.testing.assert_allclose(
        curve.dimension_values("signal"), trace["signal"].isel(batch=1).values
    )
    assert curve.label == "aggregate power" and curve.vdims[0].unit == "W"
    assert curve.kdims[0].name == "time"


def test_reference_series_that_name_nothing_share_the_signals_quantity(trace):
    """Unnamed reference series in no units of their own are drawn on the signal's
    quantity ("power", not "aggregate power, reference series", which a 143 px axis cut);
    in units of their own, the axis names both."""
    sel = Selection(sample=0)
    rng = np.random.default_rng(1)
    truth = (("batch", "series", "position"), rng.random((3, 2, LENGTH)))
    both = trace.assign(truth=truth).assign_coords(series=["fridge", "kettle"])
    assert core.sequence_series(both, sel).ylabel == "power"
    assert core.sequence_series(both, sel, show_reference=False).ylabel == "aggregate power"
    other = both.assign(truth=both["truth"].assign_attrs(units="kW"))
    label = core.sequence_series(other, sel).ylabel
    assert label == "aggregate power, reference series (kW)"


def test_input_and_projection_vectors_split_into_head_lanes(trace):
    sel = Selection(sample=1, query=5)
    bars = views.input_vector(trace, sel)
    np.testing.assert_allclose(
        bars.dimension_values("value"), trace["x"].isel(batch=1, position=5).values, rtol=1e-6
    )
    q = views.projection_vector(trace, sel, "q")
    rects = q.get(0)
    assert list(np.unique(rects.dimension_values("head"))) == list(range(8))
    # Q, K and V in hue families of their own (dark and light shades alternating by head)
    families = {
        name: set(views.projection_vector(trace, sel, name).get(0).dimension_values("color"))
        for name in ("q", "k", "v")
    }
    assert all(len(colors) == 2 for colors in families.values())
    assert not (families["q"] & families["k"] or families["k"] & families["v"])
    assert not families["q"] & families["v"]
    heads = rects.dimension_values("head")
    colors = rects.dimension_values("color")
    assert colors[heads == 0][0] != colors[heads == 1][0]  # neighbouring heads differ
    np.testing.assert_allclose(
        rects.dimension_values("value"),
        trace["q"].isel(batch=1, position=5).values.reshape(-1),
        rtol=1e-6,
    )
    lanes = q.get(1)
    assert isinstance(lanes, hv.VSpans)


def test_weight_heatmap(trace):
    image = views.weight_heatmap(trace, "w_q")
    assert image.dimension_values(2, flat=False).shape == (96, 96)
    assert image.label.startswith("Wq")


def test_value_aggregation_is_the_trace_context(trace):
    sel = Selection(sample=2, head=4, query=11)
    weights = views.aggregation_weights(trace, sel).get(0).dimension_values("value")
    numerics.assert_same_numbers(weights, trace["weights"].isel(batch=2, head=4, query=11))
    context = views.context_vector(trace, sel).dimension_values("value")
    expected = trace["context"].isel(batch=2, head=4, query=11)
    numerics.assert_products_agree(context, expected, terms=trace.sizes["key"])  # weights @ v
    top = views.top_values(trace, sel)
    assert len(set(top.dimension_values("key"))) == views.TOP_VALUES
    best = int(np.argmax(weights))
    # a key by its clock time (the matrix's own labels) and its position
    clock = core.clock_labels(trace, 2)
    first_label = top.dimension_values("key")[0].lstrip(views.FIGURE_SPACE)
    assert first_label.startswith(f"{clock[best]}: w ")  # every time once: no position
    first = views.top_values(trace, Selection(sample=2, head=4, query=1, mask="causal"))
    keys = list(dict.fromkeys(first.dimension_values("key")))  # 2 keys allowed, 0 and 1
    named = sorted(key.split(": w")[0].lstrip(views.FIGURE_SPACE) for key in keys)
    assert named == [clock[0], clock[1]]
    # every key's label at one width (right-aligned in figure spaces where they differ)
    assert {len(key) for key in [*keys, *top.dimension_values("key")]} == {len(clock[0]) + 9}
    assert first.label == "value vectors, top 2 keys"


def test_top_keys_of_text_are_named_by_their_tokens():
    """A text's top keys say their token and position (a token may repeat): never a bare
    position number where the positions are tokens."""
    torch.manual_seed(0)
    layer = attnpanel.MultiHeadSelfAttention(d_model=16, n_heads=2, mask="none")
    words = ["the", "cat", "sat", "on", "the", "mat"]
    text = attnpanel.trace(layer, torch.randn(1, 6, 16), tokens=[words])
    sel = Selection(sample=0, head=1, query=2)
    weights = views.aggregation_weights(text, sel).get(0).dimension_values("value")
    labels = list(dict.fromkeys(views.top_values(text, sel).dimension_values("key")))
    best = int(np.argmax(weights))
    assert labels[0].strip(views.FIGURE_SPACE).startswith(f"{words[best]} ({best}): w ")
    once = ["a", "cat", "sat", "on", "the", "mat"]  # no token twice: no positions
    unique = attnpanel.trace(layer, torch.randn(1, 6, 16), tokens=[once])
    assert views.key_names(unique, 0, 6) == once
    assert len(labels) == views.TOP_VALUES  # "the (0)" and "the (4)" stay two keys
    assert {len(label) for label in labels} == {len("the (0)") + 9}


def test_merged_output_matches_trace_and_changes_without_a_head(trace):
    sel = Selection(sample=1, query=3)
    merged, output_all, output_enabled = core.merged_output(trace, sel)
    np.testing.assert_allclose(
        output_all, trace["output"].isel(batch=1, position=3).values, rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(output_enabled, output_all)
    assert core.output_change_ratio(trace, sel) == 0.0
    off = sel.with_(enabled_heads=(0, 1, 2, 4, 5, 6, 7))
    merged_off, _, output_off = core.merged_output(trace, off)
    assert np.all(merged_off[36:48] == 0)
    assert core.output_change_ratio(trace, off) > 0.01
    title = views.output_change(trace, off).label
    assert "changed" in title and "changed 0.0%" not in title


def test_context_recomputed_for_another_mask(trace):
    sel = Selection(sample=0, query=4, mask="none")
    contexts = core.head_contexts(trace, sel)
    weights = attnpanel.recompute_weights(trace, "none", batch=0).isel(query=4).values
    expected = np.einsum("hs,hse->he", weights, trace["v"].isel(batch=0).values)
    numerics.assert_products_agree(contexts, expected, terms=trace.sizes["key"])


def test_head_map_and_palette(trace):
    image = views.head_map(trace, Selection(), 3)
    assert image.group == "HeadMap"
    colors = styling.head_cmap(3)
    assert len(colors) == 256 and colors[0] == "#ffffff"
    assert colors[-1] == palette.HEAD_COLORS[3]
    assert styling.head_cmap(3, enabled=False)[-1] == "#8a8a8a"


def test_shape_table_lists_every_step_with_real_shapes(trace):
    table = views.shape_view(trace)
    steps = list(table.dimension_values("step"))
    assert steps == [
        "positions",
        "input",
        "projections",
        "split",
        "scores",
        "scaled",
        "masked",
        "weights",
        "context",
        "merged",
        "output",
    ]
    shapes = dict(zip(steps, table.dimension_values("shape"), strict=True))
    assert shapes["positions"] == f"(position={LENGTH})"
    assert shapes["weights"] == f"(batch=3, head=8, query={LENGTH}, key={LENGTH})"
    assert shapes["split"] == f"(batch=3, head=8, position={LENGTH}, head_dim=12)"
    assert shapes["merged"] == f"(batch=3, position={LENGTH}, feature=96)"


def test_views_name_the_missing_variable(weights_only):
    sel = Selection()
    for view in (
        views.input_vector,
        lambda ds, s: views.projection_vector(ds, s, "q"),
        views.context_vector,
        core.merged_output,
    ):
        with pytest.raises(MissingVariable) as err:
            view(weights_only, sel)
        assert "`" in err.value.message
    with pytest.raises(MissingVariable, match="`x`"):
        views.input_vector(weights_only, sel)
    with pytest.raises(MissingVariable, match="`w_q`"):
        views.weight_heatmap(weights_only, "w_q")
    with pytest.raises(MissingVariable, match="`q`"):
        core.attention_values(weights_only, sel.with_(stage="raw"))
    # the trace's own weights still show
    values = core.attention_values(weights_only, sel)
    assert np.isnan(np.diag(values)).all()
    assert "not in trace" in " ".join(views.shape_view(weights_only).dimension_values("shape"))


def test_layer_names_in_titles_tell_groups_apart():
    # a layer is named by its module name everywhere: across groups (encoder layer 0,
    # decoder layer 0, cross-attention layer 0) the names differ, so the kind stays
    names = [
        "encoder.layers.0.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.0.multihead_attn",
    ]
    assert [core.layer_label(name) for name in names] == names
    assert core.layer_label("encoder.layer.3.attention.self") == "encoder.layer.3.attention.self"


def test_signed_maps_are_centred_on_zero_and_weights_start_at_zero():
    scores = np.linspace(-2.0, 6.0, 400, dtype=np.float32).reshape(20, 20)
    low, high = raster.image_limits(scores)
    assert low == -high and high == pytest.approx(np.percentile(np.abs(scores), 99.5))
    assert raster.scale_title("scaled scores", low) == "scaled scores (±p99.5 of |value|)"
    weights = np.linspace(0.01, 0.2, 400, dtype=np.float32).reshape(20, 20)
    low, high = raster.image_limits(weights)
    assert low == 0.0 and high == pytest.approx(np.percentile(weights, 99.5))
    assert raster.scale_title("softmax weights", low) == "softmax weights (0 to p99.5)"
    masked = np.where(np.eye(20, dtype=bool), np.nan, weights)  # NaN cells do not count
    assert raster.image_limits(masked)[1] == pytest.approx(np.nanpercentile(masked, 99.5))
    assert raster.image_limits(np.full((3, 3), np.nan)) == (0.0, 1.0)


def test_every_head_of_a_large_model_has_its_own_colour():
    colours = [palette.head_color(head) for head in range(64)]
    assert len(set(colours)) == 64  # MiniLM's 12 heads no longer reuse 8 colours
    assert colours[:8] == list(palette.HEAD_COLORS)


def test_model_view_maps_read_like_the_matrix_query_0_on_top():
    """Each small map of the model view has query 0 at the top of its layer's band (the
    plot inverts y, as for the large matrix); it was drawn upside down."""
    from test_capture import TwoLayers

    from attnpanel.render import model_views

    ds = attnpanel.capture(TwoLayers().eval(), torch.randn(1, 9, 16))
    sel = Selection(sample=0, head=0, query=0, mask="diagonal", stage="softmax")
    image = model_views.model_view(ds, sel, width=4000, height=4000)
    weights = ds["weights"].isel(batch=0).values  # (layer, head, query, key)
    length = weights.shape[2]
    pad = max(1, round(0.12 * length))
    for layer in (0, 1):
        for query in range(length):
            y = layer - 0.5 + (pad // 2 + query + 0.5) / (length + pad)  # inverted: grows down
            x = -0.5 + (pad // 2 + 1 + 0.5) / (length + pad)  # head 0, key 1
            assert float(image[x, y]) == pytest.approx(float(weights[layer, 0, query, 1]))
    style = next(o for o in styling.options() if o.key == "Image.ModelView")
    assert style.kwargs["invert_yaxis"] is True  # layer 0 and each query 0 at the top


def test_clock_labels_name_each_position_by_its_time():
    import xarray as xr

    from attnpanel.readouts.core import clock_labels

    def labels(start, step, n):
        time = np.datetime64(start) + np.arange(n) * np.timedelta64(*step)
        return clock_labels(xr.Dataset(coords={"time": ("position", time)}))

    assert labels("2025-06-02T06:00", (1, "m"), 3) == ["06:00", "06:01", "06:02"]
    assert labels("2025-06-02T23:59", (1, "m"), 2) == ["06-02 23:59", "06-03 00:00"]
    assert labels("2025-06-02T06:00", (10, "s"), 2) == ["06:00:00", "06:00:10"]
    assert clock_labels(xr.Dataset(coords={"position": np.arange(3)})) is None


def test_head_patterns_match_a_direct_computation():
    from attnpanel.readouts.core import head_patterns

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 7, 7)) * 3
    logits[:, np.eye(7, dtype=bool)] = -np.inf  # a diagonal mask: zeros on the diagonal
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    stats = head_patterns(weights.astype(np.float32))
    q, k = np.meshgrid(np.arange(7), np.arange(7), indexing="ij")
    for h in range(3):
        w = weights[h]
        np.testing.assert_allclose(stats["distance"][h], (w * abs(q - k)).sum(1).mean(), rtol=1e-5)
        offsets = w.argmax(1) - np.arange(7)
        values, counts = np.unique(offsets, return_counts=True)
        assert stats["lag"][h] == values[counts.argmax()] != 0  # never the masked diagonal
        assert stats["lag_share"][h] == counts.max() / 7
        entropy = -(w * np.log(np.where(w > 0, w, 1))).sum(1).mean() / np.log(7)
        np.testing.assert_allclose(stats["entropy"][h], entropy, rtol=1e-5)
    uniform = head_patterns(np.full((1, 4, 4), 0.25, dtype=np.float32))
    np.testing.assert_allclose(uniform["entropy"], [1.0], rtol=1e-6)


def test_webgl_only_for_curves_of_over_5000_points():
    from attnpanel.render.figures import WEBGL_MIN_POINTS, draw

    long_curve = hv.Curve((np.arange(WEBGL_MIN_POINTS + 1), np.zeros(WEBGL_MIN_POINTS + 1)))
    short_curve = hv.Curve((np.arange(480), np.zeros(480)))
    image = hv.Image(np.zeros((480, 480), dtype=np.float32), group="Attention")
    assert draw(long_curve)[0].output_backend == "webgl"
    assert draw(short_curve)[0].output_backend == "canvas"
    assert draw(image)[0].output_backend == "canvas"  # one drawImage on a 2D canvas

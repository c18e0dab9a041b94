"""Attention a model never forms: linear attention captured as its implicit weights.

Each layer here is written as people write it (tests/linear_models.py); the long way in
each test is computed from the layer's own modules and functions, never from the trace.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from bokeh.document import Document
from drawn import shown_matrix
from linear_models import (
    Energformer,
    KernelAttention,
    MatmulLinearAttention,
    PerformerAttention,
)
from torch import nn

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.sections.controls import stage_names
from attnpanel.kernels.attention import attend
from attnpanel.readouts import core, summary
from attnpanel.traces.stages import attention_stage

WIDTH, HEADS, LENGTH = 32, 4, 24


class Holding(nn.Module):
    """A model around one attention layer (its layer is named ``attention``)."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, x):
        return self.attention(x)


def long_way(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi(q), phi(k))`` ``(B, H, L, D)`` from the layer's own modules and functions."""
    with torch.no_grad():
        if isinstance(layer, PerformerAttention):
            return (layer.features(layer.split(layer.to_q(x))),) + (
                layer.features(layer.split(layer.to_k(x))),
            )
        if isinstance(layer, KernelAttention):
            b, n, _ = x.shape
            q = layer.feature_map(layer.query(x).view(b, n, HEADS, -1)).transpose(1, 2)
            k = layer.feature_map(layer.key(x).view(b, n, HEADS, -1)).transpose(1, 2)
            return q, k
        b, n, _ = x.shape
        q, k, _ = layer.qkv(x).reshape(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        return torch.relu(q) + 1e-3, torch.relu(k) + 1e-3


LAYERS = {
    "performer": PerformerAttention,
    "kernel elu+1": KernelAttention,
    "matmul relu": MatmulLinearAttention,
}
# each one's feature map, as the capture names it from the layer's own projections (random
# features are no map of the projection alone: unnamed)
NAMED = {"performer": None, "kernel elu+1": "elu(z) + 1", "matmul relu": "relu(z) + 0.001"}


@pytest.mark.parametrize("kind", LAYERS)
def test_a_linear_attention_is_captured_as_the_weights_it_never_forms(kind):
    torch.manual_seed(0)
    layer = LAYERS[kind](WIDTH, HEADS).eval()
    x = torch.randn(2, LENGTH, WIDTH)
    ds = attnpanel.capture(Holding(layer), x).isel(layer=0)
    assert ds.attrs["captured_via"] == "linear"
    assert ds.attrs["normaliser"] == "row sum"
    assert "phi(q) . phi(k) / row sum" in ds.attrs["weights_formed"]
    assert ds.attrs.get("feature_map") == NAMED[kind]
    assert "w_q" not in ds and "w_k" not in ds  # its scores are no product of projections
    phi_q, phi_k = long_way(layer, x)
    products = (phi_q.double() @ phi_k.double().transpose(-2, -1)).numpy()
    expected = products / products.sum(-1, keepdims=True)
    np.testing.assert_allclose(ds["weights"].values, expected, atol=1e-5)
    np.testing.assert_allclose(ds["q"].values, phi_q.numpy(), atol=1e-6)  # its own features
    # exact to the layer's output: the weights' context through its own output projection
    context = np.einsum("bhqk,bhke->bqhe", ds["weights"].values, ds["v"].values)
    merged = context.reshape(2, LENGTH, WIDTH)
    output = merged @ ds["w_o"].values.T + ds["b_o"].values
    with torch.no_grad():
        np.testing.assert_allclose(output, layer(x).numpy(), atol=1e-5)
    # recomputed from the trace's own q and k under another mask: its normaliser, not a softmax
    diagonal = products * (1 - np.eye(LENGTH))
    np.testing.assert_allclose(
        attention_stage(ds, "softmax", mask="diagonal").values,
        diagonal / diagonal.sum(-1, keepdims=True),
        atol=1e-5,
    )


def test_a_linear_traces_stages_follow_its_normaliser():
    torch.manual_seed(1)
    layer = KernelAttention(WIDTH, HEADS).eval()
    x = torch.randn(2, LENGTH, WIDTH)
    ds = attnpanel.capture(Holding(layer), x).isel(layer=0)
    phi_q, phi_k = long_way(layer, x)
    products = (phi_q.double() @ phi_k.double().transpose(-2, -1)).numpy()
    causal = np.tril(products)
    np.testing.assert_allclose(
        attention_stage(ds, "softmax", mask="causal").values,
        causal / causal.sum(-1, keepdims=True),
        atol=1e-5,
    )
    np.testing.assert_allclose(attention_stage(ds, "raw").values, products, rtol=1e-5)
    masked = attention_stage(ds, "masked", mask="causal").values
    assert (masked[..., np.triu_indices(LENGTH, 1)[0], np.triu_indices(LENGTH, 1)[1]] == 0).all()
    # the words around the numbers: no softmax is run
    sel = core.Selection(sample=1, head=2, stage="softmax", mask="causal")
    assert "φ(q)·φ(k) / row sum" in core.matrix_title(ds, sel)
    assert "softmax" not in core.matrix_title(ds, sel)
    assert "softmax" not in stage_names(ds) and "weights (row sum)" in stage_names(ds)
    table = summary.shape_table(ds).set_index("step")["operation"]
    assert table["weights"].startswith("each row / its sum")
    assert table["scores"] == "φ(q)·φ(k)ᵀ, φ(z) = elu(z) + 1"
    # the kernel's autograd path gives the numbers of its in-place one
    q, k = phi_q.clone().requires_grad_(), phi_k.clone().requires_grad_()
    blocked = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
    _, traced = attend(q, k, blocked, 1.0, normaliser="row sum")
    traced.sum().backward()
    _, plain = attend(phi_q, phi_k, blocked, 1.0, normaliser="row sum")
    torch.testing.assert_close(traced.detach(), plain)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="normaliser takes no additive bias"):
        attend(phi_q, phi_k, None, 1.0, bias=torch.zeros(LENGTH, LENGTH), normaliser="row sum")


@pytest.fixture(scope="module")
def energformer():
    torch.manual_seed(2)
    model = Energformer(WIDTH, HEADS).eval()
    power = torch.rand(3, 48) * 2000
    return model, power, attnpanel.capture(model, power)


def test_an_energformer_like_nilm_model_is_drawn_on_the_page(energformer):
    model, power, ds = energformer
    assert list(ds["layer"].values) == ["encoder.0.attention", "encoder.1.attention"]
    run = attnpanel.ModelRun(model, (power,), layers=list(ds["layer"].values))
    explorer = AttentionExplorer(ds, model=run, layer=1, head=3, sample=2)
    explorer.__panel__().get_root(Document())
    for name in [n for n in explorer.param if n.startswith("show_")]:
        setattr(explorer, name, True)
    explorer.engine.scheduler.finish_idle()
    assert explorer.last_error == ""
    # the page draws the model's own implicit weights (the long way, from its modules)
    captured = {}
    block = model.encoder[1]
    hook = block.attention.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    with torch.no_grad():
        model(power)
    hook.remove()
    phi_q, phi_k = long_way(block.attention, captured["x"])
    products = (phi_q.double() @ phi_k.double().transpose(-2, -1))[2, 3].numpy()
    np.testing.assert_allclose(
        shown_matrix(explorer), products / products.sum(-1, keepdims=True), atol=1e-5
    )
    title = core.matrix_title(explorer.trace, explorer.selection)
    assert "φ(q)·φ(k) / row sum" in title and "softmax" not in title


def test_a_linear_heads_switched_off_is_the_long_way(energformer):
    model, power, _ = energformer
    layer = model.encoder[0].attention
    with torch.no_grad():
        before = model(power)
        with attnpanel.ablate(model, {"encoder.0.attention": [1]}):
            off = model(power)
    # the long way: the layer's own computation with head 1's context set to 0
    own = layer.forward

    def without_head(x):
        n, length, d = x.shape
        q = layer.feature_map(layer.query(x).view(n, length, HEADS, -1))
        k = layer.feature_map(layer.key(x).view(n, length, HEADS, -1))
        v = layer.value(x).view(n, length, HEADS, -1)
        weights = torch.einsum("nlhd,nshd->nhls", q, k)
        weights = weights / weights.sum(-1, keepdim=True)
        context = torch.einsum("nhls,nshm->nlhm", weights, v)
        context[:, :, 1] = 0
        return layer.out_proj(context.reshape(n, length, d))

    layer.forward = without_head
    try:
        with torch.no_grad():
            expected = model(power)
    finally:
        layer.forward = own
    torch.testing.assert_close(off, expected, atol=1e-5, rtol=1e-5)
    assert float((off - before).abs().max()) > 1e-3  # it changed the prediction


def test_the_survey_and_roles_read_a_linear_attention(energformer):
    model, power, ds = energformer
    survey = attnpanel.survey(model, [power[:2], power[2:]], progress=False)
    weights = ds["weights"].values.astype(np.float64)  # (layer, batch, head, L, S)
    entropy = -(weights * np.log(np.where(weights > 0, weights, 1))).sum(-1).mean(-1)
    np.testing.assert_allclose(
        survey["entropy"].transpose("sample", "layer", "head").values,
        entropy.transpose(1, 0, 2),
        atol=1e-4,
    )
    roles = attnpanel.head_roles(survey)
    assert roles.sizes["layer"] == 2 and roles.sizes["head"] == HEADS


def test_the_query_key_plane_of_a_linear_attention_keeps_every_product(energformer):
    """Its q and k (the features) are scaled, never moved: a row sum, unlike a softmax,
    changes with a constant added to a row."""
    _, _, ds = energformer
    plane = attnpanel.qk_embedding(ds, layer=1, head=2)
    assert not plane["key_shift"].values.any() and "not moved" in plane.attrs["transform"]
    one = ds.isel(layer=1, head=2)
    s = float(plane["norm_scale"])
    q, k = one["q"].values.reshape(-1, 8) * s, one["k"].values.reshape(-1, 8) / s
    np.testing.assert_allclose(
        np.linalg.norm(q, axis=1).mean(), np.linalg.norm(k, axis=1).mean(), rtol=1e-6
    )


def test_products_of_signed_tensors_are_not_taken_for_linear_attention():
    """Two chained products whose 'features' take both signs: no attention is claimed."""

    class Chained(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            left = self.a(x).view(2, LENGTH, HEADS, -1).transpose(1, 2)
            right = self.b(x).view(2, LENGTH, HEADS, -1).transpose(1, 2)
            return left @ (right.transpose(-2, -1) @ right)

    torch.manual_seed(3)
    with pytest.raises(attnpanel.CaptureError, match="no attention|computed no"):
        attnpanel.capture(Chained(), torch.randn(2, LENGTH, WIDTH))


def test_a_linear_cells_score_is_split_over_the_input(energformer):
    """Its score is its features' product ``phi(q_i) . phi(k_j)`` (the long way, from the
    layer's own modules): the shares add up to its change; a row is its cells weighted by
    the row-sum weights (not a softmax of the scores); the split over earlier parts is
    refused by name (a feature map is not linear in its input)."""
    model, power, _ = energformer
    power = power / 1000  # in kW: from zeros, the path in W crosses its layer norms abruptly
    layer = model.encoder[1].attention
    seen = {}
    hook = layer.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        model(power)
    hook.remove()
    phi_q, phi_k = long_way(layer, seen["x"])
    cell = dict(layer="encoder.1.attention", head=2, query=10, sample=1, steps=64)
    found = attnpanel.score_attribution(model, (power,), key=30, **cell)
    assert found.attrs["score"] == pytest.approx(float(phi_q[1, 2, 10] @ phi_k[1, 2, 30]), 1e-5)
    change = found.attrs["score"] - found.attrs["baseline_score"]
    assert abs(found.attrs["completeness_error"]) < 1e-3 * abs(change)
    assert found.attrs["normaliser"] == "row sum"
    # a row is its cells by their row-sum weights (the first 12 steps: 12 cells to run)
    short, few = power[:, :12], dict(cell, steps=4, query=5)
    row = attnpanel.score_attribution(model, (short,), key=None, **few)
    weights = attnpanel.capture(model, short)["weights"].sel(layer="encoder.1.attention")
    weights = weights.isel(batch=1, head=2, query=5)
    cells = [attnpanel.score_attribution(model, (short,), key=j, **few) for j in range(12)]
    expected = sum(w * c.values for w, c in zip(weights.values, cells, strict=True))
    np.testing.assert_allclose(row.values, expected, atol=1e-5 * np.abs(expected).max())
    assert row.attrs["score"] == pytest.approx(
        sum(w * c.attrs["score"] for w, c in zip(weights.values, cells, strict=True)), rel=1e-5
    )
    with pytest.raises(attnpanel.AttributionError, match="not linear in its input"):
        attnpanel.component_attribution(
            model, (power,), layer="encoder.1.attention", head=2, query=10, key=30, sample=1
        )


def test_two_checkpoints_of_a_linear_model_compare_in_their_own_words(energformer):
    """The comparison's report names a linear attention's weights, and no softmax."""
    from attnpanel.readouts.compare import compare, ranked_heads
    from attnpanel.render.compare_report import report_html

    model, power, a = energformer
    torch.manual_seed(5)
    other = Energformer(WIDTH, HEADS).eval()
    b = attnpanel.capture(other, power)
    ranking = ranked_heads(compare(a, b))
    text = report_html(a, b, ranking, heads=1, size=120)
    said = json.dumps("the models' own weights φ(q)·φ(k) / row sum")[1:-1]  # as in its JSON
    assert said in text
    assert "softmax weights" not in text

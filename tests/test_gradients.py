"""``d score / d a_ij`` (``attnpanel.interventions.gradients``) and the gradient-weighted
rollout against the long way: the weights formed explicitly inside the model, their
gradient taken by autograd (``retain_grad``), Chefer et al.'s rule applied in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zoo
from torch.overrides import TorchFunctionMode

import attnpanel
from attnpanel.interventions.gradients import attention_gradients
from attnpanel.readouts.flow import rollout


def score(y: torch.Tensor) -> torch.Tensor:
    """A score that weighs positions and features unevenly (so gradients differ)."""
    weights = torch.linspace(-1.0, 2.0, y.shape[-1], dtype=y.dtype)
    return (y * weights).sum() + (y[:, 0] ** 2).sum()


class ExplicitSDPA(TorchFunctionMode):
    """SDPA written out (softmax of scaled ``q k^T`` under its mask: causal, boolean or
    additive), keeping each weight tensor's gradient: the long way for a model whose
    kernel never forms the weights."""

    def __init__(self):
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5
        scores = q @ k.transpose(-2, -1) * scale
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        if kwargs.get("is_causal"):
            length = q.shape[-2]
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if weights.requires_grad:
            weights.retain_grad()
        self.weights.append(weights)
        return weights @ v


def _nilmformer_long_way(model, args, kwargs):
    """NILMFormer's weights are the input of its attention dropout: keep their gradient."""
    weights = []

    def keep(module, inputs, output):
        output.retain_grad()
        weights.append(output)

    hooks = [
        model.get_submodule(f"EncoderBlock.{i}.attention_layer.attn_dropout").register_forward_hook(
            keep
        )
        for i in range(2)
    ]
    try:
        y = model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return y, weights


def _nanogpt_long_way(model, args, kwargs):
    explicit = ExplicitSDPA()
    with explicit:
        y = model(*args, **kwargs)
    return y, explicit.weights


def _hf_long_way(model, args, kwargs):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(*args, **kwargs, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    for weights in out.attentions:
        if weights.requires_grad:
            weights.retain_grad()
    return out.last_hidden_state, list(out.attentions)


LONG_WAY = {
    "nilmformer_real": _nilmformer_long_way,
    "nanogpt_sdpa_causal": _nanogpt_long_way,
    "bert_padding": _hf_long_way,
    "llama_gqa_rotary": _hf_long_way,
}


def long_way(name):
    """The model's own weights and ``d score / d a`` by autograd, float64 numpy."""
    model, args, kwargs = zoo.case(name).build()
    with torch.enable_grad():
        y, weights = LONG_WAY[name](model, args, kwargs)
        score(y).backward()
    return (
        [w.detach().double().numpy() for w in weights],
        [w.grad.double().numpy() for w in weights],
    )


def long_gradient_rollout(weights, grads, residual):
    flow = None
    for a, g in zip(weights, grads, strict=True):
        positive = np.maximum(g * a, 0.0).mean(axis=1)  # (B, L, L)
        sums = positive.sum(axis=-1, keepdims=True)
        eye = np.eye(a.shape[-1])
        layer = np.where(sums > 0, positive / np.where(sums > 0, sums, 1.0), eye)
        mixed = residual * eye + (1 - residual) * layer
        mixed = mixed / mixed.sum(axis=-1, keepdims=True)
        flow = mixed if flow is None else mixed @ flow
    return flow


@pytest.mark.parametrize("name", list(LONG_WAY))
def test_attention_gradients_equal_autograd_at_the_models_own_weights(name):
    model, args, kwargs = zoo.case(name).build()
    found = attention_gradients(model, *args, score=score, **kwargs)
    weights, grads = long_way(name)
    assert found.dims == ("layer", "batch", "head", "query", "key")
    assert found.sizes["layer"] == len(grads)
    for index, expected in enumerate(grads):
        scale = np.abs(expected).max()
        got = found.isel(layer=index).values
        # masked cells: the weight is 0 and so is the gradient weighted rollout uses
        real = weights[index] > 0
        np.testing.assert_allclose(got[real], expected[real], atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["nilmformer_real", "nanogpt_sdpa_causal", "bert_padding"])
@pytest.mark.parametrize("residual", [0.0, 0.5])
def test_gradient_weighted_rollout_follows_chefers_rule(name, residual):
    model, args, kwargs = zoo.case(name).build()
    traces = attnpanel.capture(model, *args, **kwargs)
    gradients = attention_gradients(model, *args, score=score, trace=traces, **kwargs)
    found = rollout(traces, residual=residual, gradients=gradients)
    weights, grads = long_way(name)
    expected = long_gradient_rollout(weights, grads, residual)
    np.testing.assert_allclose(found.values, expected, atol=1e-6)
    np.testing.assert_allclose(found.sum("key"), 1.0, atol=1e-12)
    assert found.attrs["weighted"] == "relu(d score / d a * a)"
    plain = rollout(traces, residual=residual)
    assert plain.attrs["weighted"] == "plain"
    assert not np.allclose(plain.values, found.values, atol=1e-3)


def test_the_probe_changes_no_output_bit_and_the_model_is_left_as_it_was():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    with torch.no_grad():
        before = model(*args, **kwargs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attention_gradients(model, *args, **kwargs)  # the default score: ||y||
    with torch.no_grad():
        after = model(*args, **kwargs)
    assert torch.equal(before, after)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(p.grad is not None for p in model.parameters())


def test_the_gradients_are_the_same_inside_a_no_grad_block():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    free = attention_gradients(model, *args, score=score, **kwargs)
    with torch.no_grad():
        inside = attention_gradients(model, *args, score=score, **kwargs)
    np.testing.assert_allclose(inside.values, free.values, rtol=1e-6)
    assert float(abs(free).max()) > 0


def test_gradients_of_other_inputs_are_refused_by_rollout():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    traces = attnpanel.capture(model, *args, **kwargs)
    gradients = attention_gradients(model, *args, trace=traces, **kwargs)
    with pytest.raises(ValueError, match="not of the same inputs"):
        rollout(traces, gradients=gradients.isel(batch=[0]))
    with pytest.raises(ValueError, match="layers"):
        rollout(traces, gradients=gradients.isel(layer=[0]))
    with pytest.raises(ValueError, match="not the capture's"):
        rollout(traces, gradients=gradients.assign_coords(layer=["a", "b"]))
    with pytest.raises(ValueError, match="scalar tensor"):
        attention_gradients(model, *args, score=lambda y: y, trace=traces, **kwargs)
    bart, bart_args, bart_kwargs = zoo.case("bart").build()
    with pytest.raises(ValueError, match="encoder-decoder"):
        attention_gradients(bart, *bart_args, **bart_kwargs)

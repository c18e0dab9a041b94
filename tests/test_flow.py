"""Value-weighted attention and rollout (``attnpanel.readouts.flow``) against the long way:
the model's own values, output projections and attention, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zoo

import attnpanel
from attnpanel.readouts.flow import rollout, value_weighted
from attnpanel.traces.stages import value_norms


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, L, n E) -> (B, n, L, E)``."""
    return t.reshape(*t.shape[:2], n, -1).transpose(1, 2)


def lin(module, x: torch.Tensor) -> torch.Tensor:
    """A Linear applied in float64."""
    bias = None if module.bias is None else module.bias.double()
    return F.linear(x.double(), module.weight.double(), bias)


def first_input(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


# For each zoo model: (attention module of layer i, the module's input x) -> (v (B, H, S, E),
# w_o (D, H E)), read from the model's own modules in float64.
def _nilmformer(module, x):
    return heads(lin(module.wv, x), module.n_heads), module.wo.weight


def _nanogpt(module, x):
    qkv = F.linear(x.double(), module.c_attn.weight.double(), module.c_attn.bias.double())
    return heads(qkv.split(module.n_embd, dim=2)[2], module.n_head), module.c_proj.weight


def _llama(module, x):
    config = module.config
    v = heads(lin(module.v_proj, x), config.num_key_value_heads)  # (B, H', S, E)
    groups = config.num_attention_heads // config.num_key_value_heads
    return v.repeat_interleave(groups, dim=1), module.o_proj.weight


def _bert(module, x, model=None, name=""):
    v = heads(lin(module.value, x), module.num_attention_heads)
    dense = model.get_submodule(name.removesuffix(".self") + ".output.dense")
    return v, dense.weight


def _mha(module, x):
    embed = module.embed_dim
    v = F.linear(x.double(), module.in_proj_weight[2 * embed :].double())
    v = v + module.in_proj_bias[2 * embed :].double()
    return heads(v, module.num_heads), module.out_proj.weight


LONG_WAY = {
    "nilmformer_real": ("EncoderBlock.{}.attention_layer", _nilmformer),
    "nanogpt_sdpa_causal": ("transformer.h.{}.attn", _nanogpt),
    "llama_gqa_rotary": ("layers.{}.self_attn", _llama),
    "bert_padding": ("encoder.layer.{}.attention.self", _bert),
    "torch_encoder_padding": ("layers.{}.self_attn", _mha),
}


@pytest.mark.parametrize("name", list(LONG_WAY))
def test_value_weighted_is_the_weight_times_the_norm_of_v_w_o(name):
    case = zoo.case(name)
    model, args, kwargs = case.build()
    pattern, read = LONG_WAY[name]
    traces = attnpanel.capture(model, *args, **kwargs)
    found = value_weighted(traces)
    assert found.attrs["measure"] == "a_ij * ||v_j W_o^h||"
    reference = {n: w.detach() for n, w in case.reference(model, args, kwargs)}  # its own
    modules = [pattern.format(i) for i in range(traces.sizes["layer"])]
    with zoo.no_fastpath():
        calls = zoo.inputs_of(model, modules, args, kwargs)
    for index, (module_name, call_args, call_kwargs) in enumerate(calls):
        module = model.get_submodule(module_name)
        x = first_input(call_args, call_kwargs)
        extra = dict(model=model, name=module_name) if read is _bert else {}
        with torch.no_grad():
            v, w_o = read(module, x, **extra)
        n_heads, width = v.shape[1], v.shape[3]
        blocks = w_o.detach().double().reshape(w_o.shape[0], n_heads, width)  # (D, H, E)
        norms = torch.einsum("bhje,dhe->bhjd", v, blocks).norm(dim=-1)  # (B, H, S)
        expected = reference[module_name].double() * norms[:, :, None, :]
        got = found.isel(layer=index).values
        scale = float(expected.abs().max())
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5 * scale)


def test_value_norms_fall_back_to_v_where_w_o_is_unknown():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    layer = attnpanel.capture(model, *args, **kwargs).isel(layer=0).drop_vars("w_o")
    norms = value_norms(layer)
    assert norms.attrs["measure"] == "||v_j|| (w_o unknown)"
    np.testing.assert_allclose(norms.values, np.linalg.norm(layer["v"].values, axis=-1))
    with pytest.raises(ValueError, match="needs the trace's values 'v'"):
        value_norms(layer.drop_vars("v"))


def test_value_weighted_of_a_virtual_trace_is_lazy_and_exact():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    dense = attnpanel.capture(model, *args, dense=True, **kwargs).isel(layer=1)
    lazy = attnpanel.capture(model, *args, dense=False, **kwargs).isel(layer=1)
    found = value_weighted(lazy, batch=1, head=2)
    assert found.attrs["lazy"] and hasattr(found.data, "dask")
    expected = value_weighted(dense, batch=1, head=2)
    np.testing.assert_allclose(found.values, expected.values, rtol=1e-5, atol=1e-7)


def long_rollout(weights: list[torch.Tensor], residual: float) -> torch.Tensor:
    """Abnar & Zuidema's rollout, one layer at a time, in float64."""
    flow = None
    for layer in weights:  # (B, H, L, L)
        mixed = residual * torch.eye(layer.shape[-1], dtype=torch.float64) + (
            1 - residual
        ) * layer.double().mean(dim=1)
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        flow = mixed if flow is None else torch.bmm(mixed, flow)
    return flow


@pytest.mark.parametrize("name", ["nilmformer_real", "bert_padding", "minilm_padding"])
@pytest.mark.parametrize("residual", [0.0, 0.5, 0.9])
def test_rollout_composes_the_models_own_attention(name, residual):
    case = zoo.case(name)
    model, args, kwargs = case.build()
    traces = attnpanel.capture(model, *args, **kwargs)
    found = rollout(traces, residual=residual)
    reference = [weights.detach() for _, weights in case.reference(model, args, kwargs)]
    expected = long_rollout(reference, residual)
    np.testing.assert_allclose(found.values, expected.numpy(), atol=1e-6)
    np.testing.assert_allclose(found.sum("key"), 1.0, atol=1e-12)
    assert found.dims == ("batch", "query", "key")


def test_rollout_by_one_head_or_the_max_and_its_refusals():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    traces = attnpanel.capture(model, *args, **kwargs)
    weights = traces["weights"].values.astype(np.float64)  # (layer, B, H, L, L)
    one = rollout(traces, residual=0.0, head=2)
    expected = weights[1, :, 2] @ weights[0, :, 2]
    np.testing.assert_allclose(one.values, expected, atol=1e-6)
    assert rollout(traces, head="max").attrs["head"] == "max"
    with pytest.raises(ValueError, match="head='median'"):
        rollout(traces, head="median")
    with pytest.raises(ValueError, match="residual=1.5"):
        rollout(traces, residual=1.5)
    bart, bart_args, bart_kwargs = zoo.case("bart").build()
    tree = attnpanel.capture(bart, *bart_args, **bart_kwargs)
    with pytest.raises(ValueError, match="encoder-decoder.*roll out one of them"):
        rollout(tree)
    cross = [node.ds for node in tree.subtree if node.has_data and "encoder_attn" in node.path]
    with pytest.raises(ValueError, match="square maps"):
        rollout(cross[0])

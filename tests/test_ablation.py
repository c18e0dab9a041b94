"""Heads switched off inside real models (``attnpanel.ablate``), checked against the long way:
a forward pre-hook that changes the head's lane of the output projection's input."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
import xarray as xr
import zoo
from torch import nn

import attnpanel
from attnpanel.interventions.gate import AblationError, attention_heads
from attnpanel.interventions.importance import output_tensor

# (zoo case, layer, the output projection that takes the merged heads)
PROJECTED = [
    ("nilmformer_real", "EncoderBlock.1.attention_layer", "EncoderBlock.1.attention_layer.wo"),
    ("nanogpt_sdpa_causal", "transformer.h.0.attn", "transformer.h.0.attn.c_proj"),
    ("llama_gqa_rotary", "layers.1.self_attn", "layers.1.self_attn.o_proj"),
    ("bert_padding", "encoder.layer.0.attention.self", "encoder.layer.0.attention.output.dense"),
    ("minilm_padding", "encoder.layer.3.attention.self", "encoder.layer.3.attention.output.dense"),
]


def capture_layers(traces) -> list[str]:
    if isinstance(traces, xr.DataTree):
        return [
            str(name)
            for node in traces.subtree
            if node.has_data and "layer" in node.ds.coords
            for name in node.ds["layer"].values
        ]
    return [str(name) for name in traces["layer"].values]


def run(model, args, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return output_tensor(model(*args, **kwargs))


def in_double(model, args, kwargs):
    """A float64 copy of the model and its float inputs: where a head's change is small,
    float32 rounding is a large share of it."""

    def cast(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    copied = copy.deepcopy(model).double()
    return copied, tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def lane_hook(module: nn.Module, head: int, heads: int, how: str):
    """The long way: the out projection's input (B, L, H * E) with head ``head``'s lane
    zeroed, or replaced by its mean over the positions."""

    def hook(_module, args):
        merged = args[0].clone()
        width = merged.shape[-1] // heads
        lane = merged[..., head * width : (head + 1) * width]
        if how == "zero":
            lane.zero_()
        else:
            lane.copy_(lane.mean(dim=-2, keepdim=True).expand_as(lane))
        return (merged, *args[1:])

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", [c.name for c in zoo.CASES])
def test_layer_names_are_the_captures(name):
    """Every layer of the zoo is named as capture's ``layer`` coordinate names it, with the
    heads of its attention."""
    case = zoo.case(name)
    model, args, kwargs = case.build()
    heads = attention_heads(model, *args, **kwargs)
    traces = attnpanel.capture(model, *args, **kwargs)
    assert sorted(heads) == sorted(capture_layers(traces))  # a DataTree groups them by kind
    sizes = (
        [node.ds.sizes["head"] for node in traces.subtree if node.has_data]
        if isinstance(traces, xr.DataTree)
        else [traces.sizes["head"]]
    )
    assert set(heads.values()) == set(sizes)


@pytest.mark.parametrize("how", ["zero", "mean"])
@pytest.mark.parametrize(("name", "layer", "projection"), PROJECTED)
def test_ablation_equals_a_hook_on_the_output_projection(name, layer, projection, how):
    case = zoo.case(name)
    model, args, kwargs = case.build()
    heads = attention_heads(model, *args, **kwargs)[layer]
    plain = run(model, args, kwargs)
    module = dict(model.named_modules())[projection]
    for head in (0, heads - 1):
        with torch.no_grad(), attnpanel.ablate(model, {layer: [head]}, how=how):
            ablated = output_tensor(model(*args, **kwargs))
        with lane_hook(module, head, heads, how):
            expected = run(model, args, kwargs)
        assert relative(ablated, expected) <= 1e-5
        assert relative(ablated, plain) > 1e-6  # the head did something ...
    assert torch.equal(run(model, args, kwargs), plain)  # bit-identical after the block
    wide, wide_args, wide_kwargs = in_double(model, args, kwargs)
    wide_plain = run(wide, wide_args, wide_kwargs)
    module = dict(wide.named_modules())[projection]
    for head in (0, heads - 1):  # ... and the same thing, beyond float32's rounding
        with torch.no_grad(), attnpanel.ablate(wide, {layer: [head]}, how=how):
            ablated = output_tensor(wide(*wide_args, **wide_kwargs))
        with lane_hook(module, head, heads, how):
            expected = run(wide, wide_args, wide_kwargs)
        assert relative(ablated - wide_plain, expected - wide_plain) <= 1e-6


def mha_long_way(mha: nn.MultiheadAttention, x, padding, head: int, how: str) -> torch.Tensor:
    """A batch-first ``nn.MultiheadAttention`` self-attention, written out, with one head's
    lane of the merged output zeroed or replaced by its mean over the positions."""
    embed, n_heads = mha.embed_dim, mha.num_heads
    width = embed // n_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.reshape(*t.shape[:2], n_heads, width).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(width)  # (B, H, L, S)
    scores = scores.masked_fill(padding[:, None, None, :], -math.inf)
    context = torch.softmax(scores, dim=-1) @ v  # (B, H, L, E)
    lane = context[:, head]
    context[:, head] = 0.0 if how == "zero" else lane.mean(dim=1, keepdim=True)
    merged = context.transpose(1, 2).reshape(*x.shape[:2], embed)
    return F.linear(merged, mha.out_proj.weight, mha.out_proj.bias)


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_ablation_of_nn_multihead_attention(how):
    """``nn.MultiheadAttention`` merges and projects inside one function: its ablation
    equals the layer written out with the lane changed."""
    model, (src,), kwargs = zoo.case("torch_encoder_padding").build()
    padding = kwargs["src_key_padding_mask"]
    layer = model.layers[0]
    with torch.no_grad():
        x = layer.norm1(src) if layer.norm_first else src
        for head in (0, 3):
            with attnpanel.ablate(model, {"layers.0.self_attn": [head]}, how=how) as gate:
                inside = layer.self_attn(x, x, x, key_padding_mask=padding, need_weights=False)
            expected = mha_long_way(layer.self_attn, x, padding, head, how)
            assert relative(inside[0], expected) <= 1e-5
            assert gate.gated == {"layers.0.self_attn"}


class BmmAttention(nn.Module):
    """Heads folded into the batch, ``(B * H, L, S)`` bmm products (fairseq-style)."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        batch, length, dim = x.shape
        width = dim // self.heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)

        def fold(t):  # (B, L, D) -> (B * H, L, E)
            return t.reshape(batch, length, self.heads, width).transpose(1, 2).flatten(0, 1)

        weights = torch.softmax(torch.bmm(fold(q), fold(k).transpose(1, 2)) / width**0.5, -1)
        context = torch.bmm(weights, fold(v))  # (B * H, L, E)
        merged = context.reshape(batch, self.heads, length, width).transpose(1, 2)
        return self.out(merged.reshape(batch, length, dim))


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_heads_folded_into_the_batch(how):
    torch.manual_seed(0)
    model = BmmAttention().eval()
    x = torch.randn(3, 7, 16)
    assert attention_heads(model, x) == {"BmmAttention": 4}
    for head in range(4):
        with torch.no_grad(), attnpanel.ablate(model, {"BmmAttention": [head]}, how=how):
            ablated = model(x)
        with lane_hook(model.out, head, 4, how):
            expected = run(model, (x,), {})
        assert relative(ablated, expected) <= 1e-6


def test_the_model_is_bit_identical_after_ablate_on_every_zoo_model():
    for case in zoo.CASES:
        model, args, kwargs = case.build()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        plain = run(model, args, kwargs)
        heads = attention_heads(model, *args, **kwargs)
        layer = list(heads)[-1]
        with torch.no_grad(), attnpanel.ablate(model, {layer: list(range(heads[layer]))}):
            ablated = output_tensor(model(*args, **kwargs))
        assert not torch.equal(ablated, plain), case.name
        assert torch.equal(run(model, args, kwargs), plain), case.name
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()), case.name


def test_clear_errors_name_what_is_there():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    with pytest.raises(AblationError, match=r"no layer 'transformer.h.7.attn'.*transformer.h.0"):
        with attnpanel.ablate(model, {"transformer.h.7.attn": [0]}):
            pass
    with pytest.raises(AblationError, match=r"has 4 heads \(0 to 3\); there is no head 4"):
        with attnpanel.ablate(model, {"transformer.h.0.attn": [4]}):
            run(model, args, kwargs)
    with pytest.raises(AblationError, match=r"'transformer.h.0.attn\[1\]' computed no attention"):
        with attnpanel.ablate(model, {"transformer.h.0.attn[1]": [0]}):
            run(model, args, kwargs)
    with pytest.raises(AblationError, match="how='half'"):
        with attnpanel.ablate(model, {"transformer.h.0.attn": [0]}, how="half"):
            pass
    with pytest.raises(AblationError, match="heads are integers"):
        with attnpanel.ablate(model, {"transformer.h.0.attn": ["0"]}):
            pass
    with pytest.raises(AblationError, match="must map layer names"):
        with attnpanel.ablate(model, [0]):
            pass
    plain = run(model, args, kwargs)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with pytest.raises(AblationError, match=r"computed no attention inside ablate\(\).*: none"):
        with attnpanel.ablate(model, {"transformer.h.0.attn": [1]}):
            pass  # the model never ran: the ablation touched nothing, which is an error
    assert torch.equal(run(model, args, kwargs), plain)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath

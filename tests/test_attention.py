"""The attention layer against torch's own references, and its invariants on random shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnpanel import MultiHeadSelfAttention, build_mask
from attnpanel.kernels import masks, memory
from attnpanel.kernels.attention import attend
from attnpanel.kernels.masks import cached_mask

TOL = dict(rtol=1e-5, atol=1e-5)
MODES = ("none", "diagonal", "causal", "custom")


def custom_mask(length: int, seed: int = 0) -> torch.Tensor:
    """A random bool mask (True = blocked) with at least one visible key per query."""
    generator = torch.Generator().manual_seed(seed)
    blocked = torch.rand(length, length, generator=generator) < 0.5
    visible = torch.randint(0, length, (length,), generator=generator)
    blocked[torch.arange(length), visible] = False
    return blocked


def make_layer(d_model=16, n_heads=4, mask="diagonal", length=7) -> MultiHeadSelfAttention:
    if mask == "custom":
        mask = custom_mask(length)
    return MultiHeadSelfAttention(d_model, n_heads, mask=mask, dropout=0.2).eval()


def reference_mha(layer: MultiHeadSelfAttention) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` with the layer's weights copied in."""
    mha = nn.MultiheadAttention(layer.d_model, layer.n_heads, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([layer.wq.weight, layer.wk.weight, layer.wv.weight]))
        mha.out_proj.weight.copy_(layer.wo.weight)
    return mha.eval()


def split(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    batch, length, d_model = t.shape
    return t.view(batch, length, n_heads, d_model // n_heads).transpose(1, 2)


@pytest.mark.parametrize("mode", MODES)
def test_every_stage_matches_torch_references(mode):
    layer = make_layer(mask=mode)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        s = layer.stages(x)
        blocked = layer.blocked(7)
        q = split(x @ layer.wq.weight.T, 4)
        k = split(x @ layer.wk.weight.T, 4)
        v = split(x @ layer.wv.weight.T, 4)
        allowed = None if blocked is None else ~blocked  # SDPA: True = attend
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        output, weights = reference_mha(layer)(
            x, x, x, need_weights=True, average_attn_weights=False, attn_mask=blocked
        )
    torch.testing.assert_close(s.q, q, **TOL)
    torch.testing.assert_close(s.k, k, **TOL)
    torch.testing.assert_close(s.v, v, **TOL)
    torch.testing.assert_close(s.scores, q @ k.transpose(-2, -1), **TOL)
    torch.testing.assert_close(s.weights, weights, **TOL)
    torch.testing.assert_close(s.context, context, **TOL)
    torch.testing.assert_close(s.output, output, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), output, **TOL)
    if blocked is not None:
        assert (s.weights[..., blocked] == 0.0).all()


def test_scale_is_head_dim_to_the_minus_half():
    layer = MultiHeadSelfAttention(96, 8)
    assert layer.head_dim == 12
    assert layer.scale == 12**-0.5


def test_defaults_are_nilmformer():
    layer = MultiHeadSelfAttention()
    assert (layer.d_model, layer.n_heads, layer.mask_name) == (96, 8, "diagonal")
    assert layer.attn_dropout.p == 0.2
    assert all(getattr(layer, name).bias is None for name in ("wq", "wk", "wv", "wo"))


@st.composite
def attention_cases(draw):
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(2, 12))
    n_heads = draw(st.integers(1, 4))
    head_dim = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(MODES))
    mask = mode
    if mode == "custom":
        blocked = draw(st.lists(st.booleans(), min_size=length * length, max_size=length * length))
        mask = torch.tensor(blocked).view(length, length)
        visible = draw(st.lists(st.integers(0, length - 1), min_size=length, max_size=length))
        mask[torch.arange(length), torch.tensor(visible)] = False
    seed = draw(st.integers(0, 2**16))
    return batch, length, n_heads, head_dim, mask, seed


@settings(max_examples=60, deadline=None)
@given(attention_cases())
def test_invariants_on_random_shapes(case):
    batch, length, n_heads, head_dim, mask, seed = case
    torch.manual_seed(seed)
    d_model = n_heads * head_dim
    layer = MultiHeadSelfAttention(d_model, n_heads, mask=mask).eval()
    x = torch.randn(batch, length, d_model)
    with torch.no_grad():
        s = layer.stages(x)
        out = layer(x)
    assert s.output.shape == x.shape
    assert out.shape == x.shape
    assert s.weights.shape == (batch, n_heads, length, length)
    assert (s.weights >= 0).all()
    torch.testing.assert_close(s.weights.sum(-1), torch.ones(batch, n_heads, length), **TOL)
    blocked = layer.blocked(length)
    if blocked is not None:
        assert (s.weights[..., blocked] == 0.0).all()
        allowed = ~blocked
    else:
        allowed = None
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=allowed)
    torch.testing.assert_close(s.context, reference, **TOL)
    torch.testing.assert_close(out, s.output, **TOL)


@pytest.mark.parametrize(("d_model", "n_heads"), [(10, 3), (96, 7), (100, 8)])
def test_non_divisible_d_model_names_both_numbers(d_model, n_heads):
    with pytest.raises(ValueError, match=rf"d_model \({d_model}\).*n_heads \({n_heads}\)"):
        MultiHeadSelfAttention(d_model, n_heads)


def test_non_positive_sizes_are_refused():
    with pytest.raises(ValueError, match=r"n_heads \(0\)"):
        MultiHeadSelfAttention(96, 0)


def test_masks_are_cached_not_rebuilt(monkeypatch):
    calls = []
    original = masks.build_mask

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(masks, "build_mask", counting)
    masks.forget_cached_masks()
    layer = make_layer(mask="causal")
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        first = layer.stages(x).mask
        second = layer.stages(x).mask
        layer(x)
    assert first is second is layer.blocked(9)
    assert layer.allowed(9) is layer.allowed(9)
    other = make_layer(mask="causal")
    assert other.blocked(9) is first  # shared across layers too
    assert len(calls) == 1
    layer.mask = "diagonal"
    assert layer.blocked(9) is not first
    assert torch.equal(layer.blocked(9), torch.eye(9, dtype=torch.bool))
    assert cached_mask("diagonal", 9) is layer.blocked(9)
    assert len(calls) == 2


def test_custom_mask_is_copied_and_checked():
    blocked = custom_mask(5)
    layer = MultiHeadSelfAttention(8, 2, mask=blocked)
    expected = blocked.clone()
    blocked.fill_(False)  # the caller edits its tensor afterwards
    assert torch.equal(layer.blocked(5), expected)
    assert layer.mask_name == "custom"
    with pytest.raises(
        ValueError, match=r"mask has shape \(5, 5\) but the sequence needs \(6, 6\)"
    ):
        layer.stages(torch.randn(1, 6, 8))


def test_bad_masks_are_refused():
    row_blocked = torch.eye(4, dtype=torch.bool)
    row_blocked[2] = True
    with pytest.raises(ValueError, match="blocks every key of query 2"):
        MultiHeadSelfAttention(8, 2, mask=row_blocked)
    with pytest.raises(ValueError, match="must be bool"):
        MultiHeadSelfAttention(8, 2, mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"square \(L, L\), got \(4, 3\)"):
        MultiHeadSelfAttention(8, 2, mask=torch.zeros(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="unknown mask 'sideways'"):
        MultiHeadSelfAttention(8, 2, mask="sideways")
    with pytest.raises(ValueError, match="blocks every key of query 0 \\(length 1\\)"):
        MultiHeadSelfAttention(8, 2, mask="diagonal").stages(torch.randn(1, 1, 8))


def test_wrong_input_shape_is_named():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"\(batch, length, 16\), got \(2, 7, 15\)"):
        layer(torch.randn(2, 7, 15))
    with pytest.raises(ValueError, match=r"got \(7, 16\)"):
        layer.stages(torch.randn(7, 16))


def test_oversized_sequence_is_refused_before_allocating():
    layer = MultiHeadSelfAttention()
    # an expanded view: 4096 x 200000 x 96 positions without the memory behind them
    x = torch.zeros(1, 1, 96).expand(4096, 200_000, 96)
    with pytest.raises(ValueError, match=r"attention of shape \(4096, 8, 200000, 200000\)") as info:
        layer.stages(x)
    assert "too long" in str(info.value)
    assert "GiB" in str(info.value)
    with pytest.raises(ValueError, match=r"attention of shape \(1000000, 1000000\)"):
        build_mask("diagonal", 1_000_000)


def test_memory_budget_is_configurable(monkeypatch):
    monkeypatch.setattr(memory, "MAX_ATTENTION_BYTES", 1000)
    layer = make_layer()
    # 2 x (1, 4, 16, 16) float32 = 8192 bytes > 1000
    with pytest.raises(ValueError, match=r"needs 2 x .* GiB but only .* GiB may be used"):
        layer.stages(torch.randn(1, 16, 16))


def test_grad_path_matches_the_in_place_path():
    layer = make_layer(mask="causal").train()
    layer.attn_dropout.p = 0.0
    x = torch.randn(2, 7, 16, requires_grad=True)
    s = layer.stages(x)  # autograd on: functional ops
    s.weights.sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        plain = layer.stages(x)  # autograd off: in-place ops in numpy-backed memory
    torch.testing.assert_close(s.weights.detach(), plain.weights, **TOL)
    torch.testing.assert_close(s.scores.detach(), plain.scores, **TOL)


def test_attend_on_one_sample_matches_the_batch():
    q, k = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    blocked = cached_mask("causal", 6)
    scores, weights = attend(q, k, blocked, 0.5)
    one_scores, one_weights = attend(q[1], k[1], blocked, 0.5)
    torch.testing.assert_close(one_scores, scores[1])
    torch.testing.assert_close(one_weights, weights[1])


def test_dropout_only_in_training():
    layer = MultiHeadSelfAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 7, 16)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))

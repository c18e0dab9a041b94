"""One rule for every numerical comparison of attention in the tests.

Three kinds of comparison, each with its own tolerance (``attnpanel.kernels.precision``
derives the softmax bound and says why):

* **Two kernels** (the model's own ``output_attentions`` against the captured weights, SDPA
  against eager, tiles against a dense softmax): :func:`assert_kernels_agree`, within
  ``softmax_bound(dtype, max|logit|, kernels=2)``; against a float64 recomputation as the
  truth, ``kernels=1`` (:func:`assert_exact_weights`).
* **The same numbers passed on** (drawn on the page, saved and loaded, cut into a window):
  :func:`assert_same_numbers`, equal up to one rounding to float32.
* **Sums of products computed twice** (projections, ``weights @ v``, outputs):
  :func:`assert_products_agree`, ``2 * terms * eps`` of their magnitude.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels import precision
from attnpanel.traces import layers, virtual
from attnpanel.traces.stages import attention_stage, masked_cells, recompute_weights

LARGE = 2**26  # cells of q . k past which the logits' maximum is bounded, not computed
FLOAT32 = np.float32


def kernel_bound(logits: float, dtype=FLOAT32, kernels: int = 2) -> float:
    """The bound two kernels (or one, against float64) keep; see ``attnpanel.kernels.precision``."""
    return precision.softmax_bound(dtype, logits, kernels=kernels)


def trace_logits(capture, mask=None) -> float:
    """``max |scale * q . k + bias|`` over every layer's cells a sample does not mask.

    Dense layers: each sample's scaled scores recomputed from the trace's own ``q``, ``k`` and
    bias, blocked (under ``mask``, the trace's own by default) and padded cells left out.
    Virtual layers (no bias there) and layers past ``LARGE`` cells: the Cauchy-Schwarz bound
    ``scale * max|q| * max|k|``, which never falls below the true maximum.
    """
    largest = 0.0
    for entry in layers.layers(capture):
        ds = layers.select(capture, entry.name)
        if virtual.is_virtual(ds) or ds["q"].size * ds.sizes["key"] > LARGE:
            q_norm = float(np.sqrt((ds["q"].astype("float64") ** 2).sum("head_dim")).max())
            k_norm = float(np.sqrt((ds["k"].astype("float64") ** 2).sum("head_dim")).max())
            largest = max(largest, ds.attrs["scale"] * q_norm * k_norm)
            continue
        wide = _widened(ds)
        for sample in range(ds.sizes["batch"]):
            scaled = np.abs(attention_stage(wide, "scaled", batch=sample).values)  # (H, L, S)
            for head in range(ds.sizes["head"]):
                hidden = masked_cells(ds, mask, batch=sample, head=head)
                cells = scaled[head] if hidden is None else scaled[head][~hidden]
                finite = cells[np.isfinite(cells)]
                if finite.size:
                    largest = max(largest, float(finite.max()))
    return largest


def _widened(ds: xr.Dataset) -> xr.Dataset:
    """A layer with q, k (and its bias) in float64: what the truth is computed from."""
    wide = ds.assign(q=ds["q"].astype("float64"), k=ds["k"].astype("float64"))
    return wide.assign(bias=ds["bias"].astype("float64")) if "bias" in ds else wide


def float64_weights(ds: xr.Dataset) -> xr.DataArray:
    """The truth: a layer's weights recomputed in float64 from its own q, k and full mask."""
    return recompute_weights(_widened(ds), ds.attrs["mask"])


def real_rows(ds: xr.Dataset) -> np.ndarray:
    """(batch, head, query) rows that are not masked whole (a padded query's row is whatever
    the model made of it, not attention; the float64 truth leaves it NaN)."""
    rows = np.ones((ds.sizes["batch"], ds.sizes["head"], ds.sizes["query"]), dtype=bool)
    for sample in range(ds.sizes["batch"]):
        for head in range(ds.sizes["head"]):
            hidden = masked_cells(ds, batch=sample, head=head)
            if hidden is not None:
                rows[sample, head] = ~hidden.all(axis=1)
    return rows


def values_of(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().float().numpy()
    return np.asarray(getattr(a, "values", a))


def assert_kernels_agree(actual, expected, *, logits: float, dtype=FLOAT32, kernels=2, **kw):
    """``actual`` and ``expected`` are one softmax computed by two kernels (NaN where masked
    must be NaN in both)."""
    np.testing.assert_allclose(
        values_of(actual),
        values_of(expected),
        rtol=0,
        atol=kernel_bound(logits, dtype, kernels),
        **kw,
    )


def assert_exact_weights(actual, truth, *, logits: float, dtype=FLOAT32, **kw):
    """One kernel against the float64 truth: half the two-kernel bound."""
    assert_kernels_agree(actual, truth, logits=logits, dtype=dtype, kernels=1, **kw)


def assert_same_numbers(actual, expected, **kw):
    """The same numbers passed on: equal up to one rounding to float32 (relative ``eps/2``
    of each value, and ``eps`` of the largest for values near 0 that were summed)."""
    actual, expected = values_of(actual), values_of(expected)
    eps = float(np.finfo(np.float32).eps)
    scale = float(np.nanmax(np.abs(expected))) if np.isfinite(expected).any() else 1.0
    np.testing.assert_allclose(actual, expected, rtol=eps, atol=eps * scale, **kw)


def products_bound(expected, terms: int, dtype=FLOAT32) -> float:
    """Two computations of sums of ``terms`` products (a projection, ``weights @ v``, an
    output): summation in any order keeps each within ``terms * eps`` of the magnitude
    (``max(1, max|expected|)``, the standard bound of a float sum), two kernels twice that."""
    magnitude = max(1.0, float(np.nanmax(np.abs(values_of(expected)))))
    return 2 * terms * precision.epsilon(dtype) * magnitude


def assert_products_agree(actual, expected, *, terms: int, dtype=FLOAT32, **kw):
    """``actual`` and ``expected`` are one sum of ``terms`` products computed twice."""
    bound = products_bound(expected, terms, dtype)
    np.testing.assert_allclose(values_of(actual), values_of(expected), rtol=0, atol=bound, **kw)

"""How far apart two correct computations of the same attention weights may be.

Two kernels that both compute ``softmax(scale * q . k + bias)`` (SDPA's fused one, an eager
``matmul`` + ``softmax``, attnpanel's own recomputation) round differently: they sum the
``E`` products of ``q . k`` in another order, with or without fused multiply-adds, and fold
the scale in before or after the product. How many units in the last place that costs
depends on the CPU's vector unit and on the size of the logits, so a fixed absolute tolerance
passes on one machine and fails on another. The bound here follows the computation:

* A logit error ``D`` moves a softmax row by ``dp_i = p_i (d_i - sum_j p_j d_j)``, so
  ``|dp_i| <= 2 p_i (1 - p_i) D <= D / 2``.
* One kernel's logit error is a few rounding steps of the logits' own size:
  ``D <= c * eps * max|z|``. Measured against a float64 recomputation, ``c`` is at most 2 in
  float32 (the trained MiniLM, ``E = 32``, on an AMD EPYC and an Intel Xeon).
* ``exp``, the row sum and the division add a few ``eps`` relative to ``p <= 1``.

So one kernel stays within ``ULPS[dtype] * eps * (1 + max|z|)`` of the exact weights, and two
kernels within twice that (:func:`softmax_bound`). ``ULPS`` is 4 for float32 and float64:
``c = 8`` halved by the softmax, four times the largest ``c`` measured. Half-precision kernels
(float16, bfloat16) accumulate the product in float32 and round the logits and the weights to
the narrow type once each, so ``ULPS`` is 1 there, with their own (much larger) ``eps``.

This module imports torch and numpy only; the tests and capture's own checks use it.
"""

from __future__ import annotations

import numpy as np
import torch

EPSILON = {
    torch.float64: 2.0**-52,
    torch.float32: 2.0**-23,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}
ULPS = {torch.float64: 4, torch.float32: 4, torch.float16: 1, torch.bfloat16: 1}
NUMPY = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}
NUMPY[np.dtype(np.float16)] = torch.float16


def as_torch_dtype(dtype) -> torch.dtype:
    """A torch dtype from a torch dtype, a numpy dtype or its name (``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and hasattr(torch, dtype):
        found = getattr(torch, dtype)
        if isinstance(found, torch.dtype):
            return found
    try:
        return NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError) as error:
        known = ", ".join(str(d).removeprefix("torch.") for d in EPSILON)
        raise ValueError(f"no rounding rule for dtype {dtype!r}: known are {known}") from error


def epsilon(dtype) -> float:
    """The machine epsilon of ``dtype`` (the gap between 1 and the next number)."""
    return EPSILON[as_torch_dtype(dtype)]


def softmax_bound(dtype, max_logit: float, kernels: int = 2) -> float:
    """Largest rounding difference between softmax weights computed in ``dtype``.

    Parameters
    ----------
    dtype : torch.dtype, numpy dtype or str
        The precision the weights were computed in.
    max_logit : float
        ``max |scale * q . k + bias|`` over the cells that were not blocked.
    kernels : {1, 2}
        1: one kernel against an exact (float64) recomputation; 2: two kernels against each
        other (each may be off by the one-kernel bound, in opposite directions).

    Returns
    -------
    float
        ``kernels * ULPS[dtype] * eps(dtype) * (1 + max_logit)``; see the module docstring.
    """
    if kernels not in (1, 2):
        raise ValueError(f"kernels must be 1 or 2, not {kernels!r}")
    if not np.isfinite(max_logit) or max_logit < 0:
        raise ValueError(f"max_logit must be a finite magnitude, not {max_logit!r}")
    torch_dtype = as_torch_dtype(dtype)
    return kernels * ULPS[torch_dtype] * EPSILON[torch_dtype] * (1.0 + float(max_logit))


def max_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    blocked: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> float:
    """``max |scale * q . k + bias|`` over the cells not ``blocked``, in float64.

    ``q`` is ``(..., L, E)``, ``k`` ``(..., S, E)``; ``blocked`` and ``bias`` broadcast to
    ``(..., L, S)``. A row with every cell blocked contributes nothing.
    """
    with torch.no_grad():
        logits = (q.double() @ k.double().transpose(-2, -1)) * scale  # (..., L, S)
        if bias is not None:
            logits = logits + bias.double()
        magnitude = logits.abs()
        if blocked is not None:
            magnitude = magnitude.masked_fill(blocked.to(magnitude.device), 0.0)
        magnitude = magnitude.nan_to_num(0.0, posinf=0.0, neginf=0.0)
        return float(magnitude.max()) if magnitude.numel() else 0.0

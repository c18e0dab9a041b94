"""Corrupted inputs for patching: a span of a sequence replaced by its mean or by zeros.

A corrupted input keeps the clean input's shape (patching exchanges a head's tensors
between two runs of the same shapes); only the cells of the span change.
"""

from __future__ import annotations

import torch

FILLS = ("mean", "zeros")


def replace_span(x: torch.Tensor, start: int, stop: int, fill: str = "mean") -> torch.Tensor:
    """``x`` ``(batch, position, ...)`` with positions ``start:stop`` replaced by their mean
    over the span (``fill="mean"``, per sample and feature) or by zeros; a new tensor.

    Raises
    ------
    ValueError
        An empty or out-of-range span, an unknown fill, a tensor that is not floating.
    """
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r}: a span is replaced by one of {FILLS}")
    if not x.is_floating_point() or x.dim() < 2:
        raise ValueError(
            f"a span is replaced in a floating (batch, position, ...) input; this one is "
            f"{x.dtype} of shape {tuple(x.shape)}"
        )
    length = x.shape[1]
    if not 0 <= start < stop <= length:
        raise ValueError(f"span {start}:{stop} is not inside the {length} positions")
    corrupted = x.clone()
    span = corrupted[:, start:stop]
    span.copy_(span.mean(dim=1, keepdim=True).expand_as(span) if fill == "mean" else 0.0)
    return corrupted

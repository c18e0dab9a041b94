"""A dense and a virtual trace of the same numbers, for tests that compare the two forms."""

from __future__ import annotations

import torch

from attnpanel.kernels import attention


def padded_pair(length: int = 300):
    """A dense and a virtual trace of the same q, k and mask (diagonal and, per sample,
    padded keys): the dense one holds the model's weights, the virtual one only lse."""
    from attnpanel.kernels import masks, tiles
    from attnpanel.traces.build import build_trace

    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 3, length, 8, generator=generator) * 2 for _ in range(2))
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, length - 40 :] = True
    blocked = masks.build_mask("diagonal", length)[None, None] | padding[:, None, None, :]
    scale = 8**-0.5
    _, weights = attention.attend(q, k, blocked, scale)
    _, lse = tiles.attention(q, k, q, masks.Masking("diagonal", key_padding=padding), scale)
    common = dict(q=q, k=k, blocked=blocked, scale=scale)
    return build_trace(weights=weights, **common), build_trace(lse=lse, **common)


def long_layer_pair(length: int = 600):
    """A diagonal layer's dense trace (the model's weights) and virtual trace (lse) of the
    same input: the small stand-in for a long sequence that the served tests explore."""
    from attnpanel.kernels.attention import MultiHeadSelfAttention
    from attnpanel.traces.build import trace

    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(48, 4, "diagonal").eval()
    x = torch.randn(1, length, 48, generator=torch.Generator().manual_seed(1)) * 2
    return trace(layer, x, dense=True), trace(layer, x, dense=False)

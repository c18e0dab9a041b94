"""Multi-head self-attention faithful to NILMFormer, with every intermediate exposed.

The layer mirrors the einsum path of ``DiagonnalyMaskedSelfAttention`` in NILMFormer
(Petralia et al., "NILMFormer: Non-Intrusive Load Monitoring that Accounts for
Non-Stationarity", KDD 2025; ``src/nilmformer/layers/transformer.py``): four bias-free
projections ``wq, wk, wv, wo``, scores ``q . k`` per head, scale ``head_dim ** -0.5``,
a mask, softmax, value aggregation, head merge and the output projection.

Deliberate differences from that source:

* masked scores are filled with ``-1e4`` (finite, safe in float16) and the masked weights
  are then set to exactly 0, so a masked cell never carries probability mass;
* masks are built once per (mode, length, device) and cached, not rebuilt on every call;
* :meth:`MultiHeadSelfAttention.forward` runs the fused kernel
  (``F.scaled_dot_product_attention``), which gives the same output without materialising
  the ``(B, H, L, S)`` weights (at inference from :data:`BOUNDED_LENGTH` positions on,
  :func:`attnpanel.kernels.tiles.attention`, which builds no ``(L, L)`` mask either), while
  :meth:`MultiHeadSelfAttention.stages` runs the plain path step by step and keeps
  every intermediate (as nanoGPT keeps both paths);
* before materialising attention tensors the layer checks that they fit in memory and
  raises a ``ValueError`` naming the sizes instead of letting the allocator fail.

Shapes use ``B`` batch, ``H`` heads, ``L`` query positions, ``S`` key positions,
``E`` head dim and ``D`` model dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnpanel.kernels.masks import (
    MASK_FILL,
    MASK_MODES,
    build_mask,
    cached_mask,
    is_cached_diagonal,
)
from attnpanel.kernels.memory import check_attention_size

# How a row of scaled products becomes weights: a softmax, or (a linear attention's
# ``phi(q) . phi(k)``, non-negative) each divided by the row's sum.
NORMALISERS = ("softmax", "row sum")
BOUNDED_LENGTH = 4096  # from here on, forward() at inference never builds an (L, L) mask
_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


@dataclass
class AttentionConfig:
    """Hyper-parameters of one attention layer; the defaults are NILMFormer's."""

    d_model: int = 96  # width of the residual stream (D)
    n_heads: int = 8  # number of heads (H); head_dim = d_model // n_heads = 12
    mask: str = "diagonal"  # "none", "diagonal" (NILMFormer) or "causal"
    dropout: float = 0.2  # on the attention weights and on the output, as NILMFormer
    bias: bool = False  # NILMFormer's projections have no bias


@dataclass
class AttentionStages:
    """Every intermediate tensor of one forward pass."""

    q: torch.Tensor  # (B, H, L, E)
    k: torch.Tensor  # (B, H, S, E)
    v: torch.Tensor  # (B, H, S, E)
    scores: torch.Tensor  # (B, H, L, S) raw q . k, not scaled
    weights: torch.Tensor  # (B, H, L, S) softmax after masking, masked cells exactly 0
    context: torch.Tensor  # (B, H, L, E) weights @ v per head
    output: torch.Tensor  # (B, L, D) after head merge and wo
    mask: torch.Tensor | None  # (L, S) bool, True = blocked; None when nothing is blocked


def _fill_blocked_(t: torch.Tensor, blocked: torch.Tensor, value: float) -> None:
    """Fill the blocked cells of ``(..., L, S)`` in place."""
    if is_cached_diagonal(blocked):
        t.diagonal(dim1=-2, dim2=-1).fill_(value)  # touches L cells per map, not L * S
        return
    if blocked.shape == t.shape[-2:] and t.is_contiguous():
        cells = blocked.flatten().nonzero().squeeze(1)
        if cells.numel() * 16 <= blocked.numel():  # few cells (a diagonal, a band edge)
            t.view(*t.shape[:-2], -1).index_fill_(-1, cells, value)  # touches only those
            return
    t.masked_fill_(blocked, value)


def _masked_softmax_(logits: torch.Tensor, blocked: torch.Tensor | None, fill: float) -> None:
    """Softmax over the last dim in place; blocked cells end exactly 0."""
    if blocked is not None:
        _fill_blocked_(logits, blocked, fill)
    torch.softmax(logits, dim=-1, out=logits)
    if blocked is not None:
        _fill_blocked_(logits, blocked, 0.0)  # exact zeros, whatever the fill left


def _row_sum_(products: torch.Tensor, blocked: torch.Tensor | None) -> None:
    """Each row divided by its sum in place (a linear attention's normaliser); blocked
    cells, and a row whose every key is blocked, end exactly 0."""
    if blocked is not None:
        _fill_blocked_(products, blocked, 0.0)
    sums = products.sum(-1, keepdim=True)
    products.div_(sums.masked_fill(sums == 0, 1.0))


def _normalise_(logits, blocked, fill: float, normaliser: str) -> None:
    if normaliser == "softmax":
        _masked_softmax_(logits, blocked, fill)
    elif normaliser == "row sum":
        _row_sum_(logits, blocked)
    else:
        raise ValueError(f"unknown normaliser {normaliser!r}; expected one of {NORMALISERS}")


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor; on CPU backed by numpy.

    numpy madvises large allocations as transparent huge pages, which makes the first
    touch of a multi-hundred-MB attention tensor several times cheaper than torch's
    default CPU allocator; the trace then hands the same memory to xarray, copy-free.
    """
    if like.device.type == "cpu" and like.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[like.dtype]))
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    blocked: torch.Tensor | None,
    scale: float,
    dropout: nn.Module | None = None,
    bias: torch.Tensor | None = None,
    normaliser: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and masked softmax weights from per-head queries and keys.

    Parameters
    ----------
    q, k : torch.Tensor
        ``(B, H, L, E)`` and ``(B, H, S, E)``; leading dims may be dropped.
    blocked : torch.Tensor or None
        Bool, True = blocked: ``(L, S)`` or anything broadcastable to ``(B, H, L, S)``.
    scale : float
        Multiplier of the scores, ``head_dim ** -0.5``.
    dropout : nn.Module, optional
        Applied to the weights (a no-op in eval mode).
    bias : torch.Tensor, optional
        Added to the scaled scores before masking, broadcastable to ``(B, H, L, S)``
        (ALiBi, relative position biases, float masks).
    normaliser : {"softmax", "row sum"}
        How a row becomes weights: a softmax, or (a linear attention, whose q and k are
        its features ``phi(q)``, ``phi(k)``) each product divided by the row's sum.

    Returns
    -------
    scores, weights : torch.Tensor
        Raw ``q . k`` and the attention weights, both ``(B, H, L, S)``. Blocked cells are
        exactly 0, and so is a row whose every key is blocked.
    """
    # with a bias the logits have no floor, so blocked cells get -inf instead of -1e4
    fill = MASK_FILL if bias is None else -math.inf
    if normaliser != "softmax" and bias is not None:
        raise ValueError(f"a {normaliser!r} normaliser takes no additive bias")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if needs_grad:
        scores = q @ k.transpose(-2, -1)  # (B, H, L, S)
        logits = scores * scale
        if bias is not None:
            logits = logits + bias
        if normaliser == "row sum":
            kept = logits if blocked is None else logits.masked_fill(blocked, 0.0)
            sums = kept.sum(-1, keepdim=True)
            weights = kept / sums.masked_fill(sums == 0, 1.0)
        else:
            if blocked is not None:
                logits = logits.masked_fill(blocked, fill)
            weights = torch.softmax(logits, dim=-1)  # (B, H, L, S)
            if blocked is not None:
                weights = weights.masked_fill(blocked, 0.0)  # exact zeros, whatever was left
    else:
        # Without autograd only the two tensors that are returned are allocated: the
        # logits are built, masked and soft-maxed in place in the weights' memory.
        shape = (*q.shape[:-1], k.shape[-2])
        scores = torch.matmul(q, k.transpose(-2, -1), out=_empty(shape, q))  # (B, H, L, S)
        weights = torch.mul(scores, scale, out=_empty(shape, q))
        if bias is not None:
            weights += bias
        _normalise_(weights, blocked, fill, normaliser)  # (B, H, L, S)
    if dropout is not None:
        weights = dropout(weights)
    return scores, weights


@torch.no_grad()
def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    blocked: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
    normaliser: str = "softmax",
) -> torch.Tensor:
    """The weights of :func:`attend` alone, in one buffer: no scores tensor is kept.

    The same numbers as ``attend(q, k, blocked, scale, bias=bias)[1]`` without autograd
    (the scale is applied to the product in place), at half the memory.
    """
    lead = (
        q.shape[:-2]
        if q.shape[:-2] == k.shape[:-2]
        else torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    )
    shape = (*lead, q.shape[-2], k.shape[-2])
    weights = torch.matmul(q, k.transpose(-2, -1), out=_empty(shape, q))  # (B, H, L, S)
    weights.mul_(scale)
    if bias is not None:
        weights += bias
    _normalise_(weights, blocked, MASK_FILL if bias is None else -math.inf, normaliser)
    return weights


class MultiHeadSelfAttention(nn.Module):
    """NILMFormer's multi-head self-attention with selectable masking.

    Parameters
    ----------
    d_model : int
        Model width ``D``; must be divisible by ``n_heads``.
    n_heads : int
        Number of heads ``H``.
    mask : {"none", "diagonal", "causal"} or torch.Tensor
        Masking; a bool ``(L, L)`` tensor gives a custom mask (True = blocked).
    dropout : float
        Dropout on the attention weights and on the output.
    bias : bool
        Whether the four projections have a bias.
    """

    def __init__(
        self,
        d_model: int = 96,
        n_heads: int = 8,
        mask: str | torch.Tensor = "diagonal",
        dropout: float = 0.2,
        bias: bool = False,
    ):
        super().__init__()
        if n_heads < 1 or d_model < 1:
            raise ValueError(f"d_model ({d_model}) and n_heads ({n_heads}) must be positive")
        if d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) is not divisible by n_heads ({n_heads}): "
                f"each head needs an equal share of the {d_model} features"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.scale = self.head_dim**-0.5
        self.wq = nn.Linear(d_model, d_model, bias=bias)
        self.wk = nn.Linear(d_model, d_model, bias=bias)
        self.wv = nn.Linear(d_model, d_model, bias=bias)
        self.wo = nn.Linear(d_model, d_model, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.out_dropout = nn.Dropout(dropout)
        self._mask_cache: dict[tuple[int, torch.device], torch.Tensor | None] = {}
        self._allowed_cache: dict[tuple[int, torch.device], torch.Tensor | None] = {}
        self.mask = mask

    @property
    def mask(self) -> str | torch.Tensor:
        """The mask mode, or the custom bool mask tensor."""
        return self._mask

    @mask.setter
    def mask(self, value: str | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() != 2 or value.shape[0] != value.shape[1]:
                raise ValueError(f"a mask tensor must be square (L, L), got {tuple(value.shape)}")
            build_mask(value, value.shape[0])
            value = value.detach().clone()  # a later in-place edit by the caller must not leak in
        elif not isinstance(value, str) or value not in MASK_MODES:
            raise ValueError(
                f"unknown mask {value!r}; expected one of {MASK_MODES} or a bool tensor"
            )
        self._mask = value
        self._mask_cache = {}
        self._allowed_cache = {}

    @property
    def mask_name(self) -> str:
        """``"none"``, ``"diagonal"``, ``"causal"`` or ``"custom"``."""
        return "custom" if isinstance(self._mask, torch.Tensor) else self._mask

    def blocked(self, length: int, device=None) -> torch.Tensor | None:
        """The cached ``(L, L)`` bool mask for a sequence length (True = blocked).

        The same tensor object is returned on every call for a (length, device); it is
        rebuilt only when :attr:`mask` is set. Treat it as read-only.
        """
        key = (int(length), torch.device(device or "cpu"))
        if key not in self._mask_cache:
            if isinstance(self._mask, torch.Tensor):
                self._mask_cache[key] = build_mask(self._mask, key[0], device=key[1])
            else:
                self._mask_cache[key] = cached_mask(self._mask, key[0], key[1])
        return self._mask_cache[key]

    def allowed(self, length: int, device=None) -> torch.Tensor | None:
        """The cached complement of :meth:`blocked` (True = attend), as SDPA wants it."""
        key = (int(length), torch.device(device or "cpu"))
        if key not in self._allowed_cache:
            blocked = self.blocked(*key)
            self._allowed_cache[key] = None if blocked is None else ~blocked
        return self._allowed_cache[key]

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, L, D) -> (B, H, L, E)``."""
        batch, length, _ = t.shape
        return t.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"input must have shape (batch, length, {self.d_model}), got {tuple(x.shape)}"
            )

    def stages(self, x: torch.Tensor) -> AttentionStages:
        """Run the layer step by step and return every intermediate.

        Parameters
        ----------
        x : torch.Tensor
            ``(B, L, D)`` input.

        Returns
        -------
        AttentionStages

        Raises
        ------
        ValueError
            If ``x`` has the wrong shape, or its ``(B, H, L, L)`` scores and weights would
            not fit in memory.
        """
        self._check_input(x)
        batch, length, _ = x.shape
        check_attention_size((batch, self.n_heads, length, length), x.dtype, 2, x.device)
        blocked = self.blocked(length, x.device)
        q = self.split_heads(self.wq(x))  # (B, H, L, E)
        k = self.split_heads(self.wk(x))  # (B, H, S, E)
        v = self.split_heads(self.wv(x))  # (B, H, S, E)
        scores, weights = attend(q, k, blocked, self.scale, self.attn_dropout)  # (B, H, L, S)
        context = weights @ v  # (B, H, L, E)
        merged = context.transpose(1, 2).reshape(batch, length, self.d_model)  # (B, L, D)
        output = self.out_dropout(self.wo(merged))  # (B, L, D)
        return AttentionStages(q, k, v, scores, weights, context, output, blocked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, D) -> (B, L, D)`` through the fused attention kernel.

        Equal to ``self.stages(x).output`` up to float rounding; dropout on the weights is
        SDPA's ``dropout_p``, as in the plain path.
        """
        self._check_input(x)
        batch, length, _ = x.shape
        q = self.split_heads(self.wq(x))  # (B, H, L, E)
        k = self.split_heads(self.wk(x))  # (B, H, S, E)
        v = self.split_heads(self.wv(x))  # (B, H, S, E)
        if self._bounded(length, q):
            from attnpanel.kernels import masks as masks_module
            from attnpanel.kernels import tiles

            context, _ = tiles.attention(q, k, v, masks_module.Masking(self.mask), self.scale)
        else:
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=self.allowed(length, x.device),
                dropout_p=self.attn_dropout.p if self.training else 0.0,
                scale=self.scale,
            )  # (B, H, L, E)
        merged = context.transpose(1, 2).reshape(batch, length, self.d_model)  # (B, L, D)
        return self.out_dropout(self.wo(merged))  # (B, L, D)

    def _bounded(self, length: int, q: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs in bounded memory
        (:func:`attnpanel.kernels.tiles.attention`):
        at inference, under a mask mode, from :data:`BOUNDED_LENGTH` positions on, where the
        ``(L, L)`` mask the fused kernel would take costs more than the attention."""
        return (
            length >= BOUNDED_LENGTH
            and not self.training
            and not (torch.is_grad_enabled() and q.requires_grad)
            and self.mask_name != "custom"
        )

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, mask={self.mask_name!r}"

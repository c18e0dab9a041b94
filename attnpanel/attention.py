"""Multi-head self-attention faithful to NILMFormer, with every intermediate exposed.

The layer mirrors the einsum path of ``DiagonnalyMaskedSelfAttention`` in NILMFormer
(Petralia et al., "NILMFormer: Non-Intrusive Load Monitoring that Accounts for
Non-Stationarity", KDD 2025; ``src/nilmformer/layers/transformer.py``): four bias-free
projections ``wq, wk, wv, wo``, scores ``q . k`` per head, scale ``head_dim ** -0.5``,
a mask, softmax, value aggregation, head merge and the output projection.

Two deliberate differences from that source:

* masked scores are filled with ``-1e4`` (finite, safe in float16) and the masked weights
  are then set to exactly 0, so a masked cell never carries probability mass;
* masks are built once per (length, device) and cached, not rebuilt on every call.

Shapes use ``B`` batch, ``H`` heads, ``L`` query positions, ``S`` key positions,
``E`` head dim and ``D`` model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MASK_MODES = ("none", "diagonal", "causal")
MASK_FILL = -1e4


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


def build_mask(mask: str | torch.Tensor, length: int, device=None) -> torch.Tensor | None:
    """Return the boolean ``(length, length)`` mask for a mode, True where blocked.

    Parameters
    ----------
    mask : {"none", "diagonal", "causal"} or torch.Tensor
        A mode name, or a boolean tensor of shape ``(length, length)``.
    length : int
        Sequence length ``L``.
    device : torch.device, optional
        Where the mask lives.

    Returns
    -------
    torch.Tensor or None
        ``None`` for ``"none"``; otherwise a bool tensor.

    Raises
    ------
    ValueError
        For an unknown mode, a tensor of the wrong shape or dtype, or a mask that blocks
        every key of some query (its softmax row would be undefined).
    """
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise ValueError(f"a mask tensor must be bool (True = blocked), got {mask.dtype}")
        if tuple(mask.shape) != (length, length):
            raise ValueError(
                f"mask has shape {tuple(mask.shape)} but the sequence needs ({length}, {length})"
            )
        blocked = mask.to(device)
    elif mask == "none":
        return None
    elif mask == "diagonal":
        blocked = torch.eye(length, dtype=torch.bool, device=device)
    elif mask == "causal":
        blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    else:
        raise ValueError(f"unknown mask {mask!r}; expected one of {MASK_MODES} or a bool tensor")
    full_rows = blocked.all(dim=-1)
    if bool(full_rows.any()):
        row = int(full_rows.nonzero()[0, 0])
        raise ValueError(
            f"mask blocks every key of query {row} (length {length}); "
            "each query needs at least one visible key"
        )
    return blocked


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    blocked: torch.Tensor | None,
    scale: float,
    dropout: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and masked softmax weights from per-head queries and keys.

    Parameters
    ----------
    q, k : torch.Tensor
        ``(B, H, L, E)`` and ``(B, H, S, E)``; leading dims may be dropped.
    blocked : torch.Tensor or None
        ``(L, S)`` bool, True = blocked.
    scale : float
        Multiplier of the scores, ``head_dim ** -0.5``.
    dropout : nn.Module, optional
        Applied to the weights (a no-op in eval mode).

    Returns
    -------
    scores, weights : torch.Tensor
        Raw ``q . k`` and the attention weights, both ``(B, H, L, S)``.
    """
    scores = torch.einsum("...le,...se->...ls", q, k)  # (B, H, L, S)
    logits = scores * scale
    if blocked is not None:
        logits = logits.masked_fill(blocked, MASK_FILL)
    weights = torch.softmax(logits, dim=-1)  # (B, H, L, S)
    if blocked is not None:
        weights = weights.masked_fill(blocked, 0.0)  # exact zeros, whatever the fill left
    if dropout is not None:
        weights = dropout(weights)
    return scores, weights


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
        elif value not in MASK_MODES:
            raise ValueError(f"unknown mask {value!r}; expected one of {MASK_MODES} or a bool tensor")
        self._mask = value
        self._mask_cache = {}

    @property
    def mask_name(self) -> str:
        """``"none"``, ``"diagonal"``, ``"causal"`` or ``"custom"``."""
        return "custom" if isinstance(self._mask, torch.Tensor) else self._mask

    def blocked(self, length: int, device=None) -> torch.Tensor | None:
        """The cached ``(L, L)`` bool mask for a sequence length."""
        key = (length, torch.device(device or "cpu"))
        if key not in self._mask_cache:
            self._mask_cache[key] = build_mask(self._mask, length, device=key[1])
        return self._mask_cache[key]

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, L, D) -> (B, H, L, E)``."""
        batch, length, _ = t.shape
        return t.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def stages(self, x: torch.Tensor) -> AttentionStages:
        """Run the layer and return every intermediate.

        Parameters
        ----------
        x : torch.Tensor
            ``(B, L, D)`` input.

        Returns
        -------
        AttentionStages
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"input must have shape (batch, length, {self.d_model}), got {tuple(x.shape)}"
            )
        batch, length, _ = x.shape
        blocked = self.blocked(length, x.device)
        q = self.split_heads(self.wq(x))  # (B, H, L, E)
        k = self.split_heads(self.wk(x))  # (B, H, S, E)
        v = self.split_heads(self.wv(x))  # (B, H, S, E)
        scores, weights = attend(q, k, blocked, self.scale, self.attn_dropout)  # (B, H, L, S)
        context = torch.einsum("bhls,bhse->bhle", weights, v)  # (B, H, L, E)
        merged = context.transpose(1, 2).reshape(batch, length, self.d_model)  # (B, L, D)
        output = self.out_dropout(self.wo(merged))  # (B, L, D)
        return AttentionStages(q, k, v, scores, weights, context, output, blocked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, D) -> (B, L, D)``."""
        return self.stages(x).output

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, mask={self.mask_name!r}"

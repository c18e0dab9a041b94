"""What role a head plays, per sample: the sums behind TransformerLens' head detector, and
the offset a head puts most weight on, accumulated block by block.

For one sample's real queries ``i`` and keys ``j`` (padded queries left out), with ``a_ij``
the weights and ``D`` a 0/1 detection pattern, TransformerLens' ``"mul"`` score is
``sum_ij a_ij D_ij / sum_ij a_ij`` (``head_detector.compute_head_attention_similarity_score``),
where ``exclude_bos`` zeroes the first real key's column and ``exclude_current_token`` the
diagonal of ``a`` first. The patterns (its ``get_*_detection_pattern``):

=====================  =========================================================
``previous_token``     ``D_ij = 1`` where ``j = i - 1``
``duplicate_token``    ``D_ij = 1`` where ``j < i`` and token ``j`` is token ``i``
``induction``          ``D_ij = 1`` where ``1 <= j <= i`` and token ``j - 1`` is token ``i``
=====================  =========================================================

``offset`` is the ``d = i - j`` whose diagonal holds the most weight, ``sum_i a_i,i-d``
over the real queries, and ``offset_weight`` that weight over all their weight ``sum a``
(the number of real queries where no real query is blocked from every key):
"looks ``d`` steps back" (``d < 0``: ahead). A head's diagonals are summed by a strided
view of its block padded on both sides (no loop over offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_ROLES = ("duplicate_token", "induction")
ROLE_NAMES = ("previous_token", "duplicate_token", "induction", "offset", "offset_weight")


@dataclass(frozen=True)
class RoleInputs:
    """What the role sums need beyond the weights."""

    tokens: torch.Tensor | None = None  # (B, L) token ids (or any comparable labels' codes)
    exclude_bos: bool = False  # TransformerLens' exclude_bos: the first real key left out
    exclude_current_token: bool = False  # ... and the diagonal


class RoleSums:
    """The role sums of every head-sample, block by block.

    Parameters
    ----------
    inputs : RoleInputs
    heads : int
    first : torch.Tensor
        ``(B,)`` each sample's first real key.
    real : torch.Tensor
        ``(B, L)`` bool, True at each sample's real queries.
    """

    def __init__(self, inputs: RoleInputs, heads: int, first: torch.Tensor, real: torch.Tensor):
        self.inputs, self.heads, self.first, self.real = inputs, heads, first, real
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, part: slice, a: torch.Tensor) -> None:
        """Accumulate a block ``a`` ``(n, L, S)`` of head-samples ``part`` (in ``B * H``
        order)."""
        length, keys = a.shape[-2:]
        index = torch.arange(part.start, part.stop, device=a.device)
        sample = index // self.heads
        real = self.real.to(a.device)[sample]  # (n, L)
        a = a * real[..., None].to(a.dtype)  # padded queries carry nothing
        mass = a.sum(dim=(-2, -1), dtype=torch.float64)  # (n,): TransformerLens' sum(a)
        first = self.first.to(a.device)[sample]  # (n,)
        rows = torch.arange(length, device=a.device)
        at_first = a.gather(-1, first[:, None, None].expand(-1, length, 1))[..., 0]  # (n, L)
        square = length == keys
        diagonal = torch.diagonal(a, dim1=-2, dim2=-1) if square else None
        total = mass.clone()
        if self.inputs.exclude_bos:
            total -= at_first.sum(-1, dtype=torch.float64)
        if self.inputs.exclude_current_token and square:
            total -= diagonal.sum(-1, dtype=torch.float64)
            if self.inputs.exclude_bos:  # the cell (first, first), taken out twice
                total += at_first.gather(-1, first[:, None].clamp_max(length - 1))[:, 0].double()
        found = {"total": total}
        if square:
            previous = torch.diagonal(a, offset=-1, dim1=-2, dim2=-1).sum(-1, dtype=torch.float64)
            if self.inputs.exclude_bos:  # a_{first + 1, first} sits in the excluded column
                after = (first + 1).clamp_max(length - 1)
                cell = a[torch.arange(len(first)), after, first].double()
                previous -= torch.where(first + 1 < length, cell, 0.0)
            found["previous_token"] = previous
            tiny = torch.finfo(torch.float64).tiny
            shares = _diagonal_sums(a) / mass.clamp_min(tiny)[:, None]  # (n, 2L - 1)
            weight, where = shares.max(dim=-1)
            found["offset"] = (length - 1 - where).to(torch.float64)
            found["offset_weight"] = weight
        if self.inputs.tokens is not None and square:
            tokens = self.inputs.tokens.to(a.device)[sample]  # (n, L)
            for name, pattern in _token_patterns(tokens, rows).items():
                if self.inputs.exclude_bos:
                    pattern = (
                        pattern
                        & (torch.arange(keys, device=a.device) != first[:, None])[:, None, :]
                    )
                if self.inputs.exclude_current_token:
                    pattern = pattern & (rows[:, None] != rows[None, :])
                found[name] = (a * pattern).sum(dim=(-2, -1), dtype=torch.float64)
        for name, value in found.items():
            self.parts.setdefault(name, []).append(value)

    def result(self, batch: int, heads: int) -> dict[str, torch.Tensor]:
        """Each role statistic ``(B, H)`` float64 (NaN where it cannot be had: the token
        roles without tokens, every role of a cross-attention)."""
        whole = {name: torch.cat(parts).reshape(batch, heads) for name, parts in self.parts.items()}
        total = whole.pop("total").clamp_min(torch.finfo(torch.float64).tiny)
        nan = torch.full((batch, heads), float("nan"), dtype=torch.float64)
        found = {}
        for name in ROLE_NAMES:
            if name not in whole:
                found[name] = nan
            elif name in ("offset", "offset_weight"):
                found[name] = whole[name]
            else:
                found[name] = whole[name] / total
        return found


def _diagonal_sums(a: torch.Tensor) -> torch.Tensor:
    """``(n, 2L - 1)``: entry ``d'`` sums ``a[i, i + d' - (L - 1)]`` over ``i`` (offset
    ``i - j = L - 1 - d'``), read through a strided view of the rows padded with ``L - 1``
    zeros on each side (an index past a row lands in its padding, never the next row)."""
    n, length, keys = a.shape
    padded = torch.nn.functional.pad(a, (length - 1, length - 1))  # (n, L, S + 2L - 2)
    width = padded.shape[-1]
    view = padded.as_strided((n, 2 * length - 1, length), (length * width, 1, width + 1))
    return view.sum(-1, dtype=torch.float64)


def _token_patterns(tokens: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """TransformerLens' duplicate-token and induction patterns ``(n, L, L)`` of each row's
    tokens."""
    same = tokens[:, :, None] == tokens[:, None, :]  # token i is token j
    before = rows[None, :] < rows[:, None]  # j < i
    duplicate = same & before
    # induction: token j - 1 is token i, 1 <= j <= i
    shifted = torch.nn.functional.pad(duplicate, (1, 0))[..., :-1]
    return {"duplicate_token": duplicate, "induction": shifted & (rows[None, :] <= rows[:, None])}

"""Where each head sits in a tensor of an attention site, whatever its layout.

A :class:`Lane` names the axes of a tensor that hold the attention's leading dims (whose
flattening is ``(B, H)``: batch, then heads) and its position axis (queries for q, weights
and the output, keys for k and v). Gating, patching and probing a head are the same three
lines on any layout: a per-head vector or mask shaped onto those axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def split_lead(lead: Sequence[int], batch_hint: int | None) -> tuple[int, int]:
    """``(B, H)`` of an attention's leading dims: ``(B, H)`` as they are, or a flattened
    ``(B * H)`` split by the batch of the module's first input."""
    lead = tuple(int(s) for s in lead)
    if len(lead) == 2:
        return lead
    count = math.prod(lead)
    if batch_hint and len(lead) == 1 and count % batch_hint == 0:
        return batch_hint, count // batch_hint
    if lead:
        return lead[0], count // lead[0]
    return 1, 1


@dataclass(frozen=True)
class Lane:
    """The head and position axes of one tensor of an attention site.

    ``lead`` are the attention's leading dims as they sit at ``lead_axes`` of the tensor
    (flattened they are ``(batch, heads)``); ``position_axis`` is its query or key axis.
    """

    lead: tuple[int, ...]
    lead_axes: tuple[int, ...]
    position_axis: int
    batch: int
    heads: int

    @classmethod
    def leading(cls, t: torch.Tensor, lead, batch_hint: int | None, width: int = 2) -> Lane:
        """The lane of a ``(*lead, n, ...)`` tensor whose leading dims come first (``width``
        trailing dims: 2 for ``(n, E)``)."""
        lead = tuple(int(s) for s in lead)
        batch, heads = split_lead(lead, batch_hint)
        axes = tuple(range(len(lead)))
        return cls(lead, axes, t.dim() - width, batch, heads)

    def per_head(self, vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """An ``(H,)`` vector shaped to broadcast against ``like`` on this lane (its lead
        dims may sit in ``like`` in any order: heads before the batch, say)."""
        full = vector.to(like.device).repeat(self.batch).reshape(self.lead)
        order = sorted(range(len(self.lead_axes)), key=lambda i: self.lead_axes[i])
        full = full.permute(*order)  # the lead dims in the order of their axes in ``like``
        shape = [1] * like.dim()
        for i in order:
            shape[self.lead_axes[i]] = self.lead[i]
        return full.reshape(shape)

    def selection(
        self, like: torch.Tensor, heads: Sequence[int], positions: Sequence[int] | None = None
    ) -> torch.Tensor:
        """A bool mask broadcastable to ``like``: True on ``heads`` (at ``positions`` only,
        when given)."""
        chosen = torch.zeros(self.heads, dtype=torch.bool, device=like.device)
        chosen[list(heads)] = True
        mask = self.per_head(chosen, like)
        if positions is not None:
            at = torch.zeros(like.shape[self.position_axis], dtype=torch.bool, device=like.device)
            at[list(positions)] = True
            shape = [1] * like.dim()
            shape[self.position_axis] = at.numel()
            mask = mask & at.reshape(shape)
        return mask

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``(B, H, n, *rest)``: batch, heads, positions, then its other axes."""
        rest = [a for a in range(t.dim()) if a not in (*self.lead_axes, self.position_axis)]
        ordered = t.permute(*self.lead_axes, self.position_axis, *rest)
        return ordered.reshape(self.batch, self.heads, *ordered.shape[len(self.lead) :])

"""What a head does on one sample, in a few numbers: the statistics a survey keeps.

For each sample and head, over the sample's real queries ``i`` (padded queries left out;
padded keys carry no weight), with ``a_ij`` the softmax weights:

=================  ========================================================================
``entropy``        mean of ``-sum_j a_ij ln a_ij`` (nats; ``0 ln 0 = 0``)
``distance``       mean of ``sum_j a_ij |i - j|``, in steps (``distance_time``: times the
                   input's step, where it has a clock)
``sink``           mean weight on the sample's first real key (attention sinks)
``diagonal_share`` mean of ``a_ii``
``previous_share`` mean of ``a_i,i-1`` over the real queries with a previous key
``max_weight``     mean of ``max_j a_ij``
=================  ========================================================================

The same on the value-weighted rows (Kobayashi et al. 2020): ``a_ij || v_j W_o^h ||``
renormalised to sum to 1 per row (``|| v_j ||`` where ``w_o`` is unknown), prefixed
``vw_``. Each is computed in float64 per row and averaged, from the model's own weights.
"""

from __future__ import annotations

import torch

NAMES = ("entropy", "distance", "sink", "diagonal_share", "previous_share", "max_weight")
CHUNK_CELLS = 1 << 22  # cells processed at a time (float64: 32 MB a temporary)


def _row_values(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each statistic but the sink per row, ``(B, H, L)`` float64, of ``(B, H, L, S)``."""
    a = weights.to(torch.float64)
    length, keys = a.shape[-2], a.shape[-1]
    queries = torch.arange(length, dtype=torch.float64).unsqueeze(-1)
    steps = (queries - torch.arange(keys, dtype=torch.float64)).abs()  # (L, S)
    logs = torch.where(a > 0, torch.log(torch.where(a > 0, a, 1.0)), 0.0)
    rows = torch.arange(length)
    index = rows
    diagonal = torch.zeros(a.shape[:-1], dtype=torch.float64)
    previous = torch.zeros(a.shape[:-1], dtype=torch.float64)
    inside = index < keys
    diagonal[..., inside] = a[..., rows[inside], index[inside]]
    before = (index >= 1) & (index - 1 < keys)
    previous[..., before] = a[..., rows[before], index[before] - 1]
    return {
        "entropy": -(a * logs).sum(-1),
        "distance": (a * steps).sum(-1),
        "diagonal_share": diagonal,
        "previous_share": previous,
        "max_weight": a.amax(-1),
    }


def head_statistics_of(
    weights: torch.Tensor,
    padding: torch.Tensor | None = None,
    norms: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every statistic of :data:`NAMES` per sample and head, ``(B, H)`` float64.

    Parameters
    ----------
    weights : torch.Tensor
        ``(B, H, L, S)`` softmax weights (blocked cells 0), self-attention (``L == S``) or
        not (then ``diagonal_share``, ``previous_share`` and ``distance`` compare indices).
    padding : torch.Tensor, optional
        ``(B, S)`` bool, True at padded positions: their queries are left out, and the
        first real key is the sink.
    norms : torch.Tensor, optional
        ``(B, H, S)`` the value norms ``|| v_j W_o^h ||``: the statistics of the
        value-weighted rows, prefixed ``vw_``, too.
    """
    batch, heads, length, keys = weights.shape
    real = torch.ones(batch, length, dtype=torch.bool)
    first = torch.zeros(batch, dtype=torch.long)
    if padding is not None:
        padding = padding.to(torch.bool)
        if length == keys:
            real = ~padding
        first = (~padding).to(torch.int8).argmax(dim=1)  # the first real key
    found: dict[str, list[torch.Tensor]] = {}
    rows = max(1, CHUNK_CELLS // max(1, heads * length * keys))
    for start in range(0, batch, rows):
        part = slice(start, start + rows)
        blocks = {"": weights[part]}
        if norms is not None:
            weighted = weights[part].to(torch.float64) * norms[part].to(torch.float64)[:, :, None]
            sums = weighted.sum(-1, keepdim=True)
            blocks["vw_"] = torch.where(sums > 0, weighted / torch.where(sums > 0, sums, 1.0), 0.0)
        for prefix, block in blocks.items():
            values = _row_values(block)
            take = first[part][:, None, None, None].expand(-1, heads, length, 1)
            values["sink"] = block.to(torch.float64).gather(-1, take)[..., 0]
            mask = real[part][:, None, :].to(torch.float64)  # (b, 1, L)
            previous = mask.clone()
            previous[..., 0] = 0.0
            if padding is not None and length == keys:
                previous[..., 1:] *= (~padding[part][:, None, :-1]).to(torch.float64)
            for name in NAMES:
                weight = previous if name == "previous_share" else mask
                count = weight.sum(-1).clamp_min(1.0)
                mean = (values[name] * weight).sum(-1) / count
                found.setdefault(prefix + name, []).append(mean)
    return {name: torch.cat(parts) for name, parts in found.items()}

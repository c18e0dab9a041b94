"""What a head does on one sample, in a few numbers: the statistics a survey keeps.

For each sample and head, over the sample's real queries ``i`` (padded queries left out;
padded keys carry no weight), with ``a_ij`` the softmax weights:

=================  ========================================================================
``entropy``        mean of ``-sum_j a_ij ln a_ij`` (nats; ``0 ln 0 = 0``)
``distance``       mean of ``sum_j a_ij |i - j|``, in steps (``distance_time``: times the
                   input's step, where it has a clock)
``sink``           mean weight on the sample's first real key (attention sinks)
``diagonal_share`` mean of ``a_ii``
``previous_share`` mean of ``a_i,i-1`` over the real queries whose previous key is real
``max_weight``     mean of ``max_j a_ij``
=================  ========================================================================

The same on the value-weighted rows (Kobayashi et al. 2020): ``w_ij = a_ij || v_j W_o^h ||``
renormalised to sum to 1 per row (``|| v_j ||`` where ``w_o`` is unknown), prefixed
``vw_``. The renormalisation is folded in (``-sum w~ ln w~ = ln Z - sum w ln w / Z`` with
``Z = sum_j w_ij``), so no normalised copy is made.

The cells are read in blocks of rows that stay in cache (:data:`CHUNK_CELLS`), in the
weights' own float32: each row's sums are over at most ``S`` terms, and the means over
rows are taken in float64.
"""

from __future__ import annotations

import torch

NAMES = ("entropy", "distance", "sink", "diagonal_share", "previous_share", "max_weight")
CHUNK_CELLS = 1 << 19  # cells of one block of head-samples (2 MB in float32)


TINY = 1e-38  # a weight of 0 has ln 0 -> this, times 0: 0 (0 ln 0 = 0)


def _block(a: torch.Tensor, steps: torch.Tensor, norms: torch.Tensor | None) -> dict:
    """Per row of a block ``a`` ``(n, L, S)`` of head-samples: the sums each statistic
    averages, plain and (with ``norms`` ``(n, S)``) value-weighted."""
    logs = torch.log(a.clamp_min(TINY))
    found = {
        "entropy": -torch.linalg.vecdot(a, logs),
        "distance": torch.linalg.vecdot(a, steps),
        "max_weight": a.amax(-1),
    }
    if norms is not None:
        w = a * norms[:, None, :]
        total = w.sum(-1)
        safe = torch.where(total > 0, total, 1.0)
        # -sum w~ ln w~ with w~ = w / Z and ln w = ln a + ln n: ln Z - sum w (ln a + ln n) / Z
        weighted_logs = (norms * torch.log(norms.clamp_min(TINY)))[:, None, :]  # n ln n
        mixed = torch.linalg.vecdot(w, logs) + torch.linalg.vecdot(a, weighted_logs)
        found["vw_entropy"] = torch.where(total > 0, torch.log(safe) - mixed / safe, 0.0)
        found["vw_distance"] = torch.linalg.vecdot(w, steps) / safe
        found["vw_max_weight"] = w.amax(-1) / safe
        found["vw_total"] = safe
    return found


def _row_statistics(
    weights: torch.Tensor, first: torch.Tensor, norms: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Each statistic per row, ``(B, H, L)``; ``first``: each sample's first real key."""
    batch, heads, length, keys = weights.shape
    flat = weights.reshape(batch * heads, length, keys)
    scale = None if norms is None else norms.reshape(batch * heads, keys).to(weights.dtype)
    rows = torch.arange(length)
    steps = (rows[:, None] - torch.arange(keys)[None, :]).abs().to(weights.dtype)  # (L, S)
    per = max(1, CHUNK_CELLS // max(1, length * keys))
    found: dict[str, list[torch.Tensor]] = {}
    for start in range(0, batch * heads, per):
        part = slice(start, start + per)
        for name, value in _block(
            flat[part], steps, None if scale is None else scale[part]
        ).items():
            found.setdefault(name, []).append(value)
    values = {name: torch.cat(parts) for name, parts in found.items()}  # (B H, L)
    # single cells: the sink, the diagonal and the previous key, plain and weighted
    sinks = first.repeat_interleave(heads)[:, None, None].expand(-1, length, 1)
    own, before = rows.clamp_max(keys - 1), (rows - 1).clamp(0, keys - 1)
    cells = {
        "sink": flat.gather(-1, sinks)[..., 0],
        "diagonal_share": torch.where(rows < keys, flat[:, rows, own], 0.0),
        "previous_share": torch.where((rows >= 1) & (rows - 1 < keys), flat[:, rows, before], 0.0),
    }
    if scale is not None:
        total = values.pop("vw_total")
        key_norm = {
            "sink": scale.gather(-1, sinks[:, :, 0]),
            "diagonal_share": scale[:, own],
            "previous_share": scale[:, before],
        }
        for name, cell in list(cells.items()):
            cells["vw_" + name] = cell * key_norm[name] / total
    values.update(cells)
    return {name: value.reshape(batch, heads, length) for name, value in values.items()}


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
    if not weights.is_floating_point() or weights.dtype in (torch.float16, torch.bfloat16):
        weights = weights.float()
    real = torch.ones(batch, length, dtype=torch.bool)
    first = torch.zeros(batch, dtype=torch.long)
    previous = real.clone()
    if padding is not None:
        padding = padding.to(torch.bool)
        if length == keys:
            real = ~padding
            previous = real.clone()
            previous[:, 1:] &= ~padding[:, :-1]
        first = (~padding).to(torch.int8).argmax(dim=1)  # the first real key
    previous[:, 0] = False
    rows = _row_statistics(weights, first, norms)
    found = {}
    for name, values in rows.items():
        weight = (previous if name.endswith("previous_share") else real).to(torch.float64)
        count = weight.sum(-1, keepdim=True).clamp_min(1.0)  # (B, 1)
        found[name] = (values.to(torch.float64) * weight[:, None, :]).sum(-1) / count
    return found

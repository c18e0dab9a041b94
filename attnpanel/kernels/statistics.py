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

Where some keys are named tokens rather than time steps (``named``: NILMFormer's statistics
token, a CLS token; :mod:`attnpanel.traces.positions`), their queries are left out as
padded ones are, the sink is the first real key that is a step, a named key's weight adds no
distance (``|i - j|`` between a step and a token means nothing), and ``token_share`` is the
mean weight on the named keys (``distance / (1 - token_share)``: the distance of the weight
that lands on steps).

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

from attnpanel.kernels.roles import RoleInputs, RoleSums

NAMES = ("entropy", "distance", "sink", "diagonal_share", "previous_share", "max_weight")
CHUNK_CELLS = 1 << 19  # cells of one block of head-samples (2 MB in float32)


TINY = 1e-38  # a weight of 0 has ln 0 -> this, times 0: 0 (0 ln 0 = 0)


def _block(
    a: torch.Tensor, steps: torch.Tensor, norms: torch.Tensor | None, distance: bool = True
) -> dict:
    """Per row of a block ``a`` ``(n, L, S)`` of head-samples: the sums each statistic
    averages, plain and (with ``norms`` ``(n, S)``) value-weighted; ``distance=False``
    where the role sums give it (:meth:`RoleSums.distance`, one pass fewer)."""
    logs = torch.log(a.clamp_min(TINY))
    found = {"entropy": -torch.linalg.vecdot(a, logs), "max_weight": a.amax(-1)}
    if distance:
        found["distance"] = torch.linalg.vecdot(a, steps)
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


def _steps(length: int, keys: int, named: torch.Tensor | None, device, dtype) -> torch.Tensor:
    """``|i - j|`` ``(L, S)``, 0 in the columns of named keys (no distance to a token)."""
    rows = torch.arange(length, device=device)
    steps = (rows[:, None] - torch.arange(keys, device=device)[None, :]).abs().to(dtype)
    return steps if named is None else steps * (~named.to(device)).to(dtype)


def _token_share(a: torch.Tensor, named: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per row of ``a`` ``(n, L, S)``: the weight on named keys (none without them)."""
    if named is None:
        return {}
    return {"token_share": torch.linalg.vecdot(a, named.to(a.device, a.dtype))}


def _row_statistics(
    weights: torch.Tensor,
    first: torch.Tensor,
    norms: torch.Tensor | None,
    roles=None,
    named: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Each statistic per row, ``(B, H, L)``; ``first``: each sample's first real key;
    ``roles``: a :class:`~attnpanel.kernels.roles.RoleSums` given each block too;
    ``named``: ``(S,)`` True at named keys."""
    batch, heads, length, keys = weights.shape
    flat = weights.reshape(batch * heads, length, keys)
    scale = None if norms is None else norms.reshape(batch * heads, keys).to(weights.dtype)
    rows = torch.arange(length, device=weights.device)
    steps = _steps(length, keys, named, weights.device, weights.dtype)
    per = max(1, CHUNK_CELLS // max(1, length * keys))
    derived = roles is not None and length == keys  # the distance from the role sums
    found: dict[str, list[torch.Tensor]] = {}
    for start in range(0, batch * heads, per):
        part = slice(start, start + per)
        block = _block(
            flat[part], steps, None if scale is None else scale[part], distance=not derived
        )
        block.update(_token_share(flat[part], named))
        for name, value in block.items():
            found.setdefault(name, []).append(value)
        if roles is not None:
            roles.add(slice(start, min(start + per, batch * heads)), flat[part])
    values = {name: torch.cat(parts) for name, parts in found.items()}  # (B H, L)
    sinks = _sinks(first, heads)
    own, before = rows.clamp_max(keys - 1), (rows - 1).clamp(0, keys - 1)
    cells = _single_cells(flat, sinks, rows, own, before, length == keys)
    values.update(cells)
    if scale is not None:
        values.update(_weighted_cells(cells, scale, sinks, own, before, values.pop("vw_total")))
    return {name: value.reshape(batch, heads, length) for name, value in values.items()}


def head_statistics_of(
    weights: torch.Tensor,
    padding: torch.Tensor | None = None,
    norms: torch.Tensor | None = None,
    roles: RoleInputs | None = None,
    named: torch.Tensor | None = None,
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
    roles : RoleInputs, optional
        The role statistics of :mod:`attnpanel.kernels.roles` too.
    named : torch.Tensor, optional
        ``(S,)`` bool, True at keys that are named tokens, not time steps (see the module
        docstring); ``token_share`` too.
    """
    batch, heads, length, keys = weights.shape
    if not weights.is_floating_point() or weights.dtype in (torch.float16, torch.bfloat16):
        weights = weights.float()
    padding, named = _positions(padding, named, batch, length, keys, weights.device)
    first = _first(padding, named, batch, weights.device)
    real = _real(padding, named, batch, length, keys, weights.device)
    sums = None if roles is None else RoleSums(roles, heads, first, real, named)
    rows = _row_statistics(weights, first, norms, sums, named)
    found = _row_means(rows, padding if named is None else ~real, length, keys)
    _with_roles(found, sums, batch, heads)
    return found


def _with_roles(found: dict, sums: RoleSums | None, batch: int, heads: int) -> None:
    """The role statistics, and the distance where they gave it, into ``found``."""
    if sums is None:
        return
    found.update(sums.result(batch, heads))
    distance = sums.distance(batch, heads)
    if distance is not None:
        found["distance"] = distance


def _positions(padding, named, batch, length, keys, device):
    """``padding`` as bool (or None) and ``named`` as ``(S,)`` bool (None where no key is
    named, or the attention is not over the named positions: a cross-attention)."""
    padding = None if padding is None else padding.to(device, torch.bool)
    if named is not None:
        named = named.to(device, torch.bool).reshape(-1)
        if named.shape[0] != keys or length != keys or not bool(named.any()):
            named = None
    return padding, named


def _first(padding, named, batch: int, device) -> torch.Tensor:
    """Each sample's first real key that is a step: its sink."""
    kept = None if padding is None else ~padding
    if named is not None:
        kept = (~named).expand(batch, -1) if kept is None else kept & ~named
    if kept is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return kept.to(torch.int8).argmax(dim=1)


def _real(padding, named, batch, length, keys, device) -> torch.Tensor:
    """``(B, L)`` True at each sample's real queries: not padded, not named."""
    real = torch.ones(batch, length, dtype=torch.bool, device=device)
    if padding is not None and length == keys:
        real = ~padding.to(device)
    if named is not None:
        real = real & ~named
    return real


def _row_means(
    rows: dict[str, torch.Tensor], padding: torch.Tensor | None, length: int, keys: int
) -> dict[str, torch.Tensor]:
    """Each statistic's mean over a sample's real queries (``(B, H, L)`` -> ``(B, H)``
    float64); ``previous_share`` over those whose previous position is real."""
    some = next(iter(rows.values()))
    batch = some.shape[0]
    real = torch.ones(batch, length, dtype=torch.bool, device=some.device)
    if padding is not None and length == keys:
        real = ~padding
    previous = real.clone()
    if padding is not None and length == keys:
        previous[:, 1:] &= ~padding[:, :-1]
    previous[:, 0] = False
    found = {}
    for name, values in rows.items():
        weight = (previous if name.endswith("previous_share") else real).to(torch.float64)
        count = weight.sum(-1, keepdim=True).clamp_min(1.0)  # (B, 1)
        found[name] = (values.to(torch.float64) * weight[:, None, :]).sum(-1) / count
    return found


FILL = -1e30  # a blocked cell's score: exp() of it is 0, and 0 times it is 0 (not NaN)


def _score_block(
    q, k, added, norms, steps, v, context, checked, distance: bool = True
) -> tuple[dict, torch.Tensor]:
    """The row sums of one block of head-samples from its scores (no weights kept), and
    how far ``weights @ v`` of the ``checked`` rows lies from the model's own ``context``.

    ``q`` comes scaled; ``added``: the bias plus :data:`FILL` at blocked cells (or None).
    """
    s = torch.bmm(q, k.transpose(1, 2)) if added is None else torch.baddbmm(added, q, k.mT)
    a = torch.softmax(s, dim=-1)
    top, peak = a.amax(-1), s.amax(-1)
    # ln a_ij = s_ij - lse_i, and at the row's largest weight: lse = max s - ln(max a)
    lse = peak - torch.log(top)
    found = {
        "entropy": lse - torch.linalg.vecdot(a, s),  # -sum a ln a = lse - sum a s
        "max_weight": top,
        "weights": a,
    }
    if distance:  # else the role sums give it, from the diagonals
        found["distance"] = torch.linalg.vecdot(a, steps)
    if norms is not None:
        w = a * norms[:, None, :]
        weighted = w.sum(-1)
        safe = torch.where(weighted > 0, weighted, 1.0)
        # ln w~ = ln a + ln n - ln Zw = s - lse + ln n - ln Zw
        n_log_n = (norms * torch.log(norms.clamp_min(TINY)))[:, None, :]
        mixed = (torch.linalg.vecdot(w, s) + torch.linalg.vecdot(a, n_log_n)) / safe
        found["vw_entropy"] = torch.where(weighted > 0, lse + torch.log(safe) - mixed, 0.0)
        found["vw_distance"] = torch.linalg.vecdot(w, steps) / safe
        found["vw_max_weight"] = w.amax(-1) / safe
        found["vw_total"] = safe
    error = torch.zeros((), device=s.device)
    if v is not None and context is not None and v.numel():
        # a row blocked from every key is 0 in the kernels (uniform in a softmax of FILLs)
        live = peak[:, checked] > FILL / 2
        rows = a[:, checked] * live[..., None]
        error = (torch.bmm(rows, v) - context[:, checked]).abs().max()
    return found, error


def _sinks(first: torch.Tensor, heads: int) -> torch.Tensor | None:
    """Each head-sample's sink key (its sample's first real key); None where it is key 0
    for every sample (read as a column, with no gather; asked once, not per block)."""
    return None if bool((first == 0).all()) else first.repeat_interleave(heads)


def _single_cells(a, sinks, rows, own, before, square: bool) -> dict[str, torch.Tensor]:
    """Per row of ``a`` ``(n, L, S)``: the weight on the sink (each head-sample's first real
    key, ``sinks``; None: key 0), on its own position and on the previous one (0 where
    there is none)."""
    if square:  # the diagonals, copied out: a view would keep the whole block alive
        diagonal = torch.diagonal(a, dim1=-2, dim2=-1).clone()
        previous = torch.nn.functional.pad(torch.diagonal(a, offset=-1, dim1=-2, dim2=-1), (1, 0))
    else:
        keys = a.shape[-1]
        diagonal = torch.where(rows < keys, a[:, rows, own], 0.0)
        previous = torch.where((rows >= 1) & (rows - 1 < keys), a[:, rows, before], 0.0)
    if sinks is None:
        sink = a[..., 0].clone()
    else:
        sink = a.gather(-1, sinks[:, None, None].expand(-1, a.shape[1], 1))[..., 0]
    return {"sink": sink, "diagonal_share": diagonal, "previous_share": previous}


def _weighted_cells(cells, norms, sinks, own, before, total) -> dict[str, torch.Tensor]:
    """The single cells of :func:`_single_cells` on the value-weighted rows: each cell
    times its key's norm (``norms`` ``(n, S)``), over the row's weighted ``total``."""
    length = own.shape[0]
    at_sink = norms[:, :1] if sinks is None else norms.gather(-1, sinks[:, None])
    return {
        "vw_sink": cells["sink"] * at_sink.expand(-1, length) / total,
        "vw_diagonal_share": cells["diagonal_share"] * norms[:, own] / total,
        "vw_previous_share": cells["previous_share"] * norms[:, before] / total,
    }


def _added(blocked, bias, cells) -> torch.Tensor | None:
    """The bias plus :data:`FILL` at blocked cells, as small as it broadcasts."""
    if blocked is None and bias is None:
        return None
    added = torch.zeros(()) if bias is None else bias.float()
    if blocked is not None:
        added = torch.where(blocked, torch.tensor(FILL), added)
    return added.expand(cells) if added.dim() == 0 else added


def head_statistics_of_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    blocked: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norms: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
    checked: torch.Tensor | None = None,
    roles: RoleInputs | None = None,
    named: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """:func:`head_statistics_of` from ``q``, ``k``, the scale and the mask, the weights
    recomputed block by block in cache and never kept whole (for a fused kernel, SDPA,
    that never formed them).

    Parameters
    ----------
    q, k : torch.Tensor
        ``(B, H, L, E)`` and ``(B, H, S, E)``.
    scale : float
        The multiplier of ``q . k``.
    blocked, bias : torch.Tensor, optional
        Broadcastable to ``(B, H, L, S)``: True where blocked; added to the scaled scores.
    norms : torch.Tensor, optional
        ``(B, H, S)`` value norms: the ``vw_`` statistics too.
    v, context : torch.Tensor, optional
        ``(B, H, S, E)`` and the model's own ``(B, H, L, E)`` output: the largest
        ``|weights @ v - context|`` is returned, to check the weights were the model's.
    checked : torch.Tensor, optional
        The query rows that check covers (every row by default).
    roles : RoleInputs, optional
        The role statistics of :mod:`attnpanel.kernels.roles` too.
    named : torch.Tensor, optional
        ``(S,)`` True at named keys, as in :func:`head_statistics_of`.

    Returns
    -------
    (dict, float)
        Each statistic ``(B, H)`` float64, and that largest difference.
    """
    batch, heads, length, width = q.shape
    keys = k.shape[-2]
    cells = (batch, heads, length, keys)
    flat = {
        "q": (q.float() * scale).reshape(batch * heads, length, width),
        "k": k.float().expand(batch, heads, keys, width).reshape(batch * heads, keys, -1),
    }
    if v is not None and context is not None:
        flat["v"] = v.float().expand(batch, heads, keys, -1).reshape(batch * heads, keys, -1)
        flat["context"] = context.float().reshape(batch * heads, length, -1)
    added = _added(blocked, bias, cells)
    shared = added is None or added.shape[:-2].numel() == 1  # one (L, S) for every head
    if added is not None:
        added = added.reshape(-1, *added.shape[-2:]) if shared else added.expand(cells)
    scale_n = None if norms is None else norms.float().reshape(batch * heads, keys)
    device = q.device
    rows = torch.arange(length, device=device)
    padding = None
    if blocked is not None:  # keys no query of any head may see, from the mask as it is
        full = blocked[(None,) * (4 - blocked.dim())]
        padding = full.all(dim=-2).all(dim=1).expand(batch, keys)  # (B, S)
    padding, named = _positions(padding, named, batch, length, keys, device)
    steps = _steps(length, keys, named, device, torch.float32)
    first = _first(padding, named, batch, device)
    real = _real(padding, named, batch, length, keys, device)
    sinks = _sinks(first, heads)
    sums = None if roles is None else RoleSums(roles, heads, first, real, named)
    own, before = rows.clamp_max(keys - 1), (rows - 1).clamp(0, keys - 1)
    checked = (rows if checked is None else checked).to(device)
    per = max(1, CHUNK_CELLS // max(1, length * keys))
    found: dict[str, list[torch.Tensor]] = {}
    error = torch.zeros((), device=device)  # read once, at the end (no sync per block)
    square = length == keys
    for start in range(0, batch * heads, per):
        part = slice(start, min(start + per, batch * heads))  # views, no copies
        block = {name: t[part] for name, t in flat.items()}
        block_added = added
        if added is not None and not shared:
            index = torch.arange(part.start, part.stop, device=added.device)
            block_added = added[index // heads, index % heads]
        n = None if scale_n is None else scale_n[part]
        values, gap = _score_block(
            block["q"], block["k"], block_added, n, steps, block.get("v"), block.get("context"),
            checked, distance=sums is None or not square,
        )  # fmt: skip
        error = torch.maximum(error, gap)
        a = values.pop("weights")
        if sums is not None:
            sums.add(part, a)
        block_sinks = None if sinks is None else sinks[part]
        cells = _single_cells(a, block_sinks, rows, own, before, square)
        values.update(cells)
        values.update(_token_share(a, named))
        if n is not None:
            total = values.pop("vw_total")
            values.update(_weighted_cells(cells, n, block_sinks, own, before, total))
        for name, value in values.items():
            found.setdefault(name, []).append(value)
    rows_found = {
        name: torch.cat(parts).reshape(batch, heads, length) for name, parts in found.items()
    }
    found_means = _row_means(rows_found, padding if named is None else ~real, length, keys)
    _with_roles(found_means, sums, batch, heads)
    return found_means, float(error)

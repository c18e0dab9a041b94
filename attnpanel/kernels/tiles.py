"""Attention at any length: exact tiles of the weights from q, k and per-row statistics.

A row of softmax weights is ``exp(logit - lse)``, where ``lse`` is the log-sum-exp of that
row's logits (scaled scores, plus any additive bias, blocked cells filled as
:func:`attnpanel.kernels.attention.attend` fills them). :func:`row_statistics` computes ``lse``
(and the row maximum) in one streaming pass over blocks of queries and keys, the way
flash attention does, never holding more than ``block_q x block_k`` logits. From then on
*any* tile of the ``(L, S)`` map is exact and cheap (:func:`weights_tile`): it needs only
``q`` of its rows, ``k`` of its columns and ``lse`` of its rows, all tiny next to the
map. :func:`lazy_weights` and :func:`lazy_scores` give the whole map as a dask array of
such tiles, nothing ``L x L`` ever in memory; :func:`blocked_attention` is the layer's
forward (the context ``weights @ v``) in the same bounded memory.

The rules are the dense path's (:func:`attnpanel.kernels.attention.attend`): blocked cells are
filled with ``-1e4`` (``-inf`` when there is an additive bias), the softmax runs over the
filled row, and blocked weights are then exactly 0 (not renormalised), so a row whose
every key is blocked is all zeros.

Shapes: ``q`` ``(B, H, L, E)``, ``k`` and ``v`` ``(B, H, S, E)``; statistics ``(B, H, L)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import handle_torch_function, has_torch_function

from attnpanel.kernels.masks import MASK_FILL, Masking
from attnpanel.util import cancel

BLOCK = 1024  # default rows and columns per block of the streaming passes and the tiles


def logits_tile(q, k, masking: Masking, scale: float, rows: slice, cols: slice):
    """Scaled scores (plus bias) of a tile, blocked cells filled; and the blocked cells."""
    logits = (q[..., rows, :] @ k[..., cols, :].transpose(-2, -1)) * scale
    bias = masking.bias_tile(rows, cols)
    if bias is not None:
        logits = logits + bias.to(logits.device, logits.dtype)
    blocked = masking.blocked(rows, cols, logits.device)
    if blocked is not None:
        logits = logits.masked_fill(blocked, masking.fill)
    return logits, blocked


def _blocks(n: int, size: int):
    return _blocks_in(slice(0, n), size)


def _blocks_in(span: slice, size: int):
    return [
        slice(start, min(span.stop, start + size)) for start in range(span.start, span.stop, size)
    ]


def _online_step(row_max, logits):
    """One key block of the online softmax: the new running maximum, the factor that
    rescales what was summed under the old one, and the block's ``exp(logit - max)``."""
    new = torch.maximum(row_max, logits.amax(-1))
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # a row all -inf
    correction = torch.exp(row_max - safe).nan_to_num(0.0)
    return new, correction, torch.exp(logits - safe[..., None])


@torch.no_grad()
def row_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    masking: Masking = Masking(),
    scale: float | None = None,
    block_q: int = BLOCK,
    block_k: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the maximum and the log-sum-exp of the logits: ``(B, H, L)`` float64 each.

    One pass over ``block_q x block_k`` tiles with a running maximum (flash attention's
    online softmax); memory ``O(block_q * block_k)`` per head, whatever ``L`` and ``S``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = q.double(), k.double()  # float64 statistics: a tile is then exact to float32
    length, keys = q.shape[-2], k.shape[-2]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    row_max = torch.full((*lead, length), -math.inf, dtype=q.dtype, device=q.device)
    total = torch.zeros((*lead, length), dtype=q.dtype, device=q.device)
    for rows in _blocks(length, block_q):
        m = row_max[..., rows]
        s = total[..., rows]
        for cols in _blocks(keys, block_k):
            logits, _ = logits_tile(q, k, masking, scale, rows, cols)
            m, correction, p = _online_step(m, logits)
            s = s * correction + p.sum(-1)
        row_max[..., rows] = m
        total[..., rows] = s
    return row_max, row_max + torch.log(total)


@torch.no_grad()
def weights_tile(q, k, lse, masking: Masking, scale: float, rows: slice, cols: slice):
    """The exact softmax weights of a tile, ``(B, H, rows, cols)`` float32: blocked cells 0.

    Computed in float64 from float64 ``lse`` (:func:`row_statistics`), then rounded once.
    """
    return _weights64(q.double(), k.double(), lse, masking, scale, rows, cols)[0].float()


def _weights64(q, k, lse, masking: Masking, scale: float, rows: slice, cols: slice):
    """A tile's float64 weights (blocked cells 0) from float64 ``q``, ``k``; and its blocked
    cells (or None)."""
    logits, blocked = logits_tile(q, k, masking, scale, rows, cols)
    weights = torch.exp(logits - lse[..., rows, None].double())
    if blocked is not None:
        weights = weights.masked_fill(blocked, 0.0)
    return weights.nan_to_num(0.0), blocked  # a row whose every key is blocked: lse = -inf


@torch.no_grad()
def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masking: Masking = Masking(),
    scale: float | None = None,
    block_q: int = BLOCK,
    block_k: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context ``weights @ v`` ``(B, H, L, E)`` and the rows' ``lse``, in bounded memory.

    The same numbers as the dense path, without the ``(L, S)`` weights: per block of
    queries, the keys stream through with a running maximum, sum and weighted sum of
    values; blocked cells count in the sum as the dense softmax counts them and add
    nothing to the context.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    length, keys = q.shape[-2], k.shape[-2]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    context = torch.zeros((*lead, length, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((*lead, length), dtype=q.dtype, device=q.device)
    for rows in _blocks(length, block_q):
        m = torch.full((*lead, rows.stop - rows.start), -math.inf, dtype=q.dtype, device=q.device)
        s = torch.zeros_like(m)
        acc = torch.zeros((*m.shape, v.shape[-1]), dtype=q.dtype, device=q.device)
        for cols in _blocks(keys, block_k):
            logits, blocked = logits_tile(q, k, masking, scale, rows, cols)
            m, correction, p = _online_step(m, logits)
            s = s * correction + p.sum(-1)
            if blocked is not None:
                p = p.masked_fill(blocked, 0.0)
            acc = acc * correction[..., None] + p @ v[..., cols, :]
        context[..., rows, :] = (acc / s[..., None]).nan_to_num(0.0)
        lse[..., rows] = m + torch.log(s)
    return context, lse


NEAR_BLOCK = 2048  # queries per call of the fused kernel in :func:`attention`


def _fused_kernel():
    """torch's fused CPU attention that also returns the rows' log-sum-exp, or None.

    ``aten._scaled_dot_product_flash_attention_for_cpu`` (what
    ``F.scaled_dot_product_attention`` runs on CPU) is an internal op: where a torch
    release lacks it, :func:`attention` falls back to :func:`blocked_attention`.
    """
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused(kernel, q, k, v, scale: float, additive=None, causal: bool = False):
    """One call of the fused kernel: the context and the rows' lse (of the logits plus
    ``additive``, a float mask broadcastable to ``(B, H, rows, keys)``)."""
    context, lse = kernel(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
    return context, lse.to(q.dtype)


def _merge(part, other):
    """Two softmaxes over disjoint key sets as one: (context, lse) each."""
    if part is None:
        return other
    (c1, l1), (c2, l2) = part, other
    lse = torch.logaddexp(l1, l2)
    c1 = c1 * torch.exp(l1 - lse)[..., None] + c2 * torch.exp(l2 - lse)[..., None]
    return c1, lse


def _padding_fill(masking: Masking, cols: slice, like: torch.Tensor):
    """``(B, 1, 1, cols)`` additive fill of the padded keys, or None."""
    if masking.key_padding is None:
        return None
    padded = masking.key_padding[:, None, None, cols].to(like.device)
    return torch.zeros(padded.shape, dtype=like.dtype, device=like.device).masked_fill(
        padded, MASK_FILL
    )


@torch.no_grad()
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masking: Masking = Masking(),
    scale: float | None = None,
    block_q: int = NEAR_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context ``weights @ v`` and the rows' ``lse`` at any length, as fast as torch
    allows: what :func:`blocked_attention` gives, through torch's fused CPU kernel.

    The kernel takes a mask only as an ``(L, S)``-broadcastable tensor, which at long
    lengths would not fit. So per block of ``block_q`` queries the keys are split in two:
    the keys the structural mask leaves alone (for the diagonal mask, every key outside
    the block; for the causal mask, every earlier key), attended without a mask, and the
    block's own keys with a ``block_q x block_q`` mask; the two softmaxes are merged
    through their log-sum-exps (flash attention's rule). Padded keys get the dense path's
    fill as an additive ``(B, 1, 1, S)`` mask, so their weight underflows to 0 as there.
    A row whose every key is blocked gets a zero context (as in the dense path) and the
    dense path's ``lse``. With a bias, off the CPU, or without the kernel, this is
    :func:`blocked_attention`.

    Like torch's own functions it honours ``__torch_function__`` overrides and modes, so
    :func:`attnpanel.capture` sees each call whole (q, k, v, the mask and the ``lse``).
    """
    if has_torch_function((q, k, v)):
        return handle_torch_function(attention, (q, k, v), q, k, v, masking, scale, block_q)
    kernel = _fused_kernel()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if (
        kernel is None
        or masking.bias is not None
        or q.device.type != "cpu"
        or q.dtype not in (torch.float32, torch.float64)
        or q.shape[-2] != k.shape[-2]
        and masking.mode != "none"
    ):
        return blocked_attention(q, k, v, masking, scale)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    q, k, v = (t.expand(*lead, *t.shape[-2:]) for t in (q, k, v))
    length, keys = q.shape[-2], k.shape[-2]
    if masking.mode == "none":
        context, lse = _fused(kernel, q, k, v, scale, _padding_fill(masking, slice(None), q))
    else:
        context = torch.empty((*lead, length, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((*lead, length), dtype=q.dtype, device=q.device)
        for rows in _blocks(length, block_q):
            a, b = rows.start, rows.stop
            near_fill = _padding_fill(masking, rows, q)
            blocked = Masking(masking.mode).blocked(rows, rows, q.device)  # the block's own keys
            structural = torch.zeros(blocked.shape, dtype=q.dtype, device=q.device)
            structural.masked_fill_(blocked, MASK_FILL)
            near_fill = structural if near_fill is None else near_fill + structural
            found = None
            far = [slice(0, a)] if masking.mode == "causal" else [slice(0, a), slice(b, keys)]
            far = [cols for cols in far if cols.stop > cols.start]
            if far:
                far_k = torch.cat([k[..., cols, :] for cols in far], dim=-2)
                far_v = torch.cat([v[..., cols, :] for cols in far], dim=-2)
                fills = [_padding_fill(masking, cols, q) for cols in far]
                far_fill = None if fills[0] is None else torch.cat(fills, dim=-1)
                found = _fused(kernel, q[..., rows, :], far_k, far_v, scale, far_fill)
            near = _fused(
                kernel, q[..., rows, :], k[..., rows, :], v[..., rows, :], scale, near_fill
            )
            context[..., rows, :], lse[..., rows] = _merge(found, near)
    dead = lse < MASK_FILL / 2  # every key of the row blocked (its logits all near -1e4)
    if bool(dead.any()):
        context[dead] = 0.0
        lse[dead] = MASK_FILL + math.log(keys)
    return context, lse


def log_sum_exp(q, k, masking: Masking = Masking(), scale: float | None = None) -> torch.Tensor:
    """Each row's ``lse`` ``(B, H, L)`` alone: :func:`attention` with ``q`` standing in
    for ``v`` (the fused kernel needs a value of the head size; its context is dropped)."""
    return attention(q, k, q, masking, scale)[1]


def _lazy(tile, shape, chunks, name: str):
    """A dask array of ``shape`` whose every chunk is ``tile(b, h, rows, cols)``."""
    import dask.array as da
    from dask.base import tokenize

    batch, heads, length, keys = shape
    row_blocks, col_blocks = _blocks(length, chunks[0]), _blocks(keys, chunks[1])
    token = f"{name}-{tokenize(name, shape, chunks, id(tile))}"
    graph = {
        (token, b, h, i, j): (tile, b, h, rows, cols)
        for b in range(batch)
        for h in range(heads)
        for i, rows in enumerate(row_blocks)
        for j, cols in enumerate(col_blocks)
    }
    dims = (
        (1,) * batch,
        (1,) * heads,
        tuple(r.stop - r.start for r in row_blocks),
        tuple(c.stop - c.start for c in col_blocks),
    )
    return da.Array(graph, token, dims, dtype=np.float32)


def sample_masking(masking: Masking, b: int, h: int) -> Masking:
    """The masking of one sample and head (its padding row, its bias slice)."""
    padding = None if masking.key_padding is None else masking.key_padding[b : b + 1]
    bias = masking.bias
    if bias is not None:
        while bias.dim() < 4:
            bias = bias[None]
        bias = bias[b if bias.shape[0] > 1 else 0][h if bias.shape[1] > 1 else 0][None, None]
    return Masking(masking.mode, padding, bias)


def lazy_weights(q, k, lse, masking: Masking = Masking(), scale=None, chunks=(BLOCK, BLOCK)):
    """The ``(B, H, L, S)`` softmax weights as a dask array of exact tiles.

    ``q`` ``(B, H, L, E)``, ``k`` ``(B, H, S, E)`` and ``lse`` ``(B, H, L)`` (from
    :func:`row_statistics`) are all it reads; a chunk costs one ``rows x cols`` product.
    """
    q, k, lse = (torch.as_tensor(a) for a in (q, k, lse))
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def tile(b, h, rows, cols):
        one = sample_masking(masking, b, h)
        found = weights_tile(
            q[b : b + 1, h : h + 1],
            k[b : b + 1, h : h + 1],
            lse[b : b + 1, h : h + 1],
            one,
            scale,
            rows,
            cols,
        )
        return found.numpy().astype(np.float32, copy=False)

    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return _lazy(tile, shape, chunks, "attnpanel-weights")


def lazy_scores(q, k, chunks=(BLOCK, BLOCK)):
    """The ``(B, H, L, S)`` raw scores ``q . k`` as a dask array of tiles."""
    q, k = torch.as_tensor(q), torch.as_tensor(k)

    def tile(b, h, rows, cols):
        found = q[b : b + 1, h : h + 1, rows] @ k[b : b + 1, h : h + 1, cols].transpose(-2, -1)
        return found.numpy().astype(np.float32, copy=False)

    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return _lazy(tile, shape, chunks, "attnpanel-scores")


def lazy_logits(q, k, masking: Masking = Masking(), scale=None, chunks=(BLOCK, BLOCK)):
    """The ``(B, H, L, S)`` logits (scaled scores plus any bias, blocked cells filled as
    the dense path fills them: :func:`logits_tile`) as a dask array of tiles; with
    ``Masking()`` the scaled scores."""
    q, k = torch.as_tensor(q), torch.as_tensor(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def tile(b, h, rows, cols):
        one = sample_masking(masking, b, h)
        found, _ = logits_tile(
            q[b : b + 1, h : h + 1], k[b : b + 1, h : h + 1], one, scale, rows, cols
        )
        return found.numpy().astype(np.float32, copy=False)

    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return _lazy(tile, shape, chunks, "attnpanel-logits")


@dataclass(frozen=True)
class Overview:
    """A whole map reduced to display resolution, ``(B, H, rows, cols)`` float32 each.

    Pixel ``(r, c)`` covers the queries ``i`` with ``i * rows // L == r`` and the keys
    ``j`` with ``j * cols // S == c`` (whole cells, the first pixels one cell larger where
    the division is not even).
    """

    max: np.ndarray  # the heaviest weight of the pixel's cells: a sharp key is never lost
    mean: np.ndarray  # the mean weight of its cells (blocked cells count as 0)
    blocked: np.ndarray  # the share of its cells the mask blocks


def pixel_starts(n: int, pixels: int) -> np.ndarray:
    """The first cell of each of ``pixels`` pixels over ``n`` cells (cell ``i`` lies in
    pixel ``i * pixels // n``: whole cells, contiguous)."""
    return -(-np.arange(pixels) * n // pixels)


OVERVIEW_COLUMNS = 4096  # keys per step of the overview pass (a cache-sized slab)
OVERVIEW_EXACT_CELLS = 2**22  # maps up to this many cells are reduced in float64
GROUP_CELLS = 2**18  # cells of one step of the overview pass (pixel rows taken together)


@torch.no_grad()
def overview(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    masking: Masking = Masking(),
    scale: float | None = None,
    pixels: tuple[int, int] = (480, 480),
    block_k: int = OVERVIEW_COLUMNS,
    exact_cells: int = OVERVIEW_EXACT_CELLS,
    window: tuple[slice, slice] | None = None,
) -> Overview:
    """The ``(L, S)`` softmax weights reduced to ``pixels`` (rows, cols) in one pass.

    Per pixel, the maximum and mean weight of its cells and the share of them blocked.
    The pass walks one pixel row (its queries) at a time against ``block_k`` keys at a
    time: the slab's logits minus each row's ``lse``, blocked cells ``-inf``; its maximum
    (and which query holds it) and its sum of ``exp`` over the pixel row's queries, then
    over each pixel's keys. Memory: one ``rows x block_k`` slab plus the output, whatever
    ``L`` and ``S``; slabs the causal mask blocks entirely are skipped.

    Precision: a map of at most ``exact_cells`` cells is reduced in float64. A larger one
    is reduced in float32 (3x faster on CPU), and then each pixel's maximum is recomputed
    in float64 from the one cell that holds it, so the maximum is exact; a mean is off by
    float32 rounding of its weights (about 3e-6 of it), and a pixel's mean is at most
    ``1 / keys per pixel`` (each row's weights sum to at most 1).

    ``q`` ``(B, H, L, E)``, ``k`` ``(B, H, S, E)``, ``lse`` ``(B, H, L)``. A map smaller
    than ``pixels`` keeps its own size (one cell per pixel). ``window`` ``(queries,
    keys)``, two slices of positions, reduces only that part of the map (a zoomed view:
    its cost is its cells, whatever ``L``); pixels then tile the window.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window = window or (slice(None), slice(None))
    queries = slice(*window[0].indices(q.shape[-2])[:2])
    key_span = slice(*window[1].indices(k.shape[-2])[:2])
    length, keys = queries.stop - queries.start, key_span.stop - key_span.start
    if length <= 0 or keys <= 0:
        raise ValueError(f"an empty window: queries {queries}, keys {key_span}")
    rows, cols = min(pixels[0], length), min(pixels[1], keys)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], lse.shape[:-1])
    # only the window's rows and keys are read (positions stay absolute for the mask)
    q, lse, k = q[..., queries, :], lse[..., queries], k[..., key_span, :]
    dtype = torch.float64 if length * keys <= exact_cells else torch.float32
    q64 = q.double().expand(*lead, length, -1)
    k64 = k.double().expand(*lead, keys, -1)
    lse64 = lse.to(q.device, torch.float64).expand(*lead, length)
    lse64 = torch.where(torch.isfinite(lse64), lse64, torch.full_like(lse64, math.inf))
    row_starts, col_starts = pixel_starts(length, rows), pixel_starts(keys, cols)
    row_edges = [*(queries.start + row_starts).tolist(), queries.stop]
    col_of_key = np.repeat(np.arange(cols), np.diff([*col_starts.tolist(), keys]))
    peak = np.zeros((*lead, rows, cols))
    total = np.zeros((*lead, rows, cols))
    blocked_count = np.zeros((*lead, rows, cols))
    for b, h in np.ndindex(*lead):
        one = sample_masking(masking, b, h)
        q_bh, lse_bh = q64[b, h].to(dtype), lse64[b, h].to(dtype)
        kt = k64[b, h].transpose(0, 1).to(dtype).contiguous()  # (E, S)
        for first, last in _row_groups(row_edges, min(keys, block_k), GROUP_CELLS):
            cancel.check()  # a superseded window (the user zoomed again) stops here
            span = slice(row_edges[first], row_edges[last])
            at = slice(span.start - queries.start, span.stop - queries.start)
            counts = np.diff(row_edges[first : last + 1])
            pixel_row = torch.as_tensor(np.repeat(np.arange(last - first), counts), device=q.device)
            row_max, row_sum, row_blocked = _overview_rows(
                q_bh[at], kt, lse_bh[at], one, scale, span, key_span, block_k, pixel_row
            )
            pixel_max = np.maximum.reduceat(row_max, col_starts, axis=1).astype(np.float64)
            if dtype != torch.float64:  # recompute each maximum in float64 from its key
                # the first key of each pixel holding its maximum, (pixel rows, cols)
                held = row_max == pixel_max[:, col_of_key].astype(row_max.dtype)
                key = np.where(held, np.arange(keys), keys - 1)
                key = np.minimum.reduceat(key, col_starts, axis=1)
                exact = _exact_pixel_max(
                    q64[b, h], k64[b, h], lse64[b, h], one, scale, row_edges[first : last + 1],
                    key, (queries.start, key_span.start),
                )  # fmt: skip
                pixel_max = np.where(np.isfinite(pixel_max), exact, pixel_max)
            peak[b, h, first:last] = np.exp(pixel_max)
            total[b, h, first:last] = np.add.reduceat(row_sum, col_starts, axis=1)
            blocked_count[b, h, first:last] = np.add.reduceat(row_blocked, col_starts, axis=1)
    per_pixel = np.outer(np.diff(row_edges), np.diff([*col_starts.tolist(), keys]))
    return Overview(
        max=peak.astype(np.float32),
        mean=(total / per_pixel).astype(np.float32),
        blocked=(blocked_count / per_pixel).astype(np.float32),
    )


def _exact_pixel_max(q, k, lse, masking: Masking, scale: float, row_edges, keys, origin):
    """float64 ``max over a pixel's rows of (logit - lse)`` at one key per pixel.

    For consecutive pixel rows (queries ``row_edges[g]`` to ``row_edges[g + 1]``) of one
    sample and head, ``keys`` ``(pixel rows, cols)`` the key of each pixel, as indices
    into ``k``; ``q``, ``lse`` and ``k`` start at the positions ``origin`` (query, key).
    """
    counts = np.diff(row_edges)
    slots = np.arange(counts.max())
    # (pixel rows, rows of the largest): a shorter pixel row repeats its first query,
    # which leaves its maximum as it is
    rows = np.asarray(row_edges[:-1])[:, None] + np.where(slots < counts[:, None], slots, 0)
    rows = torch.as_tensor(rows, device=q.device)
    keys = torch.as_tensor(keys, device=q.device)
    at_rows = rows - origin[0]
    logits = torch.bmm(q[at_rows], k[keys].transpose(1, 2)) * scale  # (G, rows, cols)
    logits = logits - lse[at_rows][..., None]
    query, key = rows[:, :, None], (keys + origin[1])[:, None, :]
    bias = masking.bias_where(query, key)
    if bias is not None:
        logits = logits + bias.to(logits)
    blocked = masking.blocked_where(query, key)
    if blocked is not None:
        logits = logits.masked_fill(blocked, -math.inf)
    return logits.amax(1).cpu().numpy()


def _row_groups(row_edges: list[int], columns: int, cells: int) -> list[tuple[int, int]]:
    """Consecutive pixel rows ``[first, last)`` whose queries times ``columns`` keys make
    about ``cells`` cells (at least one pixel row each): one step of the overview pass."""
    groups, first = [], 0
    for last in range(1, len(row_edges)):
        if last == len(row_edges) - 1 or (row_edges[last + 1] - row_edges[first]) * columns > cells:
            groups.append((first, last))
            first = last
    return groups


def _overview_rows(
    q, kt, lse, masking: Masking, scale: float, rows: slice, keys: slice, block_k: int, pixel_row
):
    """Per pixel row (the queries ``rows`` of one sample and head, ``pixel_row[i]`` the
    pixel row of query ``rows.start + i``) and per key of ``keys``: the largest
    ``logit - lse`` (``-inf`` where every cell is blocked), the sum of the weights and the
    number of blocked cells; numpy ``(pixel rows, len(keys))`` each."""
    width, count = keys.stop - keys.start, rows.stop - rows.start
    groups = int(pixel_row[-1]) + 1
    row_max = torch.full((groups, width), -math.inf, dtype=q.dtype, device=q.device)
    row_sum = torch.zeros(groups, width, dtype=q.dtype, device=q.device)
    row_blocked = torch.zeros(groups, width, dtype=q.dtype, device=q.device)
    shift = -lse[:, None]
    for cols in _blocks_in(keys, block_k):
        out = slice(cols.start - keys.start, cols.stop - keys.start)
        if masking.mode == "causal" and cols.start >= rows.stop:
            # every key after the last query: all blocked
            row_blocked[:, out] = torch.bincount(pixel_row, minlength=groups).to(q.dtype)[:, None]
            continue
        logits = torch.addmm(shift, q, kt[:, out], alpha=scale)  # (rows, cols)
        bias = masking.bias_tile(rows, cols)
        if bias is not None:
            logits = logits + bias.to(logits).reshape(bias.shape[-2:])
        touched = (
            masking.mode == "diagonal" and cols.start < rows.stop and rows.start < cols.stop
        ) or (masking.mode == "causal" and cols.stop - 1 > rows.start)
        blocked = (masking if touched else Masking(key_padding=masking.key_padding)).blocked(
            rows, cols, q.device
        )
        if blocked is not None:
            blocked = blocked.reshape(blocked.shape[-2:]).expand(count, -1)
            logits = logits.masked_fill(blocked, -math.inf)
            row_blocked[:, out].index_add_(0, pixel_row, blocked.to(q.dtype))
        # (rows, cols) -> (pixel rows, cols): each pixel row's maximum and sum
        if groups == 1:
            torch.amax(logits, 0, out=row_max[0, out])
            torch.sum(logits.exp_(), 0, out=row_sum[0, out])
        else:
            index = pixel_row[:, None].expand_as(logits)
            row_max[:, out].scatter_reduce_(0, index, logits, "amax")
            row_sum[:, out].index_add_(0, pixel_row, logits.exp_())
    return tuple(t.cpu().numpy() for t in (row_max, row_sum, row_blocked))

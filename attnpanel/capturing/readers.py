"""The readers of the attention calls a model makes, one per torch function.

Each is registered with :func:`attnpanel.capturing.recorder.reads` under the kind of site it
reads (``sdpa``, ``multi_head_attention_forward``, attnpanel's own bounded attention
``attnpanel``, and ``softmax``: the sites :mod:`attnpanel.watching` finds); it calls the
function with its own
arguments, returns its result untouched, and records q, k, v, the scale and the mask truth,
checked against what the call computed. Importing this module registers them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnpanel.capturing.recorder import (
    STRUCTURE_ROWS,
    AttentionCall,
    AttentionRecorder,
    UnsupportedAttention,
    VirtualForm,
    reads,
    recompute,
    row_slice,
    spread_rows,
    tolerance,
)
from attnpanel.kernels import precision, tiles
from attnpanel.kernels.masks import Masking, fill_words
from attnpanel.watching.lineage import split_bias, union
from attnpanel.watching.watcher import (
    BOUNDED_SIGNATURE,
    MHA_SIGNATURE,
    SDPA_SIGNATURE,
    Site,
    bind,
)


def sdpa_heads(a: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of an SDPA call's bound arguments, each ``(*lead, n, E)`` with every
    query head's own k and v (a grouped-query call's key/value heads repeated)."""
    q, k, v = a["query"], a["key"], a["value"]
    if k.shape[-3] != q.shape[-3] and q.dim() >= 3 and q.shape[-3] % k.shape[-3] == 0:
        groups = q.shape[-3] // k.shape[-3]  # grouped-query attention
        k = k.repeat_interleave(groups, dim=-3)  # (B, H, S, E)
        v = v.repeat_interleave(groups, dim=-3)  # (B, H, S, E)
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q, k = q.expand(*lead, *q.shape[-2:]), k.expand(*lead, *k.shape[-2:])
        v = v.expand(*lead, *v.shape[-2:])
    return q, k, v


def sdpa_mask(a: dict, length: int, n_keys: int):
    """``(blocked, bias)`` of an SDPA call's bound arguments: its ``attn_mask`` (a bool one
    True where allowed, a float one additive) and ``is_causal``."""
    blocked, bias = _mask_terms(a["attn_mask"], true_allows=True)
    if a["is_causal"]:
        device = a["query"].device
        causal_cells = torch.ones(length, n_keys, dtype=torch.bool, device=device).triu(1)
        blocked = union(blocked, causal_cells)
    return blocked, bias


@reads("sdpa")
def _read_sdpa(recorder: AttentionRecorder, site: Site, func, args, kwargs):
    result = func(*args, **kwargs)
    a = bind(SDPA_SIGNATURE, args, kwargs)
    q, k, v = sdpa_heads(a)
    dtype = q.dtype
    length, n_keys = q.shape[-2], k.shape[-2]
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    call = AttentionCall(site.module, "sdpa", q, k, float(scale), weights=None, dtype=dtype)
    call.v, call.context = v, result
    mask, causal = a["attn_mask"], a["is_causal"]
    call.fill = _mask_fill(mask, always=bool(causal))
    if a["dropout_p"]:
        call.unsupported = f"attention dropout is on (dropout_p={a['dropout_p']})"
    elif recorder.records_weights(q.shape[:-2], length, n_keys):
        blocked, bias = sdpa_mask(a, length, n_keys)
        call.blocked, call.bias = blocked, bias
        if not recorder.defers_weights:  # else the recorder recomputes and checks them
            call.weights = recompute(q, k, call.scale, blocked, bias)  # (*lead, L, S)
            _check_output(call, _output_error(call.weights, v, result), "the weights from its")
    else:
        try:
            if causal:
                mode, padding = "causal", None  # torch refuses is_causal with a mask
            else:
                blocked = _blocked_only(mask, true_allows=True)
                mode, padding = _structure(blocked, q.shape[:-2], length, n_keys)
            call.virtual, context = _virtual_form(q, k, v, call.scale, mode, padding)
        except UnsupportedAttention as error:
            call.unsupported = str(error)
        else:
            error = float((context - result.to(context.dtype)).abs().max()) if v.numel() else 0.0
            _check_output(call, error, "the row statistics of its")
    recorder.record_call(call, site)
    return result


def _check_output(call: AttentionCall, error: float, what: str) -> None:
    """The call is unsupported unless what was recorded reproduces its output."""
    if not error <= tolerance(call.dtype) * max(1.0, float(call.v.abs().max())):  # NaN fails too
        call.unsupported = (
            f"{what} q, k and mask do not reproduce the output of its "
            f"scaled_dot_product_attention call (max error {error:.3g})"
        )


def _mask_fill(mask: torch.Tensor | None, always: bool = False) -> str:
    """The fill of a mask argument of SDPA or ``nn.MultiheadAttention``: a bool mask (or a
    causal flag: ``always``) fills ``-inf``, a float one is added."""
    values = (-math.inf,) if always or (mask is not None and mask.dtype == torch.bool) else ()
    additive = mask if mask is not None and mask.dtype != torch.bool else None
    return fill_words(values, additive)


def _mask_terms(mask: torch.Tensor | None, true_allows: bool):
    """``(blocked, bias)`` of a mask argument: a bool one is True where allowed (SDPA's
    ``attn_mask``) or where blocked (``nn.MultiheadAttention``'s), a float one additive."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return (~mask if true_allows else mask), None
    return split_bias(mask)


def _blocked_only(mask: torch.Tensor | None, true_allows: bool) -> torch.Tensor | None:
    """The cells a mask argument blocks; an additive bias has no virtual form."""
    blocked, bias = _mask_terms(mask, true_allows)
    if bias is not None:
        raise UnsupportedAttention(_HAS_BIAS)
    return blocked


_TOO_LARGE = (
    "it is recorded as row statistics instead of weights (dense=False, or weights larger "
    "than attnpanel.traces.virtual.DENSE_MAX_BYTES), which need a mask of a mode (none, diagonal, "
    "causal) plus padded keys and no bias; capture it with dense=True (a shorter input if "
    "its weights do not fit): "
)


_HAS_BIAS = _TOO_LARGE + "it adds a bias to the scores"


def _structure(blocked, lead, length: int, n_keys: int) -> tuple[str, torch.Tensor | None]:
    """A mask as a mode and padded keys ``(*lead, S)``, read block of rows by block.

    ``blocked`` is broadcastable to ``(*lead, L, S)``; nothing of that size is made.

    Raises
    ------
    UnsupportedAttention
        When it blocks other cells, or its mode differs between samples or heads.
    """
    if blocked is None:
        return "none", None
    cells = blocked.reshape((1,) * (len(lead) + 2 - blocked.dim()) + tuple(blocked.shape))
    own = cells.shape[:-2]  # the leading dims it varies along (1 where it broadcasts)
    modes = ("none", "causal", "diagonal") if length == n_keys else ("none",)
    padded = torch.zeros((*own, n_keys), dtype=torch.bool)
    found = set()
    for index in itertools.product(*map(range, own)):
        one = cells[index]  # (L or 1, S or 1)
        keys = one.all(dim=0).expand(n_keys)  # blocked for every query: padding
        padded[index] = keys
        mode = next((m for m in modes if _matches(one, m, keys, length)), None)
        if mode is None:
            raise UnsupportedAttention(_TOO_LARGE + "its mask blocks other cells")
        found.add(mode)
    if len(found) > 1:
        raise UnsupportedAttention(
            _TOO_LARGE + f"its mask is {' in some rows, '.join(sorted(found))} in others"
        )
    return found.pop(), (padded.expand(*lead, n_keys) if bool(padded.any()) else None)


def _matches(cells: torch.Tensor, mode: str, keys: torch.Tensor, length: int) -> bool:
    """Whether ``cells`` ``(L or 1, S or 1)`` block exactly ``mode`` plus ``keys``."""
    n_keys = keys.numel()
    if cells.shape[0] == 1:
        return mode == "none"
    structure = Masking(mode)
    for start in range(0, length, STRUCTURE_ROWS):
        rows = slice(start, min(start + STRUCTURE_ROWS, length))
        own = structure.blocked(rows, slice(0, n_keys), keys.device)
        expected = keys.expand(rows.stop - start, n_keys)
        expected = expected if own is None else own | expected
        if not torch.equal(cells[rows].expand_as(expected), expected):
            return False
    return True


def _exact_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _virtual_form(q, k, v, scale: float, mode: str, padding) -> tuple[VirtualForm, torch.Tensor]:
    """The rows' lse and the context ``(*lead, L, E)`` through the bounded fused pass
    (:func:`attnpanel.kernels.tiles.attention`); ``v`` None gives the lse alone."""
    lead = q.shape[:-2]
    count = math.prod(lead)
    dtype = _exact_dtype(q)

    def flat(t):  # (*lead, n, E) -> (count, 1, n, E): every leading index a sample of its own
        return t.expand(*lead, *t.shape[-2:]).reshape(count, 1, *t.shape[-2:]).to(dtype)

    key_padding = None if padding is None else padding.reshape(count, -1)
    masking = Masking(mode, key_padding=key_padding)
    if v is None:
        context, lse = None, tiles.log_sum_exp(flat(q), flat(k), masking, scale)
    else:
        context, lse = tiles.attention(flat(q), flat(k), flat(v), masking, scale)
        context = context.reshape(*lead, *context.shape[-2:])
    form = VirtualForm(lse.reshape(*lead, -1).float(), mode, padding)
    return form, context


def _output_error(weights: torch.Tensor, v: torch.Tensor, output: torch.Tensor) -> float:
    """Largest difference of ``weights @ v`` from the kernel's output, on spread rows."""
    if not v.numel() or not weights.numel():
        return 0.0
    rows = spread_rows(weights.shape[-2], device=weights.device)
    product = weights.index_select(-2, rows) @ v.float()  # (*lead, rows, E)
    return float((product - output.index_select(-2, rows.to(output.device)).float()).abs().max())


@reads("attnpanel")
def _read_bounded(recorder: AttentionRecorder, site: Site, func, args, kwargs):
    """attnpanel's own attention at any length (:func:`attnpanel.kernels.tiles.attention`): q, k,
    v, the mask and each row's ``lse``, whole."""
    result = func(*args, **kwargs)
    a = bind(BOUNDED_SIGNATURE, args, kwargs)
    masking = a["masking"]
    lead = torch.broadcast_shapes(a["q"].shape[:-2], a["k"].shape[:-2], a["v"].shape[:-2])
    q, k, v = (a[name].expand(*lead, *a[name].shape[-2:]) for name in "qkv")
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    call = AttentionCall(site.module, "attnpanel", q, k, float(scale), None, dtype=q.dtype)
    call.v, call.context = v, result[0]
    length, n_keys = q.shape[-2], k.shape[-2]
    blocks = masking.mode != "none" or masking.key_padding is not None
    call.fill = fill_words((masking.fill,) if blocks else (), masking.bias)
    if recorder.records_weights(lead, length, n_keys):
        call.blocked = masking.blocked(slice(0, length), slice(0, n_keys), q.device)
        call.bias = masking.bias_tile(slice(0, length), slice(0, n_keys))
        call.weights = recompute(q, k, call.scale, call.blocked, call.bias)
    elif masking.bias is not None:
        call.unsupported = _HAS_BIAS
    else:
        padding = masking.key_padding
        if padding is not None:
            padding = padding[:, None, :].expand(*lead, n_keys)
        call.virtual = VirtualForm(result[1].reshape(*lead, length).float(), masking.mode, padding)
    recorder.record_call(call, site)
    return result


@dataclass(frozen=True)
class MhaHeads:
    """What ``F.multi_head_attention_forward`` computes inside, per head, from its bound
    arguments: q, k, v ``(B, H, n, E)``, the masks as it reads them, its projections."""

    x: torch.Tensor  # (B, L, D) the query input
    q: torch.Tensor  # (B, H, L, E)
    k: torch.Tensor  # (B, H, S, E)
    v: torch.Tensor  # (B, H, S, E)
    mask: torch.Tensor | None  # attn_mask, (L, S) or (B, H, L, S)
    padding: torch.Tensor | None  # key_padding_mask as (B, 1, 1, S)
    weights: tuple  # w_q, w_k, w_v
    biases: tuple  # b_q, b_k, b_v (None each without in_proj_bias)
    scale: float

    @classmethod
    def of(cls, a: dict) -> MhaHeads:
        query, key, value, heads = a["query"], a["key"], a["value"], a["num_heads"]
        unbatched = query.dim() == 2
        seq_first = [t[:, None] if unbatched else t for t in (query, key, value)]  # (L, B, D)
        xq, xk, xv = (t.transpose(0, 1) for t in seq_first)  # (B, L, D)
        if a["use_separate_proj_weight"]:
            w_q, w_k, w_v = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
        else:
            w_q, w_k, w_v = a["in_proj_weight"].chunk(3)
        b_q = b_k = b_v = None
        if a["in_proj_bias"] is not None:
            b_q, b_k, b_v = a["in_proj_bias"].chunk(3)
        q = _split(F.linear(xq, w_q, b_q), heads)  # (B, H, L, E)
        k = _split(F.linear(xk, w_k, b_k), heads)  # (B, H, S, E)
        v = _split(F.linear(xv, w_v, b_v), heads)  # (B, H, S, E)
        batch, _, length, head_dim = q.shape
        mask, padding = a["attn_mask"], a["key_padding_mask"]
        if mask is not None and mask.dim() == 3:
            mask = mask.view(batch, heads, length, k.shape[2])
        if padding is not None:
            padding = (padding[None] if unbatched else padding)[:, None, None, :]  # (B, 1, 1, S)
        return cls(xq, q, k, v, mask, padding, (w_q, w_k, w_v), (b_q, b_k, b_v), head_dim**-0.5)

    def masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(blocked, bias)`` of its attention mask and key padding together."""
        return mha_mask(self.mask, self.padding)


@reads("multi_head_attention_forward")
def _read_mha(recorder: AttentionRecorder, site: Site, func, args, kwargs):
    result = func(*args, **kwargs)
    a = bind(MHA_SIGNATURE, args, kwargs)
    query, key, heads = a["query"], a["key"], a["num_heads"]
    call = AttentionCall(site.module, "multi_head_attention_forward", query, key, 1.0, query)
    call.dtype = query.dtype
    if a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None:
        call.unsupported = "add_bias_kv, add_zero_attn or static keys add keys beyond the input"
        recorder.record_call(call, site)
        return result
    unbatched = query.dim() == 2
    found = MhaHeads.of(a)
    q, k, v, mask, padding = found.q, found.k, found.v, found.mask, found.padding
    xq, (w_q, w_k, w_v), (b_q, b_k, b_v) = found.x, found.weights, found.biases
    batch, _, length, head_dim = q.shape
    n_keys = k.shape[2]
    call.q, call.k, call.v, call.scale = q, k, v, found.scale
    call.fill = " and ".join(dict.fromkeys(w for w in map(_mask_fill, (mask, padding)) if w))
    call.cross = not (query is key or (query.shape == key.shape and torch.equal(query, key)))
    if recorder.records_weights(q.shape[:-2], length, n_keys):
        call.blocked, call.bias = mha_mask(mask, padding)
        call.weights = recompute(q, k, call.scale, call.blocked, call.bias)  # (B, H, L, S)
        call.context = call.weights @ v.float()  # (B, H, L, E)
    else:
        try:
            blocked = _blocked_only(mask, true_allows=False)
            mode, blocked = _structure(blocked, q.shape[:-2], length, n_keys)
            keys = _blocked_only(padding, true_allows=False)  # (B, 1, 1, S)
            if keys is not None:
                keys = keys[:, :, 0].expand(batch, heads, n_keys)
                blocked = keys if blocked is None else blocked | keys
            call.virtual, context = _virtual_form(q, k, v, call.scale, mode, blocked)
            call.context = context.float()
        except UnsupportedAttention as error:
            call.unsupported = str(error)
            recorder.record_call(call, site)
            return result
    merged = call.context.transpose(1, 2).reshape(batch, length, heads * head_dim)  # (B, L, D)
    output = F.linear(merged, a["out_proj_weight"].float(), _float(a["out_proj_bias"]))
    actual = result[0][:, None] if unbatched else result[0]
    actual = actual.transpose(0, 1)  # (B, L, D)
    call.projections = {
        "x": xq,
        "output": actual,
        "w_q": w_q,
        "w_k": w_k,
        "w_v": w_v,
        "w_o": a["out_proj_weight"],
        "b_q": b_q,
        "b_k": b_k,
        "b_v": b_v,
        "b_o": a["out_proj_bias"],
    }
    if a["dropout_p"] and a["training"]:
        call.unsupported = f"attention dropout is on (dropout_p={a['dropout_p']})"
    else:
        error = float((output - actual.float()).abs().max())
        if not error <= tolerance(call.dtype) * max(1.0, float(actual.abs().max())):
            call.unsupported = (
                f"the weights from in_proj and the masks do not reproduce the output of "
                f"multi_head_attention_forward (max error {error:.3g})"
            )
    recorder.record_call(call, site)
    return result


def mha_mask(mask, padding) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(blocked, bias)`` of ``nn.MultiheadAttention``'s ``attn_mask`` and key padding."""
    blocked, bias = _mask_terms(mask, true_allows=False)
    extra_blocked, extra_bias = _mask_terms(padding, true_allows=False)
    if extra_bias is not None:
        bias = extra_bias if bias is None else bias + extra_bias
    return union(blocked, extra_blocked), bias


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _split(t: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = t.shape
    return t.reshape(batch, length, heads, width // heads).transpose(1, 2)  # (B, H, L, E)


@reads("softmax")
def _read_softmax(recorder: AttentionRecorder, site: Site, func, args, kwargs):
    result = func(*args, **kwargs)
    logits = args[0] if args else kwargs.get("input")
    info = site.scores
    if not isinstance(result, torch.Tensor):
        return result
    q, k = info.q, info.k
    lead = logits.shape[:-2]
    try:
        q = q.reshape(*lead, *q.shape[-2:])  # (*lead, L, E)
        k = k.reshape(*lead, *k.shape[-2:])  # (*lead, S, E)
    except RuntimeError:
        return result
    call = AttentionCall(site.module, "softmax", q, k, info.scale, result.detach())
    call.dtype = q.dtype
    call.unsupported = info.unsupported
    call.fill = fill_words(info.fill_values, info.bias)
    if not call.unsupported:
        blocked, bias = info.blocked, None
        if info.bias is not None:
            extra, bias = split_bias(info.bias)
            blocked = union(blocked, extra)
        call.blocked, call.bias = as_lead(blocked, lead), as_lead(bias, lead)
        _check_softmax(call, result)
    length, n_keys = result.shape[-2:]
    if not call.unsupported and not recorder.records_weights(lead, length, n_keys):
        _to_virtual(call)
    recorder.record_call(call, site)
    return result


def _to_virtual(call: AttentionCall) -> None:
    """Keep a checked softmax call's rows' lse instead of its weights (too large to hold)."""
    try:
        if call.bias is not None:
            raise UnsupportedAttention(_HAS_BIAS)
        lead, (length, n_keys) = call.q.shape[:-2], (call.q.shape[-2], call.k.shape[-2])
        mode, padding = _structure(call.blocked, lead, length, n_keys)
        call.virtual, _ = _virtual_form(call.q, call.k, None, call.scale, mode, padding)
    except UnsupportedAttention as error:
        call.unsupported = str(error)
    else:
        call.weights = call.blocked = None  # the model's own, not held beyond its use


def as_lead(t: torch.Tensor | None, lead: torch.Size) -> torch.Tensor | None:
    """A mask or bias broadcastable to ``(*lead, L, S)``, as the scores were viewed."""
    if t is None or t.dim() <= 2:
        return t
    if t.shape[:-2].numel() == lead.numel() or t.dim() != len(lead) + 2:
        return t.expand(*t.shape[:-2], *t.shape[-2:]).reshape(*lead, *t.shape[-2:])
    return t


def _check_softmax(call: AttentionCall, weights: torch.Tensor) -> None:
    """The model's weights must follow from q, k, the scale and the mask truth.

    Checked on an even spread of query rows (every row of a short sequence): a wrong
    scale, bias or mask shows in any row, and the whole check costs a few percent of
    the attention it checks.
    """
    rows = spread_rows(call.q.shape[-2], device=call.q.device)
    blocked = row_slice(call.blocked, rows)
    bias = row_slice(call.bias, rows)
    q = call.q.index_select(-2, rows)
    recomputed = recompute(q, call.k, call.scale, blocked, bias)
    difference = (recomputed - weights.index_select(-2, rows).float()).abs()
    if blocked is not None:
        empty = blocked.expand_as(difference).all(dim=-1, keepdim=True)
        difference = difference.masked_fill(empty, 0.0)  # a padding row: what the model made of it
    error = float(difference.max()) if difference.numel() else 0.0
    # the fixed floor tells a wrong scale or mask from rounding; past it, rounding may still
    # explain the error where the logits are large (trained models): the derived bound, which
    # costs another q . k on the checked rows, is asked only then
    allowed = tolerance(call.dtype)
    if error > allowed and call.dtype in precision.EPSILON:
        logits = precision.max_logit(q, call.k, call.scale, blocked, bias)
        allowed = max(allowed, precision.softmax_bound(call.dtype, logits))
    if not error <= allowed:  # NaN fails too
        call.unsupported = (
            f"its softmax weights do not follow from q.k, scale {call.scale:.4g} and the "
            f"additive terms (max error {error:.3g})"
        )

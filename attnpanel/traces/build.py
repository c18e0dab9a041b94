"""Building a trace: from the layer's own tensors, from captured parts, or by running
attnpanel's layer on an input (dense, or virtual past what fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels import masks, tiles
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.kernels.masks import MASK_MODES
from attnpanel.kernels.memory import available_memory
from attnpanel.traces import positions, virtual
from attnpanel.traces.positions import Layout
from attnpanel.traces.schema import ATTENTION_DIMS, CROSS_DIMS, EXPECTED_DIMS, QK_DIM
from attnpanel.traces.validate import validate


def _numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(t)


def _float32(array: np.ndarray) -> np.ndarray:
    """Half-precision values are stored as float32, which every format and view reads."""
    return array.astype(np.float32) if array.dtype == np.float16 else array


def _four(array: np.ndarray) -> np.ndarray:
    """``array`` with leading size-1 axes up to ``(batch, head, query, key)``, not broadcast."""
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def _minimal(array: np.ndarray, keep: Sequence[str] = ("key",)) -> tuple[tuple, np.ndarray]:
    """A ``(batch, head, query, key)`` array over only the dims it varies along."""
    dims = list(ATTENTION_DIMS)
    for axis in (2, 1, 0):
        name = ATTENTION_DIMS[axis]
        first = np.take(array, [0], axis=axis)
        if name not in keep and (array.shape[axis] == 1 or bool((array == first).all())):
            array = first
            dims.remove(name)
    squeeze = tuple(i for i, name in enumerate(ATTENTION_DIMS) if name not in dims)
    return tuple(dims), np.ascontiguousarray(np.squeeze(array, axis=squeeze))


def _given_cells(mask, shape: tuple) -> np.ndarray | None:
    """The cells ``mask=`` (a mode or a ``(query, key)`` bool array) blocks, True where
    blocked, for a trace whose mask truth is recorded (a ``bias`` beside it)."""
    if not isinstance(mask, str):
        cells = _numpy(mask).astype(bool)
        if cells.shape != tuple(shape[2:]):
            raise ValueError(
                f"mask= must be a (query, key) array of shape {tuple(shape[2:])}, got {cells.shape}"
            )
        return cells
    if mask not in MASK_MODES:
        raise ValueError(
            f"mask={mask!r} with a bias: give the blocked cells (blocked=) or a mode of "
            f"{MASK_MODES}"
        )
    length, n_keys = shape[2], shape[3]
    if mask == "none":
        return None
    if length != n_keys:
        raise ValueError(
            f"mask={mask!r} is a self-attention mode; this trace is {length} x {n_keys}"
        )
    return masks.build_mask(mask, length).numpy()


def _mask_truth(blocked, bias, shape: tuple, cross: bool) -> dict:
    """The ``mask`` argument and the variables that record a model's full mask.

    Works on the arrays as given (a padding mask ``(B, 1, 1, S)`` is never broadcast to
    ``(B, H, L, S)``), so recording the truth costs little beside the attention itself.
    """
    truth: dict = {"mask": "none"}
    batch, _, length, n_keys = shape
    if blocked is not None:
        blocked = _four(_numpy(blocked).astype(bool))
        if blocked.shape[2:] != (length, n_keys):  # rows or keys broadcast: make them whole
            blocked = np.broadcast_to(blocked, blocked.shape[:2] + (length, n_keys))
        shared = blocked.all(axis=(0, 1))  # (L, S) blocked in every sample and head
        if not cross and shared.any():
            modes = {
                "diagonal": np.eye(length, dtype=bool),
                "causal": np.triu(np.ones((length, length), dtype=bool), 1),
            }
            same = (m for m, cells in modes.items() if (cells == shared).all())
            truth["mask"] = next(same, shared)
        elif shared.any():
            truth["mask"] = shared
        if blocked.shape[:2] != (1, 1) and not (blocked == shared).all():
            dims, values = _minimal(blocked, keep=("key",))
            if "batch" in dims or "head" in dims:
                truth["sample_mask"] = (dims, values)
        padding = blocked.all(axis=(1, 2))  # (B or 1, S): keys no query may see
        if not cross and padding.any():
            padding = np.broadcast_to(padding, (batch, n_keys))
            truth["padding"] = (("batch", "position"), np.ascontiguousarray(padding))
    if bias is not None:
        bias = _four(_float32(_numpy(bias)))
        if blocked is not None:
            bias = np.where(blocked, np.float32(0), bias)
        if np.any(bias != 0):
            bias = np.broadcast_to(
                bias, tuple(n if axis >= 2 else bias.shape[axis] for axis, n in enumerate(shape))
            )
            dims, values = _minimal(bias, keep=("key",))
            truth["bias"] = (dims, values.astype(np.float32, copy=False))
    return truth


def build_trace(
    *,
    weights=None,
    lse=None,
    x=None,
    q=None,
    k=None,
    v=None,
    scores=None,
    context=None,
    output=None,
    w_q=None,
    w_k=None,
    w_v=None,
    w_o=None,
    mask: str | np.ndarray | torch.Tensor = "none",
    blocked=None,
    bias=None,
    scale: float | None = None,
    time=None,
    layout: Layout | None = None,
    tokens: Sequence[Sequence[str]] | None = None,
    source: str = "",
    check: bool = True,
    cross: bool = False,
) -> xr.Dataset:
    """Assemble a trace from arrays; only ``weights`` is required (or ``lse``, ``q``, ``k``).

    Parameters
    ----------
    weights : array-like
        ``(batch, head, query, key)`` attention weights.
    lse : array-like, optional
        Instead of ``weights`` and ``scores``: ``(batch, head, query)``, the log-sum-exp
        of each row's logits (:func:`attnpanel.kernels.tiles.attention`), for a virtual trace whose
        maps are computed from ``q``, ``k`` and ``lse`` on demand (:mod:`attnpanel.traces.virtual`).
    x, output : array-like, optional
        ``(batch, position, feature)`` layer input and output.
    q, k, v : array-like, optional
        ``(batch, head, position, head_dim)`` per-head projections.
    scores : array-like, optional
        ``(batch, head, query, key)`` raw ``q . k`` before scaling.
    context : array-like, optional
        ``(batch, head, query, head_dim)``.
    w_q, w_k, w_v, w_o : array-like, optional
        ``(out, in)`` projection matrices, as ``nn.Linear.weight``.
    mask : str or bool array
        A mode name, or a ``(query, key)`` bool array (stored as variable ``mask``).
        Ignored when ``blocked`` is given; beside a ``bias`` without ``blocked``, its cells
        are the blocked ones.
    blocked : bool array, optional
        Every cell the model blocked, broadcastable to ``(batch, head, query, key)``
        (True = blocked): the mask truth of a captured model. It is stored as the mode or
        ``mask`` shared by every sample and head plus, where it differs between them,
        ``sample_mask`` over only the dims it varies along; keys blocked for every query
        of a sample are marked in ``padding``.
    bias : float array, optional
        The additive bias the model put on the scaled scores, broadcastable to
        ``(batch, head, query, key)`` (ALiBi, relative position bias, a float mask);
        stored as ``bias`` over only the dims it varies along, 0 on blocked cells.
    scale : float, optional
        Score multiplier; defaults to ``head_dim ** -0.5`` when ``head_dim`` is known.
    time : array-like, optional
        Timestamps, ``(position,)`` or ``(batch, position)``; stored as ``datetime64[ns]``
        (a time zone, if any, is converted to UTC and kept in the ``time_zone`` attribute).
        With ``layout``, the input's own ``T`` timestamps instead, laid out over the
        positions.
    layout : attnpanel.traces.positions.Layout, optional
        What the positions are beyond time steps: named tokens before or after them,
        spans (patches); see :mod:`attnpanel.traces.positions`.
    tokens : list of list of str, optional
        Token strings, one list per batch item.
    source : str
        Where the trace came from (a model or file name).
    cross : bool
        The keys come from another sequence (cross-attention); implied when the query
        and key lengths differ. Then ``k`` and ``v`` are indexed by ``key``.
    check : bool
        Run :func:`validate` on the result (callers that have checked their own arrays
        more cheaply, as :func:`trace` does, skip it).

    Returns
    -------
    xarray.Dataset
        Arrays are wrapped without copying where possible.
    """
    ds = trace_parts(
        weights=weights,
        lse=lse,
        x=x,
        q=q,
        k=k,
        v=v,
        scores=scores,
        context=context,
        output=output,
        w_q=w_q,
        w_k=w_k,
        w_v=w_v,
        w_o=w_o,
        mask=mask,
        blocked=blocked,
        bias=bias,
        scale=scale,
        time=time,
        layout=layout,
        tokens=tokens,
        source=source,
        cross=cross,
    ).dataset()
    if check:
        validate(ds)
    return ds


class TraceParts(NamedTuple):
    """What :func:`build_trace` wraps: ``xr.Dataset(data_vars, coords, attrs)``.

    Callers that assemble many traces (one per captured layer) work on the parts and make
    one Dataset per stack of layers, since building a Dataset costs more than the numbers.
    """

    data_vars: dict
    coords: dict
    attrs: dict

    def dataset(self) -> xr.Dataset:
        """The trace; a virtual one with its lazy maps (:func:`attnpanel.traces.virtual.attach`)."""
        return virtual.attach(xr.Dataset(self.data_vars, coords=self.coords, attrs=self.attrs))


def trace_parts(
    *,
    weights=None,
    lse=None,
    x=None,
    q=None,
    k=None,
    v=None,
    scores=None,
    context=None,
    output=None,
    w_q=None,
    w_k=None,
    w_v=None,
    w_o=None,
    mask: str | np.ndarray | torch.Tensor = "none",
    blocked=None,
    bias=None,
    scale: float | None = None,
    time=None,
    layout: Layout | None = None,
    tokens: Sequence[Sequence[str]] | None = None,
    source: str = "",
    cross: bool = False,
) -> TraceParts:
    """The parts of :func:`build_trace` (same arguments, less ``check``), not validated.

    With ``lse`` ``(batch, head, query)`` instead of ``weights`` (and ``scores``), the
    parts of a virtual trace (:mod:`attnpanel.traces.virtual`): ``q`` and ``k`` are then required.
    """
    given = dict(x=x, q=q, k=k, v=v, scores=scores, context=context, output=output)
    given.update(w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o)
    arrays = {name: _float32(_numpy(value)) for name, value in given.items() if value is not None}
    if lse is not None:
        if weights is not None or scores is not None:
            raise ValueError("give either lse (a virtual trace) or weights and scores, not both")
        if "q" not in arrays or "k" not in arrays:
            raise ValueError("a virtual trace (lse instead of weights) needs q and k")
        lse = _float32(_numpy(lse))
        if lse.ndim != 3:
            raise ValueError(f"lse must have dims {virtual.LSE_DIMS}, got shape {lse.shape}")
        batch, n_heads, length = lse.shape
        n_keys = arrays["k"].shape[2]
        weights_shape = (batch, n_heads, length, n_keys)
        data_vars = {virtual.LSE: (virtual.LSE_DIMS, lse)}
    else:
        if weights is None:
            raise ValueError("a trace needs weights (or lse, with q and k)")
        weights = _float32(_numpy(weights))
        if weights.ndim != 4:
            raise ValueError(
                f"weights must have dims {ATTENTION_DIMS}, got an array of {weights.ndim} "
                f"dims with shape {weights.shape}"
            )
        batch, n_heads, length, n_keys = weights_shape = weights.shape
        data_vars = {"weights": (ATTENTION_DIMS, weights)}
    cross = (
        cross
        or n_keys != length
        or any(arrays[n].shape[2] != length for n in ("k", "v") if n in arrays)
    )
    for name, value in arrays.items():
        dims = CROSS_DIMS[name] if cross and name in CROSS_DIMS else EXPECTED_DIMS[name]
        if value.ndim != len(dims):
            raise ValueError(f"{name} must have dims {dims}, got shape {value.shape}")
        data_vars[name] = (dims, value)
    widths = {n: arrays[n].shape[-1] for n in ("q", "k", "v", "context") if n in arrays}
    own = {w for n, w in widths.items() if n in ("v", "context")}
    if own and any(widths.get(n, next(iter(own))) not in own for n in ("q", "k")):
        for name in ("q", "k"):  # features of another width than the values (linear attention)
            if name in data_vars:
                dims, value = data_vars[name]
                data_vars[name] = ((*dims[:-1], QK_DIM), value)

    attrs = {"n_heads": n_heads, "source": source}
    if cross:
        attrs["attention"] = "cross"
    if blocked is None and bias is not None:  # mask= still says what is blocked
        blocked = _given_cells(mask, weights_shape)
    if blocked is not None or bias is not None:
        truth = _mask_truth(blocked, bias, weights_shape, cross)
        mask = truth.pop("mask")
        data_vars.update(truth)
    if isinstance(mask, str):
        if mask not in MASK_MODES + ("custom",):
            raise ValueError(f"unknown mask {mask!r}; expected one of {MASK_MODES}")
        attrs["mask"] = mask
    else:
        data_vars["mask"] = (("query", "key"), _numpy(mask).astype(bool))
        attrs["mask"] = "custom"
    d_model = next((arrays[n].shape[-1] for n in ("x", "output") if n in arrays), None)
    head_dim = next((arrays[n].shape[-1] for n in ("v", "context", "q", "k") if n in arrays), None)
    if d_model is None and head_dim is not None:
        d_model = head_dim * n_heads
    if head_dim is None and d_model is not None:
        head_dim = d_model // n_heads
    if d_model is not None:
        attrs["d_model"] = int(d_model)
    if head_dim is not None:
        attrs["head_dim"] = int(head_dim)
        attrs["scale"] = float(head_dim**-0.5 if scale is None else scale)
    elif scale is not None:
        attrs["scale"] = float(scale)

    coords = {
        "batch": np.arange(batch),
        "head": np.arange(n_heads),
        "query": np.arange(length),
        "key": np.arange(n_keys),
        "position": np.arange(length),
    }
    if head_dim is not None and any(n in data_vars for n in ("q", "k", "v", "context")):
        coords["head_dim"] = np.arange(head_dim)
    if d_model is not None and any(n in data_vars for n in ("x", "output")):
        coords["feature"] = np.arange(d_model)
    coords.update(positions.position_coords(time, layout, batch, length, attrs))
    if tokens is not None:
        tokens = np.asarray([list(row) for row in tokens], dtype=str)
        if tokens.shape != (batch, length):
            raise ValueError(
                f"tokens must be (batch, position) = {(batch, length)}, got {tokens.shape}"
            )
        coords["token"] = (("batch", "position"), tokens)
    return TraceParts(data_vars, coords, attrs)


def _all_finite(*tensors: torch.Tensor) -> bool:
    # aminmax is one fused pass that allocates nothing; NaN propagates into it
    for t in tensors:
        if t.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
            return False
    return True


@torch.no_grad()
def trace(
    layer: MultiHeadSelfAttention,
    x,
    *,
    time=None,
    tokens: Sequence[Sequence[str]] | None = None,
    source: str | None = None,
    dense: bool | None = None,
) -> xr.Dataset:
    """Run ``layer`` on ``x`` and return every intermediate as a trace.

    The layer runs in eval mode (no dropout), so the weights are the attention the model
    uses at inference; its training mode is restored afterwards. The trace is a snapshot:
    ``x`` and the projection matrices are copied, so later training does not change it.

    Parameters
    ----------
    layer : MultiHeadSelfAttention
        The layer to trace.
    x : torch.Tensor or numpy.ndarray
        ``(batch, length, d_model)`` input.
    time : array-like, optional
        Timestamps of the positions, ``(length,)`` or ``(batch, length)``.
    tokens : list of list of str, optional
        Token strings for text inputs.
    source : str, optional
        Description of the model; defaults to the layer's repr.
    dense : bool, optional
        Keep ``scores`` and ``weights`` as dense arrays (True), or record each row's
        log-sum-exp ``lse`` and compute the maps on demand (False: a virtual trace, see
        :mod:`attnpanel.traces.virtual`; the layer then runs in bounded memory at any length).
        By default dense when both maps fit :data:`attnpanel.traces.virtual.DENSE_MAX_BYTES`.

    Returns
    -------
    xarray.Dataset
        Variables ``x, q, k, v, scores, weights, context, output, w_q, w_k, w_v, w_o``
        (and ``lse`` in a virtual trace, whose ``scores`` and ``weights`` are lazy).

    Raises
    ------
    ValueError
        If ``x`` has the wrong shape or holds NaN or Inf, if its attention (dense) or its
        projections (virtual) would not fit in memory, or if the layer produced a
        non-finite value (named with its location).
    """
    dtype, device = layer.wq.weight.dtype, layer.wq.weight.device
    x = torch.as_tensor(x).to(dtype=dtype, device=device, copy=True)
    if x.dim() != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(
            f"x must have shape (batch, length, d_model={layer.d_model}), got {tuple(x.shape)}"
        )
    if 0 in x.shape:
        raise ValueError(
            f"x is empty (batch={x.shape[0]}, length={x.shape[1]}): a trace needs at least "
            "one sample and one position"
        )
    if not _all_finite(x):
        batch, position, feature = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(
            f"x contains NaN or Inf at batch={batch}, position={position}, feature={feature}"
        )
    batch, length = x.shape[:2]
    if not virtual.wants_dense(batch, layer.n_heads, length, length, dense):
        return _virtual_trace(layer, x, time=time, tokens=tokens, source=source)
    was_training = layer.training
    layer.eval()
    try:
        s = layer.stages(x)
    finally:
        layer.train(was_training)
    mask = layer.mask if layer.mask_name != "custom" else layer.mask.cpu().numpy()
    ds = build_trace(
        x=x,
        q=s.q,
        k=s.k,
        v=s.v,
        scores=s.scores,
        weights=s.weights,
        context=s.context,
        output=s.output,
        w_q=layer.wq.weight.detach().clone(),
        w_k=layer.wk.weight.detach().clone(),
        w_v=layer.wv.weight.detach().clone(),
        w_o=layer.wo.weight.detach().clone(),
        mask=mask,
        scale=layer.scale,
        time=time,
        tokens=tokens,
        source=source if source is not None else repr(layer),
        check=False,
    )
    # Our own layer built the weights by a masked softmax of the scores: finite scores
    # guarantee weights that are finite, non-negative, 0 where masked and rows summing to 1,
    # so one allocation-free pass over the scores replaces the full check of the weights.
    if not _all_finite(s.q, s.k, s.v, s.scores, s.context, s.output):
        validate(ds)  # names the variable and location
        raise ValueError("the layer produced NaN or Inf")
    _note_fill(ds, layer)
    return ds


def _note_fill(ds: xr.Dataset, layer: MultiHeadSelfAttention) -> None:
    """What the layer writes into a blocked cell (its dense path's rule), where it blocks."""
    if layer.mask_name != "none":
        ds.attrs["mask_fill"] = masks.fill_words((masks.MASK_FILL,))


PROJECTIONS_KEPT = 6  # x, q, k, v, context, output: (B, L, D) each in a virtual trace


def _virtual_trace(layer: MultiHeadSelfAttention, x: torch.Tensor, **labels) -> xr.Dataset:
    """:func:`trace` without the maps: the layer's forward in bounded memory
    (:func:`attnpanel.kernels.tiles.attention`), each row's ``lse`` recorded."""
    if layer.mask_name == "custom":
        raise ValueError(
            "a custom (L, L) mask tensor cannot be traced without dense maps: give the "
            "layer a mask mode, or trace it with dense=True"
        )
    check_projection_size(x.shape, layer.n_heads, x.dtype, x.device)
    with torch.no_grad():
        q = layer.split_heads(layer.wq(x))  # (B, H, L, E)
        k = layer.split_heads(layer.wk(x))
        v = layer.split_heads(layer.wv(x))
        context, lse = tiles.attention(q, k, v, masks.Masking(layer.mask), layer.scale)
        merged = context.transpose(1, 2).reshape(x.shape)  # (B, L, D)
        output = layer.wo(merged)
    source = labels.pop("source")
    ds = build_trace(
        x=x,
        q=q,
        k=k,
        v=v,
        lse=lse,
        context=context,
        output=output,
        w_q=layer.wq.weight.detach().clone(),
        w_k=layer.wk.weight.detach().clone(),
        w_v=layer.wv.weight.detach().clone(),
        w_o=layer.wo.weight.detach().clone(),
        mask=layer.mask,
        scale=layer.scale,
        source=source if source is not None else repr(layer),
        check=False,
        **labels,
    )
    if not _all_finite(q, k, v, lse, context, output):
        validate(ds)  # names the variable and location
        raise ValueError("the layer produced NaN or Inf")
    _note_fill(ds, layer)
    return ds


def check_projection_size(shape, n_heads: int, dtype=torch.float32, device=None) -> None:
    """Raise before a virtual trace's ``(B, L, D)`` arrays would not fit in memory.

    Raises
    ------
    ValueError
        Naming the length, the bytes the projections need and the bytes available.
    """
    batch, length, d_model = (int(n) for n in shape)
    per_array = batch * length * d_model * torch.empty((), dtype=dtype).element_size()
    needed = PROJECTIONS_KEPT * per_array + 2 * batch * n_heads * length * 8  # + lse
    budget = available_memory(device)
    if needed > budget:
        raise ValueError(
            f"a sequence of {length:,} positions (batch {batch}, d_model {d_model}) needs "
            f"{needed / 2**30:.3g} GiB for its projections (q, k, v, the context and the "
            f"input and output, {per_array / 2**30:.3g} GiB each) but only "
            f"{budget / 2**30:.3g} GiB may be used: trace a shorter window or fewer samples"
        )

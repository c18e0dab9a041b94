"""The trace: one ``xarray.Dataset`` per attention layer, holding every intermediate.

This is the data model every view reads (see ``docs/trace.md``). Attention-shaped arrays
have dims ``(batch, head, query, key)``; per-timestep vectors ``(batch, position,
feature)``; per-head vectors ``(batch, head, position, head_dim)``; a multi-layer trace
puts ``layer`` in front. A trace captured from a model that exposes only some tensors
holds what is known; :func:`validate` checks what is there.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

import dask
import numpy as np
import pandas as pd
import torch
import xarray as xr

from attnpanel import tiles, virtual
from attnpanel.attention import (
    MASK_FILL,
    MASK_MODES,
    MultiHeadSelfAttention,
    attend,
    available_memory,
    cached_mask,
    check_attention_size,
)

ATTENTION_DIMS = ("batch", "head", "query", "key")
EXPECTED_DIMS = {  # in pipeline order
    "x": ("batch", "position", "feature"),
    "q": ("batch", "head", "position", "head_dim"),
    "k": ("batch", "head", "position", "head_dim"),
    "v": ("batch", "head", "position", "head_dim"),
    "scores": ATTENTION_DIMS,
    "weights": ATTENTION_DIMS,
    "lse": ("batch", "head", "query"),  # a virtual trace's rows (attnpanel.virtual)
    "context": ("batch", "head", "query", "head_dim"),
    "output": ("batch", "position", "feature"),
    "w_q": ("feature_out", "feature_in"),
    "w_k": ("feature_out", "feature_in"),
    "w_v": ("feature_out", "feature_in"),
    "w_o": ("feature_out", "feature_in"),
    "mask": ("query", "key"),
    "padding": ("batch", "position"),
}
# Cross-attention traces index k and v by the key side's own positions.
CROSS_DIMS = {
    "k": ("batch", "head", "key", "head_dim"),
    "v": ("batch", "head", "key", "head_dim"),
}
# The mask truth of a captured model: any ordered subset of the attention dims that holds
# ``key`` (padding varies by (batch, key), T5's bias by (head, query, key), ...).
MASK_TRUTH = ("sample_mask", "bias")
STAGES = ("raw", "scaled", "masked", "softmax")
ROW_SUM_TOLERANCE = 1e-3


def _numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(t)


def _time_coord(time) -> tuple[np.ndarray, dict]:
    """Timestamps as ``datetime64[ns]`` (what netCDF and zarr read back) and their zone."""
    attrs = {}
    if isinstance(time, pd.Series):
        time = pd.DatetimeIndex(time) if isinstance(time.dtype, pd.DatetimeTZDtype) else time
    if isinstance(time, pd.DatetimeIndex) and time.tz is not None:
        attrs["time_zone"] = str(time.tz)  # stored as naive UTC, which both formats keep
        time = time.tz_convert("UTC").tz_localize(None)
    time = np.asarray(time)
    if time.dtype.kind == "O":  # numpy's own dtype for the values (numbers, text), if any
        time = np.asarray(time.tolist())
    if time.dtype.kind in "OSU":  # text: dates written out ("2024-05-01 08:00"), or not
        time = _parse_dates(time)
    if time.dtype.kind == "M":
        time = time.astype("datetime64[ns]")
    elif time.dtype.kind not in "iuf":
        raise ValueError(f"time must be numbers or dates, got {time.dtype} values")
    return time, attrs


def _parse_dates(text: np.ndarray) -> np.ndarray:
    """Timestamps written as text, as ``datetime64``; text that is no date is refused."""
    try:
        parsed = pd.to_datetime(text.ravel(), format="mixed")
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"time holds text that is not a date ({error}); give numbers or dates, and "
            "labels such as words as tokens="
        ) from None
    if getattr(parsed, "tz", None) is not None:
        parsed = parsed.tz_convert("UTC").tz_localize(None)
    return np.asarray(parsed, dtype="datetime64[ns]").reshape(text.shape)


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
        of each row's logits (:func:`attnpanel.tiles.attention`), for a virtual trace whose
        maps are computed from ``q``, ``k`` and ``lse`` on demand (:mod:`attnpanel.virtual`).
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
        Ignored when ``blocked`` is given.
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
        """The trace; a virtual one with its lazy maps (:func:`attnpanel.virtual.attach`)."""
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
    tokens: Sequence[Sequence[str]] | None = None,
    source: str = "",
    cross: bool = False,
) -> TraceParts:
    """The parts of :func:`build_trace` (same arguments, less ``check``), not validated.

    With ``lse`` ``(batch, head, query)`` instead of ``weights`` (and ``scores``), the
    parts of a virtual trace (:mod:`attnpanel.virtual`): ``q`` and ``k`` are then required.
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

    attrs = {"n_heads": n_heads, "source": source}
    if cross:
        attrs["attention"] = "cross"
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
    head_dim = next((arrays[n].shape[-1] for n in ("q", "k", "v", "context") if n in arrays), None)
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
    if time is not None:
        time, time_attrs = _time_coord(time)
        attrs.update(time_attrs)
        expected = (length,) if time.ndim == 1 else (batch, length)
        if time.shape != expected:
            raise ValueError(
                f"time must be (position,) = ({length},) or (batch, position) = "
                f"{(batch, length)}, got {time.shape}"
            )
        coords["time"] = (("position",) if time.ndim == 1 else ("batch", "position"), time)
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
        :mod:`attnpanel.virtual`; the layer then runs in bounded memory at any length).
        By default dense when both maps fit :data:`attnpanel.virtual.DENSE_MAX_BYTES`.

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
    return ds


PROJECTIONS_KEPT = 6  # x, q, k, v, context, output: (B, L, D) each in a virtual trace


def _virtual_trace(layer: MultiHeadSelfAttention, x: torch.Tensor, **labels) -> xr.Dataset:
    """:func:`trace` without the maps: the layer's forward in bounded memory
    (:func:`attnpanel.tiles.attention`), each row's ``lse`` recorded."""
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
        context, lse = tiles.attention(q, k, v, tiles.Masking(layer.mask), layer.scale)
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


def trace_mask(ds: xr.Dataset, mask=None) -> torch.Tensor | None:
    """The ``(query, key)`` bool mask shared by every sample and head, for a mode.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.
    mask : str or bool array, optional
        ``"none"``, ``"diagonal"``, ``"causal"``, ``"custom"`` (the trace's ``mask``
        variable) or a ``(query, key)`` bool array; defaults to the trace's own mode.

    Returns
    -------
    torch.Tensor or None
        True = blocked; mode masks are cached and shared, so treat the result as read-only.
        Per-sample cells (padding) are not in it: see :func:`blocked_cells`.
    """
    mask = ds.attrs.get("mask", "none") if mask is None else mask
    length, n_keys = ds.sizes["query"], ds.sizes["key"]
    if isinstance(mask, str) and mask == "custom":
        if "mask" not in ds:
            raise ValueError("this trace's mask is 'custom' but it holds no 'mask' variable")
        mask = ds["mask"].values
    if isinstance(mask, str):
        if mask != "none" and length != n_keys:
            raise ValueError(
                f"mask {mask!r} needs as many queries as keys; this cross-attention trace has "
                f"{length} queries and {n_keys} keys"
            )
        return cached_mask(mask, length)
    blocked = torch.as_tensor(np.asarray(mask, dtype=bool))
    if tuple(blocked.shape) != (length, n_keys):
        raise ValueError(
            f"mask has shape {tuple(blocked.shape)} but the trace needs ({length}, {n_keys})"
        )
    return blocked


def mask_options(ds: xr.Dataset) -> list[str]:
    """The masks a trace can be shown under: its own, and every mode its q and k allow."""
    own = ds.attrs.get("mask", "none")
    if "q" not in ds or "k" not in ds:
        return [own]  # without q and k only the trace's own weights exist
    if ds.attrs.get("attention") == "cross":
        return list(dict.fromkeys(["none", own]))  # diagonal and causal need L = S
    return list(MASK_MODES) + (["custom"] if "mask" in ds else [])


def _own(ds: xr.Dataset, mask) -> bool:
    own = ds.attrs.get("mask", "none")
    return mask is None or (isinstance(mask, str) and mask == own)


def _select(da: xr.DataArray, batch: int | None, head: int | None) -> xr.DataArray:
    selection = {d: i for d, i in (("batch", batch), ("head", head)) if i is not None}
    return da.isel({d: i for d, i in selection.items() if d in da.dims})


def blocked_cells(
    ds: xr.Dataset, mask=None, batch: int | None = None, head: int | None = None
) -> xr.DataArray | None:
    """Every cell blocked under a mask, per sample and head where the trace says so.

    This is the one rule every recomputation follows. Under the trace's own mask it is
    exactly what the model blocked (``sample_mask`` where the trace has one). Under another
    mode the shared part is replaced by that mode and what the model blocked per sample
    or head (padding, say) is kept.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.
    mask : str or bool array, optional
        A mode (see :func:`trace_mask`); defaults to the trace's own.
    batch, head : int, optional
        One sample and/or one head (by position).

    Returns
    -------
    xarray.DataArray or None
        bool, True = blocked, over ``(batch, head, query, key)`` less the selected dims and
        less any dim it does not vary along (xarray broadcasts it); None when nothing is
        blocked.
    """
    shared = trace_mask(ds, mask)
    shared = None if shared is None else xr.DataArray(shared.numpy(), dims=("query", "key"))
    if "sample_mask" not in ds:
        if "padding" not in ds:
            return shared
        # a virtual trace records padded keys alone (no (L, S) cells): blocked for every query
        padded = _select(ds["padding"], batch, None).rename(position="key")
        return padded if shared is None else padded | shared
    per_sample = _select(ds["sample_mask"], batch, head)
    if _own(ds, mask):
        return per_sample
    own = trace_mask(ds)
    extra = (
        per_sample
        if own is None
        else per_sample & ~xr.DataArray(own.numpy(), dims=("query", "key"))
    )
    if "padding" in ds:  # a padded key stays blocked for every query, itself included
        extra = extra | _select(ds["padding"], batch, None).rename(position="key")
    return extra if shared is None else extra | shared


def masked_cells(
    ds: xr.Dataset, mask=None, batch: int = 0, head: int | None = None
) -> np.ndarray | None:
    """The ``(query, key)`` cells a map of one sample draws as masked, or None.

    Those the mask blocks (for ``head``, or in every head when ``head`` is None, as a head
    average sees them) and the rows and columns of padded positions (``padding``): a
    padded query's row holds nothing the model uses, so it is not drawn as attention.
    """
    length, n_keys = ds.sizes["query"], ds.sizes["key"]
    hidden = np.zeros((length, n_keys), dtype=bool)
    blocked = blocked_cells(ds, mask, batch=batch, head=head)
    if blocked is not None:
        if "head" in blocked.dims:
            blocked = blocked.all("head")
        if "batch" in blocked.dims:  # a mask truth without the sample dim selected
            blocked = blocked.all("batch")
        order = [d for d in ("query", "key") if d in blocked.dims]
        shape = tuple(
            n if d in blocked.dims else 1 for d, n in (("query", length), ("key", n_keys))
        )
        hidden |= np.asarray(blocked.transpose(*order).values, dtype=bool).reshape(shape)
    if "padding" in ds:
        padded = np.asarray(_select(ds["padding"], batch, None).values, dtype=bool)  # (L,)
        hidden[padded, :] = True
        if n_keys == length:
            hidden[:, padded] = True
    return hidden if hidden.any() else None


def attention_bias(
    ds: xr.Dataset, batch: int | None = None, head: int | None = None
) -> xr.DataArray | None:
    """The additive bias the model put on the scaled scores (``bias``), or None."""
    return _select(ds["bias"], batch, head) if "bias" in ds else None


def _aligned(da: xr.DataArray | None, dims: tuple[str, ...]) -> torch.Tensor | None:
    """A tensor broadcastable over ``dims`` (size-1 axes where ``da`` does not vary)."""
    if da is None:
        return None
    order = [d for d in dims if d in da.dims]
    values = np.asarray(da.transpose(*order).values)
    shape = tuple(da.sizes[d] if d in da.dims else 1 for d in dims)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(shape))


def _require(ds: xr.Dataset, *names: str) -> None:
    missing = [n for n in names if n not in ds]
    if missing:
        raise KeyError(
            f"this trace has no {', '.join(missing)} (it holds {', '.join(map(str, ds.data_vars))})"
        )


def recompute_weights(ds: xr.Dataset, mask, batch: int | None = None) -> xr.DataArray:
    """Attention weights for another mask mode, from the trace's ``q`` and ``k`` only.

    Per-sample cells the model blocked (padding) and its additive ``bias`` are kept: see
    :func:`blocked_cells`.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``q`` and ``k``.
    mask : {"none", "diagonal", "causal", "custom"} or bool array
        The mask to apply.
    batch : int, optional
        One sample (by position) instead of the whole batch.

    Returns
    -------
    xarray.DataArray
        ``(batch, head, query, key)`` weights; ``batch`` is dropped when one is chosen.
    """
    _check_index(ds, "batch", batch)
    _require(ds, "q", "k")
    if virtual.is_virtual(ds):
        return virtual.stage(ds, "softmax", mask, batch)
    return _recompute(ds, "softmax", mask, batch, None)


def _check_index(ds: xr.Dataset, dim: str, index: int | None) -> None:
    if index is None:
        return
    size = ds.sizes[dim]
    if not isinstance(index, int | np.integer) or not -size <= int(index) < size:
        raise ValueError(
            f"{dim} {index!r} is out of range: this trace has {size} ({dim} 0-{size - 1})"
        )


def attention_stage(
    ds: xr.Dataset,
    stage: str = "softmax",
    mask=None,
    batch: int | None = None,
    head: int | None = None,
) -> xr.DataArray:
    """One stage of the score-to-weight pipeline, recomputed from ``q`` and ``k``.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``q`` and ``k`` (or ``weights`` alone for the softmax stage of the
        trace's own mask, ``scores`` alone for the raw stage).
    stage : {"raw", "scaled", "masked", "softmax"}
        ``q . k``; times ``scale`` (plus the model's additive ``bias``); with blocked
        cells filled by ``-1e4``; the weights.
    mask : str or bool array, optional
        Mask mode (see :func:`blocked_cells`); defaults to the trace's own, for which the
        softmax stage is the model's own ``weights`` where the trace holds them.
    batch, head : int, optional
        Select one sample and/or one head (by position) before computing; on a lazy trace
        only that slice of ``q`` and ``k`` is read.

    Returns
    -------
    xarray.DataArray
        Dims ``(batch, head, query, key)`` less the selected ones.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    _check_index(ds, "batch", batch)
    _check_index(ds, "head", head)
    if stage == "softmax" and _own(ds, mask) and "weights" in ds:
        return _select(ds["weights"], batch, head).rename("softmax")
    if "q" not in ds or "k" not in ds:
        if stage == "raw" and "scores" in ds:
            return _select(ds["scores"], batch, head)
        _require(ds, "q", "k")
    if virtual.is_virtual(ds):
        return virtual.stage(ds, stage, mask, batch, head)
    return _recompute(ds, stage, mask, batch, head)


def _recompute(ds: xr.Dataset, stage: str, mask, batch, head) -> xr.DataArray:
    if "scale" not in ds.attrs:
        raise ValueError("this trace has no 'scale' attribute, so its scores cannot be scaled")
    q = _select(ds["q"], batch, head).rename(position="query")
    k = _select(ds["k"], batch, head)
    k = k.rename(position="key") if "position" in k.dims else k
    dims = tuple(d for d in q.dims if d != "head_dim") + ("key",)
    shape = tuple(q.sizes[d] for d in dims[:-1]) + (k.sizes["key"],)
    check_attention_size(shape, count=2)
    qt = torch.from_numpy(np.ascontiguousarray(q.values))
    kt = torch.from_numpy(np.ascontiguousarray(k.values))
    blocked = _aligned(blocked_cells(ds, mask, batch, head), dims)
    bias = _aligned(attention_bias(ds, batch, head), dims)
    with torch.no_grad():
        if stage == "softmax":
            _, values = attend(qt, kt, blocked, ds.attrs["scale"], bias=bias)
        else:
            values = qt @ kt.transpose(-2, -1)  # (..., L, S)
            if stage != "raw":
                values = values * ds.attrs["scale"]
                if bias is not None:
                    values = values + bias
            if stage == "masked" and blocked is not None:
                values = values.masked_fill(blocked, MASK_FILL)
    coords = {name: c for name, c in q.coords.items() if set(c.dims) <= set(dims)}
    coords["key"] = ds["key"]
    return xr.DataArray(values.numpy(), dims=dims, coords=coords, name=stage)


def _first_bad(bad: xr.DataArray) -> dict[str, int]:
    """Index of the first True cell of a (possibly lazy) bool array, dim by dim."""
    location = {}
    flags = bad
    for dim in bad.dims:
        others = [d for d in flags.dims if d != dim]
        per_dim = flags.any(others) if others else flags
        index = int(np.argmax(np.asarray(per_dim.values)))
        location[dim] = index
        flags = flags.isel({dim: index})
    return location


def _where(location: dict[str, int]) -> str:
    return ", ".join(f"{dim}={index}" for dim, index in location.items())


def _check_structure(ds: xr.Dataset) -> None:
    if "weights" not in ds:
        held = ", ".join(map(str, ds.data_vars)) or "nothing"
        raise ValueError(f"trace has no 'weights' variable (it holds {held})")
    for name, expected in EXPECTED_DIMS.items():  # pipeline order, whatever the file's order
        if name not in ds.data_vars:
            continue
        var = ds[name]
        allowed = {expected, CROSS_DIMS.get(name, expected)}
        if var.dims in allowed | {("layer",) + dims for dims in allowed}:
            continue
        missing = [d for d in expected if d not in var.dims]
        extra = [d for d in var.dims if d not in expected and d != "layer"]
        detail = "; ".join(
            part
            for part in (
                f"missing {', '.join(missing)}" if missing else "",
                f"unexpected {', '.join(extra)}" if extra else "",
                "in the wrong order" if not (missing or extra) else "",
            )
            if part
        )
        raise ValueError(f"{name} has dims {var.dims}, expected {expected} ({detail})")
    if ds["weights"].dtype.kind != "f":
        raise ValueError(f"weights must be floating point, got {ds['weights'].dtype}")
    if ds["weights"].size == 0:
        raise ValueError(f"weights are empty (sizes {dict(ds['weights'].sizes)})")
    cross = ds.attrs.get("attention") == "cross"
    if not cross and ds.sizes["query"] != ds.sizes["key"]:
        raise ValueError(
            "self-attention needs as many queries as keys, got query "
            f"{ds.sizes['query']} and key {ds.sizes['key']}"
        )
    for name in MASK_TRUTH:
        if name not in ds:
            continue
        dims = [d for d in ds[name].dims if d != "layer"]
        if "key" not in dims or dims != [d for d in ATTENTION_DIMS if d in dims]:
            raise ValueError(
                f"{name} has dims {ds[name].dims}; expected an ordered subset of "
                f"{ATTENTION_DIMS} that holds key"
            )
        kind = "b" if name == "sample_mask" else "f"
        if ds[name].dtype.kind != kind:
            raise ValueError(
                f"{name} must be {'bool' if kind == 'b' else 'float'}, got {ds[name].dtype}"
            )
    if "position" in ds.dims and ds.sizes["position"] != ds.sizes["query"]:
        raise ValueError(
            f"position has {ds.sizes['position']} steps but query has {ds.sizes['query']}"
        )
    if "n_heads" in ds.attrs and int(ds.attrs["n_heads"]) != ds.sizes["head"]:
        raise ValueError(
            f"attribute n_heads is {ds.attrs['n_heads']} but the head dim has "
            f"{ds.sizes['head']} entries"
        )
    mask = ds.attrs.get("mask", "none")
    if mask not in MASK_MODES + ("custom",):
        raise ValueError(f"attribute mask is {mask!r}; expected one of {MASK_MODES + ('custom',)}")
    if mask == "custom" and "mask" not in ds:
        raise ValueError("attribute mask is 'custom' but the trace holds no 'mask' variable")
    if "q" in ds and "k" in ds:
        scale = ds.attrs.get("scale")
        if not isinstance(scale, (int, float, np.number)) or not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"attribute scale must be a positive number, got {scale!r}")


def _tensor(block) -> torch.Tensor | None:
    """A numpy float array as a tensor (no copy), or None where torch cannot share it."""
    if not isinstance(block, np.ndarray) or block.dtype not in (np.float16, np.float32, np.float64):
        return None
    if any(stride < 0 for stride in block.strides):
        return None
    with warnings.catch_warnings():  # read-only views (broadcasts) are only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(block)


def _extremes(array: xr.DataArray) -> tuple:
    """``(min, max)``, NaN propagated; lazy for a lazy array.

    An in-memory array is reduced by torch's one-pass kernel, several times faster than
    numpy's single-threaded reductions.
    """
    tensor = _tensor(array.data)
    if tensor is None:
        return array.min(skipna=False).data, array.max(skipna=False).data
    low, high = torch.aminmax(tensor)
    return low.item(), high.item()


BATCHED_EXTREMES = 2**22  # elements: a small trace's variables are reduced in one call


def _every_extreme(ds: xr.Dataset, floats: list[str]) -> dict:
    """``{(name, "min" | "max"): value}`` of every float variable, lazy where the data is.

    The float32 variables of a small in-memory trace other than ``weights`` (whose minimum
    is checked itself) are reduced in one torch call: what matters of them is that they are
    finite, and one call costs what each of a dozen small ones does. If they are not,
    each is reduced alone so that the first one at fault is named.
    """
    found = {}
    tensors = {name: _tensor(ds.variables[name].data) for name in floats if name != "weights"}
    batched = [n for n, t in tensors.items() if t is not None and t.dtype == torch.float32]
    if len(batched) > 1 and sum(tensors[n].numel() for n in batched) <= BATCHED_EXTREMES:
        low, high = torch.aminmax(torch.cat([tensors[n].reshape(-1) for n in batched]))
        if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
            for name in batched:
                found[(name, "min")], found[(name, "max")] = low.item(), high.item()
    for name in floats:
        if (name, "min") not in found:
            found[(name, "min")], found[(name, "max")] = _extremes(ds[name])
    return found


def _row_totals(weights: xr.DataArray) -> xr.DataArray:
    """Each row's sum over ``key``; float16 rows summed in float32 so rounding cannot fail them."""
    tensor = _tensor(weights.data)
    if tensor is None or weights.dims[-1] != "key":
        sum_dtype = np.float32 if weights.dtype.itemsize < 4 else None
        return weights.sum("key", skipna=False, dtype=sum_dtype)
    totals = tensor.sum(-1, dtype=torch.float32 if tensor.dtype == torch.float16 else None)
    return xr.DataArray(totals.numpy(), dims=weights.dims[:-1])


def _check_finite(ds: xr.Dataset, floats: list[str], reductions: dict) -> dict:
    """Compute the reductions (in one dask pass) and raise at the first float variable
    that holds NaN or Inf, naming where; returns the computed values."""
    values = dict(zip(reductions, dask.compute(*reductions.values()), strict=True))
    for name in floats:
        low, high = float(values[(name, "min")]), float(values[(name, "max")])
        if np.isnan(low) or np.isnan(high):
            where = _where(_first_bad(np.isnan(ds[name])))
            raise ValueError(f"{name} contains NaN at {where}")
        if np.isinf(low) or np.isinf(high):
            where = _where(_first_bad(np.isinf(ds[name])))
            raise ValueError(f"{name} contains Inf at {where}")
    return values


def validate(ds: xr.Dataset) -> xr.Dataset:
    """Check a trace against the contract and return it unchanged.

    Checks the dims of every known variable (an optional leading ``layer`` dim is allowed),
    that ``weights`` exists, that no float variable holds NaN or Inf, that weights are
    non-negative and that each row sums to 1. A virtual trace's lazy maps are not
    computed: its ``lse`` is checked instead (:func:`attnpanel.virtual.check`). All
    value checks of a dask-backed (lazy) trace run in one streaming pass, chunk by chunk,
    so it is never loaded whole; only when a check fails is the array searched again for
    the first offending location.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.

    Returns
    -------
    xarray.Dataset
        ``ds`` itself.

    Raises
    ------
    ValueError
        Naming the variable, what is wrong and the first offending location.
    """
    _check_structure(ds)
    lazy_maps = virtual.is_virtual(ds)  # computed from q, k and lse: checked through lse
    # in pipeline order, so a NaN is reported where it first appears, not where it spread to
    order = {name: i for i, name in enumerate(EXPECTED_DIMS)}
    floats = sorted(
        (
            str(n)
            for n, var in ds.data_vars.items()
            if var.dtype.kind == "f" and var.size and not (lazy_maps and n in virtual.MAPS)
        ),
        key=lambda name: order.get(name, len(order)),
    )
    if lazy_maps:
        _check_finite(ds, floats, _every_extreme(ds, floats))
        virtual.check(ds)
        return ds
    weights = ds["weights"]
    tolerance = max(ROW_SUM_TOLERANCE, 2 * float(np.finfo(weights.dtype).eps))
    totals = _row_totals(weights)
    row_error = abs(totals - 1)
    in_memory = isinstance(row_error.data, np.ndarray)
    # in memory, the mask is read only when some row fails (a fully blocked row may)
    blocked = None if in_memory and not row_error.max() > tolerance else blocked_cells(ds)
    if blocked is not None:
        # a row whose every key is blocked (a padding query) holds what the model made of it
        empty = blocked.all("key")
        row_error = xr.where(empty, np.minimum(row_error, abs(totals)), row_error)
        row_error = row_error.transpose(*totals.dims)
    reductions = _every_extreme(ds, floats)
    reductions[("weights", "row_error")] = row_error.max(skipna=False).data
    values = _check_finite(ds, floats, reductions)
    if float(values[("weights", "min")]) < 0:
        location = _first_bad(weights < 0)
        value = float(weights.isel(location))
        raise ValueError(f"weights are negative at {_where(location)} (value {value:.6g})")
    if float(values[("weights", "row_error")]) > tolerance:
        location = _first_bad(row_error > tolerance)
        total = float(weights.isel(location).sum(dtype=np.float64))
        raise ValueError(
            f"weights rows must sum to 1, but the row at {_where(location)} sums to {total:.6g}"
        )
    return ds

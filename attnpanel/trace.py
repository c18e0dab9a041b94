"""The trace: one ``xarray.Dataset`` per attention layer, holding every intermediate.

This is the data model every view reads (see ``docs/trace.md``). Attention-shaped arrays
have dims ``(batch, head, query, key)``; per-timestep vectors ``(batch, position,
feature)``; per-head vectors ``(batch, head, position, head_dim)``. A trace captured from
a model that exposes only some tensors holds what is known; :func:`validate` checks what is
there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from attnpanel.attention import MASK_FILL, MASK_MODES, MultiHeadSelfAttention, attend, build_mask

ATTENTION_DIMS = ("batch", "head", "query", "key")
EXPECTED_DIMS = {
    "x": ("batch", "position", "feature"),
    "q": ("batch", "head", "position", "head_dim"),
    "k": ("batch", "head", "position", "head_dim"),
    "v": ("batch", "head", "position", "head_dim"),
    "scores": ATTENTION_DIMS,
    "weights": ATTENTION_DIMS,
    "context": ("batch", "head", "query", "head_dim"),
    "output": ("batch", "position", "feature"),
    "w_q": ("feature_out", "feature_in"),
    "w_k": ("feature_out", "feature_in"),
    "w_v": ("feature_out", "feature_in"),
    "w_o": ("feature_out", "feature_in"),
    "mask": ("query", "key"),
}
STAGES = ("raw", "scaled", "masked", "softmax")
ROW_SUM_TOLERANCE = 1e-3


def _numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    return np.asarray(t)


def build_trace(
    *,
    weights,
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
    scale: float | None = None,
    time=None,
    tokens: Sequence[Sequence[str]] | None = None,
    source: str = "",
) -> xr.Dataset:
    """Assemble a trace from arrays; only ``weights`` is required.

    Parameters
    ----------
    weights : array-like
        ``(batch, head, query, key)`` attention weights.
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
    scale : float, optional
        Score multiplier; defaults to ``head_dim ** -0.5`` when ``head_dim`` is known.
    time : array-like, optional
        Timestamps, ``(position,)`` or ``(batch, position)``.
    tokens : list of list of str, optional
        Token strings, one list per batch item.
    source : str
        Where the trace came from (a model or file name).

    Returns
    -------
    xarray.Dataset
    """
    weights = _numpy(weights)
    if weights.ndim != 4:
        raise ValueError(
            f"weights must have dims {ATTENTION_DIMS}, got an array of {weights.ndim} dims "
            f"with shape {weights.shape}"
        )
    batch, n_heads, length, n_keys = weights.shape
    given = dict(x=x, q=q, k=k, v=v, scores=scores, context=context, output=output)
    given.update(w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o)
    data_vars = {"weights": (ATTENTION_DIMS, weights)}
    for name, value in given.items():
        if value is not None:
            data_vars[name] = (EXPECTED_DIMS[name], _numpy(value))

    attrs = {"n_heads": n_heads, "source": source}
    if isinstance(mask, str):
        if mask not in MASK_MODES + ("custom",):
            raise ValueError(f"unknown mask {mask!r}; expected one of {MASK_MODES}")
        attrs["mask"] = mask
    else:
        data_vars["mask"] = (("query", "key"), _numpy(mask).astype(bool))
        attrs["mask"] = "custom"
    d_model = next((_numpy(a).shape[-1] for a in (x, output) if a is not None), None)
    head_dim = next((_numpy(a).shape[-1] for a in (q, k, v, context) if a is not None), None)
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
        time = np.asarray(time)
        coords["time"] = (("position",) if time.ndim == 1 else ("batch", "position"), time)
    if tokens is not None:
        tokens = np.asarray([list(row) for row in tokens], dtype=str)
        if tokens.shape != (batch, length):
            raise ValueError(f"tokens must be (batch, position) = {(batch, length)}, got {tokens.shape}")
        coords["token"] = (("batch", "position"), tokens)
    ds = xr.Dataset(data_vars, coords=coords, attrs=attrs)
    validate(ds)
    return ds


@torch.no_grad()
def trace(
    layer: MultiHeadSelfAttention,
    x,
    *,
    time=None,
    tokens: Sequence[Sequence[str]] | None = None,
    source: str | None = None,
) -> xr.Dataset:
    """Run ``layer`` on ``x`` and return every intermediate as a trace.

    The layer runs in eval mode (no dropout), so the weights are the attention the model
    uses at inference; its training mode is restored afterwards.

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

    Returns
    -------
    xarray.Dataset
        Variables ``x, q, k, v, scores, weights, context, output, w_q, w_k, w_v, w_o``.
    """
    x = torch.as_tensor(x, dtype=layer.wq.weight.dtype, device=layer.wq.weight.device)
    if x.dim() != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(
            f"x must have shape (batch, length, d_model={layer.d_model}), got {tuple(x.shape)}"
        )
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or Inf")
    was_training = layer.training
    layer.eval()
    try:
        s = layer.stages(x)
    finally:
        layer.train(was_training)
    mask = layer.mask if layer.mask_name != "custom" else layer.mask.cpu().numpy()
    return build_trace(
        x=x,
        q=s.q,
        k=s.k,
        v=s.v,
        scores=s.scores,
        weights=s.weights,
        context=s.context,
        output=s.output,
        w_q=layer.wq.weight,
        w_k=layer.wk.weight,
        w_v=layer.wv.weight,
        w_o=layer.wo.weight,
        mask=mask,
        scale=layer.scale,
        time=time,
        tokens=tokens,
        source=source if source is not None else repr(layer),
    )


def trace_mask(ds: xr.Dataset, mask: str | None = None) -> torch.Tensor | None:
    """The ``(query, key)`` bool mask of a trace, or of another mode for its length."""
    mask = ds.attrs.get("mask", "none") if mask is None else mask
    length = ds.sizes["query"]
    if mask == "custom":
        return torch.from_numpy(np.asarray(ds["mask"].values, dtype=bool))
    return build_mask(mask, length)


def _require(ds: xr.Dataset, *names: str) -> None:
    missing = [n for n in names if n not in ds]
    if missing:
        raise KeyError(
            f"this trace has no {', '.join(missing)} (it holds {', '.join(map(str, ds.data_vars))})"
        )


def recompute_weights(ds: xr.Dataset, mask: str, batch: int | None = None) -> xr.DataArray:
    """Attention weights for another mask mode, from the trace's ``q`` and ``k`` only.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``q`` and ``k``.
    mask : {"none", "diagonal", "causal", "custom"}
        The mask mode to apply.
    batch : int, optional
        One sample (by position) instead of the whole batch.

    Returns
    -------
    xarray.DataArray
        ``(batch, head, query, key)`` weights; ``batch`` is dropped when one is chosen.
    """
    return attention_stage(ds, "softmax", mask=mask, batch=batch)


def attention_stage(
    ds: xr.Dataset,
    stage: str = "softmax",
    mask: str | None = None,
    batch: int | None = None,
    head: int | None = None,
) -> xr.DataArray:
    """One stage of the score-to-weight pipeline, recomputed from ``q`` and ``k``.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``q`` and ``k`` (or ``weights`` alone for the softmax stage of the
        trace's own mask).
    stage : {"raw", "scaled", "masked", "softmax"}
        ``q . k``; times ``scale``; with masked cells filled by ``-1e4``; the weights.
    mask : str, optional
        Mask mode; defaults to the trace's own.
    batch, head : int, optional
        Select one sample and/or one head (by position) before computing.

    Returns
    -------
    xarray.DataArray
        Dims ``(batch, head, query, key)`` less the selected ones.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    own_mask = ds.attrs.get("mask", "none")
    mask = own_mask if mask is None else mask
    selection = {d: i for d, i in (("batch", batch), ("head", head)) if i is not None}
    if "q" not in ds or "k" not in ds:
        if stage == "softmax" and mask == own_mask and "weights" in ds:
            return ds["weights"].isel(selection)
        if stage == "raw" and "scores" in ds:
            return ds["scores"].isel(selection)
        _require(ds, "q", "k")
    q = ds["q"].isel(selection).rename(position="query")
    k = ds["k"].isel(selection).rename(position="key")
    qt = torch.from_numpy(np.ascontiguousarray(q.values))
    kt = torch.from_numpy(np.ascontiguousarray(k.values))
    blocked = trace_mask(ds, mask)
    if stage == "softmax":
        _, values = attend(qt, kt, blocked, ds.attrs["scale"])
    else:
        values = torch.einsum("...le,...se->...ls", qt, kt)
        if stage != "raw":
            values = values * ds.attrs["scale"]
        if stage == "masked" and blocked is not None:
            values = values.masked_fill(blocked, MASK_FILL)
    dims = tuple(d for d in q.dims if d != "head_dim") + ("key",)
    coords = {name: c for name, c in q.coords.items() if set(c.dims) <= set(dims)}
    coords["key"] = ds["key"]
    return xr.DataArray(values.numpy(), dims=dims, coords=coords, name=stage)


def _first_bad(bad: xr.DataArray) -> str:
    """'batch=0, head=3, ...' for the first True cell of a (possibly lazy) bool array."""
    flags = bad
    location = []
    for dim in bad.dims:
        per_dim = flags.any([d for d in flags.dims if d != dim]) if flags.ndim > 1 else flags
        index = int(np.argmax(np.asarray(per_dim.values)))
        location.append(f"{dim}={index}")
        flags = flags.isel({dim: index})
    return ", ".join(location)


def validate(ds: xr.Dataset) -> xr.Dataset:
    """Check a trace against the contract and return it unchanged.

    Checks the dims of every known variable, that ``weights`` exists, that no float
    variable holds NaN or Inf, that weights are non-negative and that each row sums to 1.
    Dask-backed (lazy) traces are checked chunk by chunk, never loaded whole.

    Raises
    ------
    ValueError
        Naming the variable and the first offending location.
    """
    if "weights" not in ds:
        raise ValueError(f"trace has no 'weights' variable (it holds {', '.join(map(str, ds.data_vars)) or 'nothing'})")
    for name, dims in EXPECTED_DIMS.items():
        if name in ds and ds[name].dims != dims:
            raise ValueError(f"{name} has dims {ds[name].dims}, expected {dims}")
    for name in ("q", "k", "v", "x", "output"):
        if name in ds and ds.sizes["position"] != ds.sizes["query"]:
            raise ValueError(
                f"position has {ds.sizes['position']} steps but query has {ds.sizes['query']}"
            )
    if ds.sizes["query"] != ds.sizes["key"]:
        raise ValueError(f"self-attention needs query == key length, got {ds.sizes['query']} and {ds.sizes['key']}")
    for name, var in ds.data_vars.items():
        if not np.issubdtype(var.dtype, np.floating):
            continue
        bad = ~np.isfinite(var)
        if bool(bad.any()):
            raise ValueError(f"{name} contains NaN or Inf at {_first_bad(bad)}")
    weights = ds["weights"]
    negative = weights < 0
    if bool(negative.any()):
        raise ValueError(f"weights are negative at {_first_bad(negative)}")
    off = abs(weights.sum("key") - 1) > ROW_SUM_TOLERANCE
    if bool(off.any()):
        where = _first_bad(off)
        row = weights.isel({kv.split("=")[0]: int(kv.split("=")[1]) for kv in where.split(", ")})
        raise ValueError(f"weights rows must sum to 1, but the row at {where} sums to {float(row.sum()):.6g}")
    return ds

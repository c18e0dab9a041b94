"""A trace's masks and every stage recomputed from its own q, k and full mask truth:
raw scores, scaled, masked, softmax, under the trace's mask or another mode.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels.attention import attend
from attnpanel.kernels.masks import MASK_FILL, MASK_MODES, cached_mask
from attnpanel.kernels.memory import check_attention_size
from attnpanel.traces import virtual
from attnpanel.traces.schema import QK_DIM, STAGES


def normaliser(ds: xr.Dataset) -> str:
    """How the trace's rows of ``q . k`` became weights: "softmax", or "row sum" (a linear
    attention's: q and k hold its features)."""
    return ds.attrs.get("normaliser", "softmax")


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
    stage : {"raw", "scaled", "masked", "softmax", "value_weighted"}
        ``q . k``; times ``scale`` (plus the model's additive ``bias``); with blocked
        cells filled by ``-1e4``; the weights; the weights times ``|| v_j W_o^h ||``
        (:func:`value_norms`, Kobayashi et al. 2020).
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
    if stage == "value_weighted":
        weights = attention_stage(ds, "softmax", mask, batch, head)
        norms = value_norms(ds, batch)
        norms = norms if head is None else norms.isel(head=head)
        weighted = weights * norms.astype(np.float32).data[..., None, :]  # a_ij ||v_j W_o^h||
        return weighted.rename("value_weighted").assign_attrs(
            measure=f"a_ij * {norms.attrs['measure']}"
        )
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
    dims = tuple(d for d in q.dims if d not in ("head_dim", QK_DIM)) + ("key",)
    shape = tuple(q.sizes[d] for d in dims[:-1]) + (k.sizes["key"],)
    check_attention_size(shape, count=2)
    qt = torch.from_numpy(np.ascontiguousarray(q.values))
    kt = torch.from_numpy(np.ascontiguousarray(k.values))
    blocked = _aligned(blocked_cells(ds, mask, batch, head), dims)
    bias = _aligned(attention_bias(ds, batch, head), dims)
    kind = normaliser(ds)
    with torch.no_grad():
        if stage == "softmax":
            _, values = attend(qt, kt, blocked, ds.attrs["scale"], bias=bias, normaliser=kind)
        else:
            values = qt @ kt.transpose(-2, -1)  # (..., L, S)
            if stage != "raw":
                values = values * ds.attrs["scale"]
                if bias is not None:
                    values = values + bias
            if stage == "masked" and blocked is not None:  # (a row sum's blocked cells: 0)
                values = values.masked_fill(blocked, MASK_FILL if kind == "softmax" else 0)
    coords = {name: c for name, c in q.coords.items() if set(c.dims) <= set(dims)}
    coords["key"] = ds["key"]
    return xr.DataArray(values.numpy(), dims=dims, coords=coords, name=stage)


def value_norms(ds: xr.Dataset, batch: int | None = None) -> xr.DataArray:
    """``|| v_j W_o^h ||`` per sample, head and key position, float64 (``|| v_j ||`` for
    a trace without ``w_o``): what key ``j`` adds to the layer's output through head ``h``
    per unit of weight (Kobayashi et al. 2020).

    Parameters
    ----------
    ds : xarray.Dataset
        One layer's trace with ``v`` (and ``w_o``, ``(feature_out, H * head_dim)``, the
        heads merged head-major as ``nn.Linear`` takes them).
    batch : int, optional
        One sample (by position) only.
    """
    if "v" not in ds:
        raise ValueError(
            "value-weighted attention needs the trace's values 'v' (batch, head, key, "
            "head_dim); this trace holds none"
        )
    v = ds["v"] if batch is None else ds["v"].isel(batch=[batch])
    position = "position" if "position" in v.dims else "key"
    values = np.asarray(v.transpose("batch", "head", position, "head_dim").values, np.float64)
    heads, width = values.shape[1], values.shape[3]
    if "w_o" in ds:
        w_o = np.asarray(ds["w_o"].values, dtype=np.float64)  # (D_out, H * E)
        if w_o.shape[1] != heads * width:
            raise ValueError(
                f"w_o takes {w_o.shape[1]} merged features, not {heads} heads x {width}"
            )
        blocks = w_o.reshape(w_o.shape[0], heads, width)  # (D_out, H, E)
        contribution = np.einsum("bhje,dhe->bhjd", values, blocks)  # v_j W_o^h
        measure = "||v_j W_o^h||"
    else:
        contribution = values
        measure = "||v_j|| (w_o unknown)"
    norms = np.linalg.norm(contribution, axis=-1)  # (B, H, S)
    coords = {d: v[d] for d in ("batch", "head") if d in v.coords}
    if "key" in ds.coords:
        coords["key"] = ds["key"]
    found = xr.DataArray(
        norms,
        dims=("batch", "head", "key"),
        coords=coords,
        name="value_norm",
        attrs={"measure": measure},
    )
    return found if batch is None else found.isel(batch=0)

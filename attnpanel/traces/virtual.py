"""Virtual attention: a trace that holds each row's log-sum-exp instead of the maps.

A dense trace holds ``scores`` and ``weights`` as ``(batch, head, query, key)`` arrays:
``B x H x L x S x 4`` bytes each, 16 GiB at L = 16,384 with 8 heads and one sample. A
*virtual* trace holds ``q``, ``k``, ``v``, the mask (a mode, per-sample ``padding``) and
``lse`` ``(batch, head, query)``, the log-sum-exp of each row's logits, as the layer
computed it (:func:`attnpanel.kernels.tiles.attention`). Its ``weights`` and ``scores`` are
still labeled ``(batch, head, query, key)`` DataArrays, backed by lazy dask arrays whose
every chunk is computed exactly from ``q``, ``k`` and ``lse``
(:func:`attnpanel.kernels.tiles.lazy_weights`): slicing a window computes only that window, and
nothing ``L x S`` is ever held. Files store ``lse``, never the lazy maps; :func:`attach`
gives them back on reading.

:func:`wants_dense` is the rule that chooses between the two forms by size.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels import masks, tiles
from attnpanel.kernels.masks import MASK_MODES, cached_mask
from attnpanel.kernels.memory import available_memory
from attnpanel.traces.schema import ATTENTION_DIMS

LSE = "lse"
LSE_DIMS = ("batch", "head", "query")
MAPS = ("weights", "scores")  # what a virtual trace computes instead of storing
DENSE_MAX_BYTES = 2**30  # scores + weights up to this are kept dense when the form is automatic
SPOT_ROWS = 16  # rows whose lse :func:`check` recomputes from q and k
LSE_TOLERANCE = 1e-3  # in lse: a row's weights then sum to 1 within 0.1 %


def is_virtual(ds: xr.Dataset) -> bool:
    """Whether a trace holds ``lse`` (and lazy maps) instead of dense maps."""
    return LSE in ds.data_vars


COMPACT = "compact"  # attr of a trace kept virtual to be small on disk, not for its length


def densified(capture):
    """A trace kept virtual only to be small on disk (attr :data:`COMPACT`, such as
    ``attnpanel trace --demo``'s) with its maps computed once, where they fit in memory, for
    the page of every stage; anything else as it is (a long trace stays virtual)."""
    if not isinstance(capture, xr.Dataset) or COMPACT not in capture.attrs:
        return capture
    if not is_virtual(capture) or "layer" in capture.dims:
        return capture
    if not wants_dense(*(capture.sizes[d] for d in ("batch", "head", "query", "key"))):
        return capture
    dense = capture.load().drop_vars(LSE)
    del dense.attrs[COMPACT]
    return dense


def dense_bytes(batch: int, heads: int, length: int, keys: int) -> int:
    """Bytes of a dense trace's two float32 maps (``scores`` and ``weights``)."""
    return 2 * 4 * int(batch) * int(heads) * int(length) * int(keys)


def wants_dense(batch: int, heads: int, length: int, keys: int, dense: bool | None = None) -> bool:
    """The form of a new trace: ``dense`` if given, else dense when both maps take at most
    :data:`DENSE_MAX_BYTES` and fit the memory that may be used."""
    if dense is not None:
        return bool(dense)
    needed = dense_bytes(batch, heads, length, keys)
    return needed <= min(DENSE_MAX_BYTES, available_memory())


def masking(ds: xr.Dataset, mode: str | None = None, batch: int | None = None) -> masks.Masking:
    """The trace's mask as :class:`attnpanel.kernels.masks.Masking` (a mode and key padding): its
    own mode or ``mode``; every sample's padding or that of ``batch``.

    Raises
    ------
    ValueError
        For a mask a virtual trace cannot hold: a custom ``(query, key)`` mask, a
        per-sample mask beyond padding, or an additive bias.
    """
    mode = ds.attrs.get("mask", "none") if mode is None else mode
    if mode not in MASK_MODES:
        raise ValueError(
            f"a virtual trace needs a mask mode ({', '.join(MASK_MODES)}), not {mode!r}: "
            "trace this model in the dense form (dense=True)"
        )
    if "bias" in ds or "sample_mask" in ds and not _padding_only(ds):
        name = "bias" if "bias" in ds else "sample_mask"
        raise ValueError(
            f"a virtual trace cannot hold a {name!r} beyond its mask mode and padded keys: "
            "trace this model in the dense form (dense=True)"
        )
    padding = None
    if "padding" in ds:
        found = ds["padding"] if batch is None else ds["padding"].isel(batch=[batch])
        padding = torch.from_numpy(np.array(found.values, dtype=bool))
    return masks.Masking(mode, key_padding=padding)


def _padding_only(ds: xr.Dataset) -> bool:
    """Whether the trace's ``sample_mask`` is its own mode's cells plus its padded keys
    (which :class:`attnpanel.kernels.masks.Masking` holds without any ``(L, S)`` array)."""
    mode = ds.attrs.get("mask", "none")
    if mode not in MASK_MODES or "padding" not in ds:
        return False
    own = cached_mask(mode, ds.sizes["query"])
    expected = ds["padding"].rename(position="key")
    if own is not None:
        expected = expected | xr.DataArray(own.numpy(), dims=("query", "key"))
    return bool((ds["sample_mask"] == expected).all())


def _tensor(da: xr.DataArray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(da.values))


def _keys(ds: xr.Dataset, name: str) -> xr.DataArray:
    return ds[name].rename(position="key") if "position" in ds[name].dims else ds[name]


def attach(ds: xr.Dataset, chunks: tuple[int, int] = (tiles.BLOCK, tiles.BLOCK)) -> xr.Dataset:
    """The trace with lazy ``weights`` and ``scores`` computed from ``q``, ``k`` and ``lse``.

    A trace that is not virtual is returned as it is. ``q``, ``k`` and ``lse`` are read
    into memory (``L x head_dim`` per head: small); the maps stay lazy.
    """
    if not is_virtual(ds):
        return ds
    for name in ("q", "k"):
        if name not in ds:
            raise ValueError(f"a virtual trace needs {name!r} to compute its maps")
    if "scale" not in ds.attrs:
        raise ValueError("a virtual trace needs a 'scale' attribute to compute its maps")
    if "layer" in ds[LSE].dims:
        layers = [attach(ds.isel(layer=i), chunks) for i in range(ds.sizes["layer"])]
        maps = {name: xr.concat([one[name] for one in layers], "layer") for name in MAPS}
        return ds.assign(maps)
    q = _tensor(ds["q"].transpose("batch", "head", "position", "head_dim"))
    k = _tensor(_keys(ds, "k").transpose("batch", "head", "key", "head_dim"))
    lse = _tensor(ds[LSE].transpose(*LSE_DIMS)).double()
    scale = float(ds.attrs["scale"])
    coords = {d: ds[d] for d in ATTENTION_DIMS if d in ds.coords}
    weights = tiles.lazy_weights(q, k, lse, masking(ds), scale, chunks=chunks)
    scores = tiles.lazy_scores(q, k, chunks=chunks)
    note = "computed on demand from q, k and lse (a virtual trace)"
    return ds.assign(
        weights=xr.DataArray(weights, dims=ATTENTION_DIMS, coords=coords, attrs={"note": note}),
        scores=xr.DataArray(scores, dims=ATTENTION_DIMS, coords=coords, attrs={"note": note}),
    )


def row_lse(ds: xr.Dataset, mode: str, batch: int | None = None) -> torch.Tensor:
    """Each row's log-sum-exp under the mask ``mode`` (with the trace's padding), as the
    layer's forward would give it (:func:`attnpanel.kernels.tiles.attention`): ``(B, H, L)``
    float64, or ``(1, H, L)`` for one sample. The trace's own mode is its ``lse``."""
    lse = ds[LSE].transpose(*LSE_DIMS)
    if mode == ds.attrs.get("mask", "none"):
        found = _tensor(lse if batch is None else lse.isel(batch=[batch]))
        return found.double()
    q, k = qk(ds, batch)
    return tiles.log_sum_exp(q, k, masking(ds, mode, batch), float(ds.attrs["scale"])).double()


def qk(ds: xr.Dataset, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``(B, H, L, E)`` and ``k`` ``(B, H, S, E)`` (one sample: ``B = 1``)."""
    q = ds["q"].transpose("batch", "head", "position", "head_dim")
    k = _keys(ds, "k").transpose("batch", "head", "key", "head_dim")
    if batch is not None:
        q, k = q.isel(batch=[batch]), k.isel(batch=[batch])
    return _tensor(q), _tensor(k)


def stage(
    ds: xr.Dataset, stage: str, mode=None, batch: int | None = None, head: int | None = None
) -> xr.DataArray:
    """One stage of the score-to-weight pipeline of a virtual trace, lazily: the
    ``(batch, head, query, key)`` DataArray (less the selected dims) of a dask array of
    exact tiles, for any mask mode (the trace's padding kept).

    ``raw`` is ``q . k``, ``scaled`` times ``scale``, ``masked`` with blocked cells filled
    by ``-1e4``, ``softmax`` the weights (for another mode than the trace's own, each
    row's ``lse`` is first computed in one pass of the fused kernel, ``O(L x head_dim)``
    memory).

    Raises
    ------
    ValueError
        For a mask that is not a mode (a custom ``(L, S)`` mask is dense by nature).
    """
    mode = ds.attrs.get("mask", "none") if mode is None else mode
    if not isinstance(mode, str) or mode not in MASK_MODES:
        raise ValueError(
            f"a virtual trace recomputes the mask modes {', '.join(MASK_MODES)}, not a "
            "custom mask: trace the model in the dense form (dense=True) for that"
        )
    q, k = qk(ds, batch)
    scale = float(ds.attrs["scale"])
    found = masking(ds, mode, batch)
    if stage == "raw":
        data = tiles.lazy_scores(q, k)
    elif stage == "scaled":
        data = tiles.lazy_logits(q, k, masks.Masking(), scale)
    elif stage == "masked":
        data = tiles.lazy_logits(q, k, found, scale)
    elif stage == "softmax":
        data = tiles.lazy_weights(q, k, row_lse(ds, mode, batch), found, scale)
    else:
        raise ValueError(f"unknown stage {stage!r}")
    coords = {d: ds[d] for d in ATTENTION_DIMS if d in ds.coords}
    if batch is not None and "batch" in coords:
        coords["batch"] = ds["batch"][[batch]]
    found = xr.DataArray(data, dims=ATTENTION_DIMS, coords=coords, name=stage)
    found = found.isel(batch=0) if batch is not None else found
    return found.isel(head=head) if head is not None else found


def window(
    ds: xr.Dataset,
    batch: int,
    head: int,
    rows: slice,
    cols: slice,
    mode: str | None = None,
    lse: torch.Tensor | None = None,
    sample_qk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> np.ndarray:
    """The exact weights of one window ``(rows, cols)`` of one sample and head, float32,
    computing only its cells (a dask slice of the lazy ``weights`` computes every chunk it
    touches: one query row over 65,536 keys is 64 chunks of 1024 x 1024).

    ``mode`` defaults to the trace's own; for another, pass its ``lse`` (:func:`row_lse`
    of the sample, ``(1, H, L)``) to save recomputing it. ``sample_qk``, the sample's
    :func:`qk`, saves cutting it from the trace (10-90 ms at L = 64,800).
    """
    mode = ds.attrs.get("mask", "none") if mode is None else mode
    if lse is None:
        lse = row_lse(ds, mode, batch)
    q, k = qk(ds, batch) if sample_qk is None else sample_qk
    rows = slice(*rows.indices(q.shape[2])[:2])
    cols = slice(*cols.indices(k.shape[2])[:2])
    found = tiles.sample_masking(masking(ds, mode, batch), 0, 0)
    one = slice(head, head + 1)
    tile = tiles.weights_tile(
        q[:, one], k[:, one], lse[:, one], found, float(ds.attrs["scale"]), rows, cols
    )
    return tile[0, 0].numpy()


def detach(ds: xr.Dataset) -> xr.Dataset:
    """What a file stores of a trace: a virtual trace without its lazy maps."""
    if not is_virtual(ds):
        return ds
    return ds.drop_vars([name for name in MAPS if name in ds.data_vars])


def _spot_rows(batch: int, heads: int, length: int) -> list[tuple[int, int, int]]:
    """Up to :data:`SPOT_ROWS` rows spread over every sample, head and query."""
    total = batch * heads * length
    flat = np.unique(np.linspace(0, total - 1, min(SPOT_ROWS, total)).round().astype(int))
    return [tuple(int(i) for i in np.unravel_index(n, (batch, heads, length))) for n in flat]


def check_virtual(ds: xr.Dataset) -> None:
    """The checks of a virtual trace that :func:`attnpanel.traces.validate.validate` cannot run on
    its lazy maps without computing them all.

    ``lse`` must be ``(batch, head, query)`` and, for a spread of rows, equal the
    log-sum-exp recomputed in float64 from that row's ``q`` and every ``k`` (so that its
    weights sum to 1). Runs on each layer of a stacked trace.

    Raises
    ------
    ValueError
        Naming the row and both values.
    """
    lse = ds[LSE]
    if "layer" in lse.dims:
        for i in range(ds.sizes["layer"]):
            check_virtual(ds.isel(layer=i))
        return
    if lse.dims != LSE_DIMS:
        raise ValueError(f"lse has dims {lse.dims}, expected {LSE_DIMS}")
    found = masking(ds)
    batch, heads, length = (ds.sizes[d] for d in LSE_DIMS)
    scale = float(ds.attrs["scale"])
    for b, h, i in _spot_rows(batch, heads, length):
        q = _tensor(ds["q"].isel(batch=b, head=h)).double()  # (L, E)
        k = _tensor(_keys(ds, "k").isel(batch=b, head=h)).double()  # (S, E)
        one = tiles.sample_masking(found, b, h)
        logits, _ = tiles.logits_tile(q, k, one, scale, slice(i, i + 1), slice(0, k.shape[0]))
        expected = float(torch.logsumexp(logits.reshape(-1), dim=0))
        stored = float(lse.values[b, h, i])
        # the row's weights sum to exp(expected - stored)
        if not np.isfinite(stored) or abs(stored - expected) > LSE_TOLERANCE:
            raise ValueError(
                f"lse at batch={b}, head={h}, query={i} is {stored:.6g} but q and k give "
                f"{expected:.6g}: its weights would sum to {np.exp(expected - stored):.6g}, not 1"
            )

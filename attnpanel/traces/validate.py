"""What :func:`validate` checks before any view reads a trace: dims, shapes, finite values,
rows that sum to one, and a mask truth that matches the weights.
"""

from __future__ import annotations

import warnings

import dask
import numpy as np
import torch
import xarray as xr

from attnpanel.kernels.masks import MASK_MODES
from attnpanel.traces import virtual
from attnpanel.traces.schema import (
    ATTENTION_DIMS,
    CROSS_DIMS,
    EXPECTED_DIMS,
    MASK_TRUTH,
    QK_DIM,
    REFERENCE_SERIES,
    ROW_SUM_TOLERANCE,
)
from attnpanel.traces.stages import blocked_cells


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
        if name in ("q", "k"):
            allowed |= {(*dims[:-1], QK_DIM) for dims in allowed}
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
        if name in REFERENCE_SERIES:  # NaN there is "no reading" (a gap, a token's place)
            infinite = np.isinf(ds[name])
            if bool(infinite.any()):
                raise ValueError(f"{name} contains Inf at {_where(_first_bad(infinite))}")
            continue
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
    computed: its ``lse`` is checked instead (:func:`attnpanel.traces.virtual.check_virtual`). All
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
        virtual.check_virtual(ds)
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

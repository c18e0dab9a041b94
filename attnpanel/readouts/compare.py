"""Two captures of the same inputs side by side: where their attention differs, head by head.

Two checkpoints of one model, the model in float32 and in bfloat16, before and after
fine-tuning: run on the same inputs, their attention differs only where the models do.
:func:`compare` gives, cell by cell, the difference of the weights ``b - a``, and, head by
head, how far apart the two distributions of each query row are, the Jensen-Shannon
divergence

    JS(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m),    m = (p + q) / 2
    KL(p || m) = sum_j p_j log(p_j / m_j)           (natural log, 0 log 0 = 0)

averaged over the real query rows of every sample, from 0 (the same row) to ln 2 (rows on
disjoint keys), and the largest ``|b - a|`` of a cell in those rows.

Reference: J. Lin, "Divergence measures based on the Shannon entropy", IEEE Transactions
on Information Theory 37 (1), 1991.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import xarray as xr

from attnpanel.traces import virtual
from attnpanel.traces.layers import groups
from attnpanel.traces.stages import attention_stage, blocked_cells

# What a trace records of its model's inputs, compared where both traces hold it. The
# layer's own input ``x`` is not among them: past the first layer it is the earlier
# layers' output, which differs between checkpoints by design.
COMPARED_COORDS = (
    "batch",
    "head",
    "query",
    "key",
    "position",
    "token",
    "time",
    "sample",
    "channel",
    "series",
)
COMPARED_INPUTS = ("padding", "signal", "truth")
DIM_WORDS = {"batch": "samples", "head": "heads", "query": "queries", "key": "keys"}
ROW_DIMS = ("batch", "head", "query")


def compare(
    a: xr.Dataset | xr.DataTree,
    b: xr.Dataset | xr.DataTree,
    labels: tuple[str, str] | None = None,
) -> xr.Dataset | xr.DataTree:
    """How two captures of the same inputs differ in attention, cell by cell and head by head.

    Parameters
    ----------
    a, b : xarray.Dataset or xarray.DataTree
        Two traces (dense or virtual; one layer, or a capture with a ``layer`` dim) of the
        same inputs, or two DataTrees of the same groups (an encoder-decoder), each group
        compared with its namesake.
    labels : (str, str), optional
        What the result calls ``a`` and ``b`` (``attrs["a"]``, ``attrs["b"]``); by default
        each capture's ``source`` and the ``dtype`` it was computed in.

    Returns
    -------
    xarray.Dataset or xarray.DataTree
        For Datasets, a Dataset of

        - ``difference``: ``b - a``, the softmax weights (:func:`attention_stage`, the
          model's own weights or a virtual trace's exact tiles), float32,
          ``(layer, batch, head, query, key)`` (``layer`` only where the inputs have it);
          lazy (dask) where an input is;
        - ``js``: ``(layer, head)``, float64, the Jensen-Shannon divergence (nats) of the
          two query rows, mean over every sample's real queries;
        - ``max_abs``: ``(layer, head)``, the largest ``|b - a|`` in those rows;
        - ``rows``: ``(layer, head)``, how many rows each mean is over.

        A real query is one that is not ``padding`` and not blocked from every key, whose
        row holds some weight in both traces (an all-zero or all-NaN row is no attention).
        A head without one has NaN ``js`` and ``max_abs``. For DataTrees, a DataTree of
        such Datasets, one per group. Heads most different first:
        ``result["js"].to_series().sort_values(ascending=False)``.

    Raises
    ------
    ValueError
        Naming what differs, when ``a`` and ``b`` are not captures of the same inputs by
        a model of the same shape: their groups, layers, sizes (samples, heads, queries,
        keys), or what they record of the inputs (token labels, timestamps, positions,
        ``padding``, the reference ``signal`` and ``truth``). A capture that records none
        of its inputs can be checked only by its shapes.
    """
    attrs = {
        "a": labels[0] if labels else _described(a, "a"),
        "b": labels[1] if labels else _described(b, "b"),
        "stage": "softmax",
    }
    if isinstance(a, xr.Dataset) and isinstance(b, xr.Dataset):
        return _compared(a, b, "").assign_attrs(attrs)
    if not (isinstance(a, xr.DataTree) and isinstance(b, xr.DataTree)):
        raise ValueError(
            f"a is {_kind(a)} and b is {_kind(b)}: compare two Datasets or two DataTrees "
            "(one group of a DataTree is tree[group].to_dataset())"
        )
    found_a, found_b = groups(a), groups(b)
    if set(found_a) != set(found_b):
        only = [
            f"only in {name}: {_listed(g for g in mine if g not in theirs)}"
            for name, mine, theirs in (("a", found_a, found_b), ("b", found_b, found_a))
            if set(mine) - set(theirs)
        ]
        raise ValueError(f"a and b hold different groups: {'; '.join(only)}")
    tree = xr.DataTree.from_dict(
        {
            f"/{group}": _compared(found_a[group], found_b[group], f"group {group!r}: ")
            for group in found_a
        }
    )
    tree.attrs = attrs
    return tree


def ranked_heads(comparison: xr.Dataset) -> pd.DataFrame:
    """Every head of a comparison, most different first (the order a page ranks them in).

    Parameters
    ----------
    comparison : xarray.Dataset
        What :func:`compare` returns for two Datasets (``js``, ``max_abs`` and ``rows``
        per head, per ``layer`` where the captures have layers).

    Returns
    -------
    pandas.DataFrame
        One row per (layer, head) by descending ``js``, heads without a real query row
        (NaN ``js``) last: ``layer`` (the layer's position, 0 for a one-layer capture),
        ``layer_name`` (its module name, or ``""``), ``head`` (its position), ``js``,
        ``max_abs``, ``rows``.
    """
    numbers = comparison[["js", "max_abs", "rows"]]
    if "layer" not in numbers.dims:
        name = str(numbers["layer"].values) if "layer" in numbers.coords else ""
        numbers = numbers.drop_vars("layer", errors="ignore").expand_dims(layer=[name])
    names = [str(n) for n in numbers["layer"].values] if "layer" in numbers.coords else None
    rows = []
    for index in range(numbers.sizes["layer"]):
        layer = numbers.isel(layer=index)
        for position in range(layer.sizes["head"]):
            head = layer.isel(head=position)
            rows.append(
                {
                    "layer": index,
                    "layer_name": names[index] if names else "",
                    "head": position,
                    "js": float(head["js"]),
                    "max_abs": float(head["max_abs"]),
                    "rows": int(head["rows"]),
                }
            )
    table = pd.DataFrame(rows, columns=["layer", "layer_name", "head", "js", "max_abs", "rows"])
    # stable: equal divergences keep the capture's order
    return table.sort_values("js", ascending=False, na_position="last", kind="stable").reset_index(
        drop=True
    )


def _kind(capture) -> str:
    if isinstance(capture, xr.DataTree):
        return "a DataTree"
    if isinstance(capture, xr.Dataset):
        return "a Dataset"
    raise TypeError(f"expected a trace Dataset or DataTree, got {type(capture).__name__}")


def _listed(names) -> str:
    return ", ".join(repr(n) for n in names) or "none"


def _described(capture: xr.Dataset | xr.DataTree, fallback: str) -> str:
    """``source (dtype)`` from a capture's attrs (a DataTree's or its first group's)."""
    _kind(capture)
    attrs = dict(capture.attrs)
    if isinstance(capture, xr.DataTree):
        attrs = {**next(iter(groups(capture).values())).attrs, **attrs}
    source, dtype = attrs.get("source"), attrs.get("dtype")
    if source is None:
        return f"{fallback} ({dtype})" if dtype else fallback
    return f"{source} ({dtype})" if dtype else str(source)


def _compared(a: xr.Dataset, b: xr.Dataset, where: str) -> xr.Dataset:
    """One group's comparison, every layer of it."""
    check_comparable(a, b, where)
    if "layer" not in a.dims:
        return _finished(_layer_compared(a, b))
    layers = [_layer_compared(a.isel(layer=i), b.isel(layer=i)) for i in range(a.sizes["layer"])]
    stacked = xr.concat(layers, dim="layer", coords="minimal", compat="override")
    return _finished(stacked.assign_coords(layer=a["layer"].values))


def _finished(found: xr.Dataset) -> xr.Dataset:
    """The per-head numbers computed (one pass where the inputs are lazy), the map not."""
    small = found[["js", "max_abs", "rows"]].compute()
    return found.assign({name: small[name] for name in small.data_vars})


def _layer_compared(a: xr.Dataset, b: xr.Dataset) -> xr.Dataset:
    """The comparison of one layer, lazy where either trace is."""
    with xr.set_options(arithmetic_join="exact", keep_attrs=False):
        p = attention_stage(a, "softmax")  # (B, H, L, S)
        q = attention_stage(b, "softmax")
        rows = (_real_rows(a, p) & _real_rows(b, q)).transpose(*ROW_DIMS)  # (B, H, L)
        p64, q64 = p.astype(np.float64), q.astype(np.float64)
        divergence = _js_rows(p64, q64).where(rows, 0.0)  # (B, H, L)
        gap = abs(q64 - p64).where(rows, 0.0).max(("batch", "query", "key"))  # (H,)
        count = rows.sum(("batch", "query"))  # (H,)
        some = count.where(count > 0)  # NaN where a head has no real row
        js = divergence.sum(("batch", "query")) / some
        difference = q.astype(np.float32) - p.astype(np.float32)
    return xr.Dataset(
        {
            "difference": difference.transpose(*ROW_DIMS, "key").assign_attrs(
                long_name="b - a attention weights"
            ),
            "js": js.assign_attrs(
                long_name="Jensen-Shannon divergence of the query rows, mean over real queries",
                units="nats",
                upper_bound=math.log(2.0),
            ),
            "max_abs": gap.where(count > 0).assign_attrs(
                long_name="largest |b - a| in a real query row"
            ),
            "rows": count.astype(np.int64).assign_attrs(long_name="real query rows counted"),
        }
    )


def _real_rows(ds: xr.Dataset, weights: xr.DataArray) -> xr.DataArray:
    """``(batch, head, query)`` bool: the rows that are attention of a real query.

    A row with no positive weight (all zero, as a virtual trace recomputes a fully blocked
    row, or all NaN) is none; neither is a row the model blocked from every key (where it
    may have spread uniform weights) nor a padded query's.
    """
    rows = (weights > 0).any("key")
    if not virtual.is_virtual(ds):  # a virtual trace recomputes such rows as 0: seen above
        blocked = blocked_cells(ds)
        if blocked is not None and "key" in blocked.dims:
            rows = rows & ~blocked.all("key")
    if "padding" in ds:  # over the query side's positions
        padded = np.asarray(ds["padding"].transpose("batch", "position").values, dtype=bool)
        rows = rows & ~xr.DataArray(padded, dims=("batch", "query"), coords=_row_coords(weights))
    return rows


def _row_coords(weights: xr.DataArray) -> dict:
    return {d: weights[d] for d in ("batch", "query") if d in weights.coords}


def _js_rows(p: xr.DataArray, q: xr.DataArray) -> xr.DataArray:
    """The Jensen-Shannon divergence of every row of ``p`` and ``q`` (natural log)."""
    middle = 0.5 * (p + q)
    return 0.5 * (_kl_rows(p, middle) + _kl_rows(q, middle))


def _kl_rows(p: xr.DataArray, middle: xr.DataArray) -> xr.DataArray:
    """``sum_j p_j log(p_j / m_j)`` over keys, 0 where ``p_j`` is 0 (``m_j >= p_j / 2``)."""
    weighted = p > 0
    ratio = xr.where(weighted, p, 1.0) / xr.where(weighted, middle, 1.0)
    return (p.where(weighted, 0.0) * np.log(ratio)).sum("key")


def check_comparable(a: xr.Dataset, b: xr.Dataset, where: str = "") -> None:
    """Raise ``ValueError`` naming what differs unless two traces are comparable.

    Comparable: the same layers (by module name), the same sizes of samples, heads,
    queries and keys, and the same inputs where both traces record them (see
    :func:`compare`). ``where`` starts each message (a DataTree's group).
    """
    names_a, names_b = _layer_names(a), _layer_names(b)
    if len(names_a) != len(names_b) or (all(names_a) and all(names_b) and names_a != names_b):
        raise ValueError(
            f"{where}a and b hold different layers: {_layer_list(names_a)} in a, "
            f"{_layer_list(names_b)} in b"
        )
    if ("layer" in a.dims) != ("layer" in b.dims):
        stacked = "a" if "layer" in a.dims else "b"
        raise ValueError(
            f"{where}{stacked} is a capture with a 'layer' dim and the other one layer "
            f"without: select the layer, as {stacked}.isel(layer=0)"
        )
    shapes = [
        f"{a.sizes[d]} {word} in a, {b.sizes[d]} in b"
        for d, word in DIM_WORDS.items()
        if a.sizes.get(d) != b.sizes.get(d)
    ]
    if shapes:
        raise ValueError(f"{where}a and b differ in shape: {'; '.join(shapes)}")
    for name in COMPARED_COORDS:
        if name in a.coords and name in b.coords:
            _check_same_input(a[name], b[name], name, where)
    for name in COMPARED_INPUTS:
        if name in a and name in b:
            _check_same_input(a[name], b[name], name, where)
    if ("padding" in a) != ("padding" in b):
        _check_unpadded(*((a, "a", "b") if "padding" in a else (b, "b", "a")), where)


def _layer_names(ds: xr.Dataset) -> list[str]:
    """The module names of a trace's layers (``[""]`` for one unnamed layer)."""
    if "layer" in ds.dims:
        return [str(n) for n in ds["layer"].values]
    return [str(ds["layer"].values)] if "layer" in ds.coords else [""]


def _layer_list(names: list[str]) -> str:
    count = f"{len(names)} layer{'s' if len(names) != 1 else ''}"
    shown = ", ".join(repr(n) for n in names[:6] if n) + (" ..." if len(names) > 6 else "")
    return f"{count} ({shown})" if shown else count


def _check_unpadded(ds: xr.Dataset, name: str, other: str, where: str) -> None:
    """A trace that records no padding has none: refuse one that pads a position."""
    padded = ds["padding"].any("layer") if "layer" in ds["padding"].dims else ds["padding"]
    count = int(padded.sum())
    if count:
        raise ValueError(
            f"{where}a and b are not captures of the same inputs: {name} pads {count} "
            f"positions, {other} records no padding"
        )


def _check_same_input(x: xr.DataArray, y: xr.DataArray, name: str, where: str) -> None:
    """Raise naming the first cell where one recorded input differs between a and b."""
    first = f"{where}a and b are not captures of the same inputs: their {name!r} differ"
    if x.dims != y.dims or x.shape != y.shape:
        raise ValueError(f"{first} (dims {dict(x.sizes)} in a, {dict(y.sizes)} in b)")
    left, right = np.asarray(x.values), np.asarray(y.values)
    same = np.asarray(left == right)
    if left.dtype.kind in "fcmM":  # NaN (NaT) in both is the same
        same = same | (_missing(left) & _missing(right))
    if not np.all(same):
        index = tuple(int(i) for i in np.argwhere(~same)[0])
        at = ", ".join(f"{d} {i}" for d, i in zip(x.dims, index, strict=True))
        raise ValueError(
            f"{first} (at {at}: {_shown(left[index])} in a, {_shown(right[index])} in b)"
        )


def _shown(value: np.generic) -> str:
    """One recorded input value as a person reads it (``'cat'``, ``2024-01-01T00:00``)."""
    return str(value) if value.dtype.kind in "mM" else repr(value.item())


def _missing(values: np.ndarray) -> np.ndarray:
    return np.isnat(values) if values.dtype.kind in "mM" else np.isnan(values)

"""Queries and keys of one head in one 2-D space, as AttentionViz draws them.

Every query and every key of one (layer, head), over every position and sample, becomes a
point of one cloud, so that a query lies near the keys it attends to. Before the cloud is
flattened to 2-D, the vectors are moved by a transformation that leaves the head's
attention exactly as it was:

    q'_i = s * q_i,    k'_j = (k_j + c) / s

Then ``q'_i . k'_j = q_i . k_j + q_i . c``: the added ``q_i . c`` is one constant along
query ``i``'s row, which a softmax over the keys ``j`` does not see, so
``softmax_j(scale * q'_i . k'_j + bias_ij)`` is the trace's weights whatever ``c`` and
``s > 0`` are (its mask and additive bias as they are). ``c`` moves the keys' mean onto the
queries' mean and ``s`` gives queries and keys one mean norm: ``c = s^2 mean(q) - mean(k)``
with the one ``s`` at which both hold at once (see :func:`qk_embedding`).

Reference: C. Yeh, Y. Chen, A. Wu, C. Chen, F. Viegas, M. Wattenberg, "AttentionViz: A
Global View of Transformer Attention", IEEE VIS 2023 (TVCG 30(1), 2024), section 4.1.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from attnpanel.traces import virtual
from attnpanel.traces.stages import blocked_cells, normaliser

EMBEDDING_METHODS = ("pca", "umap")
BLOCK_POINTS = 65536  # points per block of the covariance and the projection
NEWTON_STEPS = 100  # at most; the scale converges in about ten (quadratically)
NORM_TOLERANCE = 1e-13  # relative: mean key norm minus mean query norm, at the found scale


def qk_embedding(
    trace: xr.Dataset, layer: int | str | None = None, head: int = 0, method: str = "pca"
) -> xr.Dataset:
    """The queries and keys of one head as points of one plane (AttentionViz).

    The vectors are first moved by ``q' = s q``, ``k' = (k + c) / s``, which leaves every
    weight as it is: ``q' . k' = q . k + q . c`` differs from ``q . k`` by one constant
    per query row, and a softmax over the keys ignores a constant added to a row. So
    ``softmax(scale * q' . k' + bias)`` under the trace's full mask is the trace's
    ``weights``. A linear attention's (``normaliser = "row sum"``: q and k its features)
    changes with a constant added to a row: its vectors are only scaled (``c = 0``), and
    ``q' . k' = q . k``. An additive bias the model puts on the scores (ALiBi, T5's relative
    positions, a float mask) stays as it is: it is not in ``q . k``, so it is not in the
    picture either, and a head whose pattern comes from its bias shows little of it here.

    ``c = s^2 mean(q) - mean(k)`` puts the keys' mean on the queries' mean (both at
    ``s mean(q)``), and ``s`` is the one scale at which queries and keys then have the same
    mean norm (found by Newton's method; unique, since the keys' mean norm is convex and
    increasing in ``1 / s^2``). Where no finite ``s`` does both (every query on one ray
    from the origin, or every key the same), the keys are translated onto the queries'
    mean first and then ``s`` matches the mean norms: ``attrs["transform"]`` says which.
    Means and norms are over the points drawn: padded positions are left out.

    Parameters
    ----------
    trace : xarray.Dataset
        A trace with ``q`` and ``k`` (dense or virtual: only ``q`` and ``k`` of the head
        are read, never the weights); one layer, or a capture with a ``layer`` dim.
        Grouped-query traces hold ``k`` per query head, so any query head works.
    layer : int or str, optional
        The layer of a capture: its position or its name (the ``layer`` coordinate).
        Needed when the capture has more than one.
    head : int
        The query head, by position.
    method : {"pca", "umap"}
        ``"pca"``: the first two principal axes of the moved points (numpy; each axis
        signed so that its largest loading is positive, so the picture is the same on
        every run). ``"umap"``: UMAP's 2-D layout (``umap-learn``, seed 0, the optional
        extra ``attnpanel[umap]``).

    Returns
    -------
    xarray.Dataset
        Along ``point`` (every query, then every key; by sample, then position): ``x``
        and ``y`` float64; coordinates ``kind`` (``"query"`` or ``"key"``), ``sample``
        (the ``batch`` label), ``position`` (the query's or key's) and, for
        self-attention, the trace's own per-position labels (``token``, ``time``).
        ``key_shift`` (``c``, over ``head_dim``) and ``norm_scale`` (``s``) give the
        moved vectors back from the trace's. ``attrs``: ``method``, ``layer``, ``head``,
        ``transform`` and, for PCA, ``explained_variance`` (the share of each axis).

    Raises
    ------
    ValueError
        For an unknown method, a layer or head out of range, a DataTree, a trace without
        ``q`` and ``k``, or no query or key left once padding is removed.
    ImportError
        For ``method="umap"`` without ``umap-learn`` installed.
    """
    if method not in EMBEDDING_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {EMBEDDING_METHODS}")
    ds, layer_label = _one_layer(trace, layer)
    missing = [name for name in ("q", "k") if name not in ds]
    if missing:
        raise ValueError(
            f"the query-key embedding needs the trace's {' and '.join(missing)}; this trace "
            f"holds {', '.join(map(str, ds.data_vars))}"
        )
    head = _head_index(ds, head)
    queries, keys, coords = _points(ds, head)
    if normaliser(ds) == "softmax":
        shift, scale, transform = _matching_transform(queries, keys)
    else:  # a row sum changes with a constant added to a row: no shift, q . k kept
        shift, scale, transform = _scaled_only(queries, keys)
    moved = (queries * scale, (keys + shift) / scale)  # (n_q, E), (n_k, E)
    attrs = {"method": method, "layer": layer_label, "head": head, "transform": transform}
    if method == "pca":
        xy, explained = _pca(moved)
        attrs["explained_variance"] = [float(share) for share in explained]
    else:
        xy = _umap(np.concatenate(moved))
    head_dim = {"head_dim": ds["head_dim"].values} if "head_dim" in ds.coords else {}
    return xr.Dataset(
        {
            "x": ("point", xy[:, 0]),
            "y": ("point", xy[:, 1]),
            "key_shift": xr.DataArray(shift, dims="head_dim", coords=head_dim),
            "norm_scale": ((), scale),
        },
        coords=coords,
        attrs=attrs,
    )


def _one_layer(trace, layer) -> tuple[xr.Dataset, str]:
    """The trace of the chosen layer and its label."""
    if isinstance(trace, xr.DataTree):
        groups = [node.path for node in trace.subtree if node.has_data]
        raise ValueError(
            f"this capture has groups {', '.join(groups)}: embed a layer of one of them, "
            f"such as qk_embedding(tree[{groups[0]!r}].to_dataset(), layer=0)"
        )
    if "layer" not in trace.dims:
        if layer is not None:
            raise ValueError(f"layer={layer!r}, but this trace is one layer: leave layer=None")
        named = "layer" in trace.coords and not trace["layer"].dims  # a layer cut from a capture
        return trace, str(trace["layer"].item()) if named else ""
    count = trace.sizes["layer"]
    names = [str(n) for n in trace["layer"].values] if "layer" in trace.coords else []
    if layer is None and count > 1:
        raise ValueError(
            f"this capture has {count} layers: pick one with layer= (0-{count - 1}"
            + (f", or a name such as {names[0]!r})" if names else ")")
        )
    if layer is None:
        index = 0
    elif isinstance(layer, str):
        if layer not in names:
            raise ValueError(f"no layer {layer!r}; this capture has {', '.join(names)}")
        index = names.index(layer)
    elif isinstance(layer, int | np.integer) and -count <= int(layer) < count:
        index = int(layer) % count
    else:
        raise ValueError(
            f"layer {layer!r} is out of range: this capture has {count} (0-{count - 1})"
        )
    return trace.isel(layer=index), names[index] if names else str(index)


def _head_index(ds: xr.Dataset, head) -> int:
    count = ds.sizes["head"]
    if isinstance(head, bool) or not isinstance(head, int | np.integer):
        raise ValueError(f"head must be a head's index (0-{count - 1}), not {head!r}")
    if not -count <= int(head) < count:
        raise ValueError(f"head {head} is out of range: this trace has {count} (0-{count - 1})")
    return int(head) % count


def _keys_dim(ds: xr.Dataset) -> str:
    return "position" if "position" in ds["k"].dims else "key"


def _drawn(ds: xr.Dataset, head: int) -> tuple[np.ndarray, np.ndarray]:
    """``(B, L)`` queries and ``(B, S)`` keys drawn: all but padded positions and, for
    cross-attention, keys that no query may see."""
    batch, length, n_keys = ds.sizes["batch"], ds["q"].sizes["position"], ds.sizes["key"]
    queries = np.ones((batch, length), dtype=bool)
    keys = np.ones((batch, n_keys), dtype=bool)
    if "padding" in ds:  # self-attention only: a padded position is a query and a key
        padded = np.asarray(ds["padding"].transpose("batch", "position").values, dtype=bool)
        return queries & ~padded, keys & ~padded
    if ds.attrs.get("attention") == "cross" and not virtual.is_virtual(ds):
        blocked = blocked_cells(ds, head=head)  # over some of (batch, query, key)
        if blocked is not None:
            unseen = blocked.all("query") if "query" in blocked.dims else blocked
            order = [d for d in ("batch", "key") if d in unseen.dims]
            shape = tuple(unseen.sizes.get(d, 1) for d in ("batch", "key"))
            values = np.asarray(unseen.transpose(*order).values, dtype=bool).reshape(shape)
            keys &= ~values
    return queries, keys


def _labels(ds: xr.Dataset, dim: str, size: int) -> np.ndarray:
    return ds[dim].values if dim in ds.coords else np.arange(size)


def _points(ds: xr.Dataset, head: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """The drawn queries ``(n_q, E)`` and keys ``(n_k, E)`` (float64) of one head, and
    the coordinates of every point."""
    key_dim = _keys_dim(ds)
    q = ds["q"].isel(head=head).transpose("batch", "position", "head_dim").values  # (B, L, E)
    k = ds["k"].isel(head=head).transpose("batch", key_dim, "head_dim").values  # (B, S, E)
    query_drawn, key_drawn = _drawn(ds, head)
    if not query_drawn.any() or not key_drawn.any():
        raise ValueError("no query or no key of this trace is left once padding is removed")
    samples = _labels(ds, "batch", ds.sizes["batch"])
    q_samples, q_positions = np.nonzero(query_drawn)  # by sample, then position
    k_samples, k_positions = np.nonzero(key_drawn)
    count_q, count_k = len(q_samples), len(k_samples)
    coords = {
        "kind": ("point", np.array(["query"] * count_q + ["key"] * count_k)),
        "sample": ("point", samples[np.concatenate([q_samples, k_samples])]),
        "position": (
            "point",
            np.concatenate(
                [
                    _labels(ds, "position", q.shape[1])[q_positions],
                    _labels(ds, key_dim, k.shape[1])[k_positions],
                ]
            ),
        ),
    }
    if ds.attrs.get("attention") != "cross":  # the keys are the queries' own positions
        for name, full in _position_labels(ds, query_drawn.shape).items():
            picked = np.concatenate([full[q_samples, q_positions], full[k_samples, k_positions]])
            coords[name] = ("point", picked)
    return (
        np.asarray(q[query_drawn], dtype=np.float64),
        np.asarray(k[key_drawn], dtype=np.float64),
        coords,
    )


def _position_labels(ds: xr.Dataset, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """The trace's labels of each position (``token``, ``time``), as ``(B, L)`` arrays."""
    found = {}
    for name, label in ds.coords.items():
        if name in ds.dims or not label.dims or not set(label.dims) <= {"batch", "position"}:
            continue
        order = [d for d in ("batch", "position") if d in label.dims]
        sizes = tuple(label.sizes.get(d, 1) for d in ("batch", "position"))
        found[name] = np.broadcast_to(label.transpose(*order).values.reshape(sizes), shape)
    return found


def _matching_transform(queries: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, float, str]:
    """``(c, s, how)``: keys ``(k + c) / s`` and queries ``s q`` with one mean and one mean
    norm (where a finite ``s`` gives both)."""
    mean_q, mean_k = queries.mean(axis=0), keys.mean(axis=0)
    norm_q = float(np.linalg.norm(queries, axis=1).mean())
    spread = keys - mean_k  # a_j = k_j - mean(k), (n_k, E)
    reach = float(np.linalg.norm(spread, axis=1).mean())
    centre = float(np.linalg.norm(mean_q))
    if reach > 0 and norm_q - centre > 1e-9 * norm_q:
        # k'_j = a_j / s + s mean(q), so ||k'_j|| = s ||t a_j + mean(q)|| with t = 1 / s^2:
        # solve mean_j ||t a_j + mean(q)|| = mean ||q|| for t. The left side is convex,
        # increasing for t > 0 and below the right at t = 0, so Newton's method from above
        # the root descends onto it.
        t = (norm_q + centre) / reach  # where the left side is surely >= mean ||q||
        for _ in range(NEWTON_STEPS):
            moved = t * spread + mean_q  # (n_k, E)
            norms = np.linalg.norm(moved, axis=1)
            excess = norms.mean() - norm_q
            slope = float(np.mean(np.einsum("je,je->j", spread, moved) / np.maximum(norms, 1e-300)))
            if excess <= NORM_TOLERANCE * norm_q or slope <= 0:
                break
            t -= excess / slope
        scale = 1.0 / np.sqrt(t)
        return (
            scale**2 * mean_q - mean_k,
            float(scale),
            "keys onto the queries' mean, one mean norm",
        )
    shift = mean_q - mean_k
    norm_k = float(np.linalg.norm(keys + shift, axis=1).mean())
    scale = np.sqrt(norm_k / norm_q) if norm_q > 0 and norm_k > 0 else 1.0
    return (
        shift,
        float(scale),
        "keys translated onto the queries' mean, then scaled to one mean norm (no scale "
        "does both: every query lies on one ray, or every key is the same)",
    )


def _scaled_only(queries: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, float, str]:
    """``(0, s, how)``: queries ``s q`` and keys ``k / s`` with one mean norm, every
    ``q . k`` kept (a linear attention's weights are its products over their row's sum)."""
    norm_q = float(np.linalg.norm(queries, axis=1).mean())
    norm_k = float(np.linalg.norm(keys, axis=1).mean())
    scale = np.sqrt(norm_k / norm_q) if norm_q > 0 and norm_k > 0 else 1.0
    words = "scaled to one mean norm, not moved (a linear attention's row sums keep q . k)"
    return np.zeros(queries.shape[1]), float(scale), words


def _blocks(points: tuple[np.ndarray, ...]):
    for part in points:
        for start in range(0, len(part), BLOCK_POINTS):
            yield part[start : start + BLOCK_POINTS]


def _pca(points: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 2)`` coordinates on the first two principal axes of all points, and each
    axis's share of the variance. The covariance ``(E, E)`` is summed block by block."""
    count = sum(len(part) for part in points)
    width = points[0].shape[1]
    centre = sum(part.sum(axis=0) for part in points) / count  # (E,)
    covariance = np.zeros((width, width))
    for block in _blocks(points):
        centred = block - centre
        covariance += centred.T @ centred  # (E, E)
    axes, variances, _ = np.linalg.svd(covariance / count)  # columns by variance, descending
    axes = axes[:, :2]
    largest = np.argmax(np.abs(axes), axis=0)
    axes = axes * np.sign(axes[largest, np.arange(axes.shape[1])])  # largest loading > 0
    if axes.shape[1] < 2:  # a one-dimensional head: y is 0
        axes = np.pad(axes, ((0, 0), (0, 2 - axes.shape[1])))
    total = variances.sum()
    shares = variances[:2] / total if total > 0 else np.zeros(min(2, width))
    xy = np.concatenate([(block - centre) @ axes for block in _blocks(points)])  # (n, 2)
    return xy, shares


def _umap(points: np.ndarray) -> np.ndarray:
    try:
        import umap
    except ImportError as error:
        raise ImportError(
            "method='umap' needs umap-learn, which is not installed: "
            "pip install attnpanel[umap] (or pip install umap-learn)"
        ) from error
    return np.asarray(umap.UMAP(n_components=2, random_state=0).fit_transform(points), np.float64)


def matrix_positions(trace: xr.Dataset, embedding: xr.Dataset) -> np.ndarray:
    """Each point's place on the trace's attention matrix: a query point's row (its index
    along ``query``), a key point's column (along ``key``).

    Parameters
    ----------
    trace : xarray.Dataset
        The one layer the embedding was made from (``qk_embedding(trace, head=...)``).
    embedding : xarray.Dataset
        Points along ``point`` with ``kind`` and ``position`` (the trace's labels).

    Returns
    -------
    numpy.ndarray
        ``(point,)`` int64.
    """
    kinds = embedding["kind"].values
    labels = embedding["position"].values
    found = np.empty(len(labels), dtype=np.int64)
    for kind, dim in (("query", "position"), ("key", _keys_dim(trace))):
        chosen = kinds == kind
        found[chosen] = _index_of(trace, dim, labels[chosen])
    return found


def sample_label(trace: xr.Dataset, sample: int):
    """The ``sample`` coordinate the embedding gives the points of batch index ``sample``."""
    return _labels(trace, "batch", trace.sizes["batch"])[sample]


def box_positions(
    trace: xr.Dataset, embedding: xr.Dataset, sample: int, x_range, y_range
) -> tuple[np.ndarray, np.ndarray]:
    """The queries and keys of one sample whose points lie in a box of the embedding.

    Parameters
    ----------
    trace : xarray.Dataset
        The one layer the embedding was made from.
    embedding : xarray.Dataset
        What :func:`qk_embedding` returned for it.
    sample : int
        The batch index whose points count.
    x_range, y_range : tuple of float
        The box, edges included.

    Returns
    -------
    queries, keys : numpy.ndarray
        Sorted int64 rows (query positions) and columns (key positions) of the sample's
        attention matrix.
    """
    (x0, x1), (y0, y1) = sorted(map(float, x_range)), sorted(map(float, y_range))
    x, y = embedding["x"].values, embedding["y"].values
    inside = (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
    inside &= embedding["sample"].values == sample_label(trace, sample)
    positions = matrix_positions(trace, embedding)
    kinds = embedding["kind"].values
    return (
        np.unique(positions[inside & (kinds == "query")]),
        np.unique(positions[inside & (kinds == "key")]),
    )


def _index_of(ds: xr.Dataset, dim: str, labels: np.ndarray) -> np.ndarray:
    """Indices along ``dim`` of its coordinate's ``labels`` (the labels themselves when the
    dim has no coordinate)."""
    if dim not in ds.coords:
        return np.asarray(labels, dtype=np.int64)
    values = ds[dim].values
    order = np.argsort(values, kind="stable")
    return order[np.searchsorted(values, labels, sorter=order)].astype(np.int64)

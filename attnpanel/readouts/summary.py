"""Text summaries of a trace: the shape of every step, and what each head attends to.

Used by the command line (``attnpanel info``) and the explorer's shape table; no plotting.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from attnpanel.kernels.masks import MASK_FILL, fill_words
from attnpanel.readouts import core
from attnpanel.readouts.core import Selection, head_patterns
from attnpanel.traces.positions import Positions
from attnpanel.traces.stages import normaliser


def shape_table(ds: xr.Dataset, mask: str | None = None) -> pd.DataFrame:
    """The operation and real shape of every step of the attention for a trace.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.
    mask : str, optional
        The mask mode named in the masking step; by default the trace's own.

    Returns
    -------
    pandas.DataFrame
        Columns ``step``, ``operation`` and ``shape``, one row per step from the input to the
        output. A shape names its dims, e.g. ``(batch=32, head=8, query=480, key=480)``; a
        step whose variable the trace lacks says which (``not in trace (no `x`)``), and
        steps recomputed from ``q`` and ``k`` say so.
    """
    sizes = ds.sizes
    batch, length = sizes.get("batch"), sizes.get("query")
    n_heads = sizes.get("head")
    d_model = ds.attrs.get("d_model")
    head_dim = ds.attrs.get("head_dim")
    mask = mask or ds.attrs.get("mask", "none")

    def shape_of(name, fallback=None):
        if name in ds:
            return "(" + ", ".join(f"{d}={sizes[d]}" for d in ds[name].dims) + ")"
        return fallback or f"not in trace (no `{name}`)"

    def computed(dims):
        if any(v is None for v in dims.values()):
            return "unknown"
        return "(" + ", ".join(f"{d}={v}" for d, v in dims.items()) + ")"

    bld = dict(batch=batch, position=length, feature=d_model)
    can_project = "x" in ds and "w_q" in ds
    attn = computed(dict(batch=batch, head=n_heads, query=length, key=length))
    from_qk = " (from q, k)" if "q" in ds else " (needs q, k)"
    linear = normaliser(ds) != "softmax"  # q, k: phi(q), phi(k)
    rows = [
        ("positions", Positions.of(ds).words(), f"(position={length})"),
        ("input", "x", shape_of("x")),
        (
            "projections",
            "x·Wqᵀ, x·Wkᵀ, x·Wvᵀ",
            computed(bld) + " each" if can_project else shape_of("w_q"),
        ),
        ("split", "(B, L, D) → (B, H, L, E)", shape_of("q")),
        (
            "scores",
            _feature_words(ds) if linear else "q·kᵀ",
            shape_of("scores") if "scores" in ds else attn + from_qk,
        ),
        ("scaled", f"× scale = {ds.attrs.get('scale', float('nan')):.4g}", attn + from_qk),
        ("masked", _masked_words(ds, mask), attn + from_qk),
        (
            "weights",
            "each row / its sum (a linear attention's)" if linear else "softmax over key",
            shape_of("weights"),
        ),
        ("context", "weights · v", shape_of("context")),
        (
            "merged",
            "(B, H, L, E) → (B, L, D)",
            computed(
                dict(
                    batch=batch,
                    position=length,
                    feature=(n_heads or 0) * (head_dim or 0) if head_dim else None,
                )
            ),
        ),
        ("output", "merged · Woᵀ", shape_of("output")),
    ]
    return pd.DataFrame(rows, columns=["step", "operation", "shape"])


def head_summary(ds: xr.Dataset, batch: int = 0) -> pd.DataFrame:
    """Per head: where each position looks, summarised over one sample.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``weights``.
    batch : int
        The sample (by position).

    Returns
    -------
    pandas.DataFrame
        One row per head: the mean attention distance ``|query - key|`` (weighted),
        the most common offset ``key - query`` of each query's most attended key, the share
        of queries whose top key is that offset, the mean row entropy relative to uniform,
        and the three keys that receive the most attention overall.
    """
    weights = np.asarray(ds["weights"].isel(batch=batch).values, dtype=np.float32)
    stats = head_patterns(weights, Positions.of(ds, batch).named)
    labels = _labels(ds, batch)
    records = []
    for head in range(weights.shape[0]):
        received = weights[head].sum(axis=0, dtype=np.float64)
        most = np.argsort(received)[::-1][:3]
        records.append(
            {
                "head": int(ds["head"].values[head]),
                "mean_distance": float(stats["distance"][head]),
                "top_offset": int(stats["lag"][head]),
                "top_offset_share": float(stats["lag_share"][head]),
                "entropy_vs_uniform": float(stats["entropy"][head]),
                "most_attended": ", ".join(labels[i] for i in most),
            }
        )
    return pd.DataFrame.from_records(records)


def _labels(ds: xr.Dataset, batch: int) -> list[str]:
    """Readable labels of the positions of one sample: tokens, else the index with its
    time (``3@08:03``), span or name (``480@statistics``); a position without a time (NaT:
    a padded place) keeps its index alone."""
    if "token" in ds.coords:
        tokens = ds["token"].isel(batch=batch).values
        return [f"{i}:{t}" for i, t in enumerate(tokens)]
    found = Positions.of(ds, batch)
    labels = found.labels()
    if labels is None and found.times is not None:  # a clock with holes: times where known
        labels = [pd.Timestamp(t).strftime("%H:%M") if not pd.isna(t) else ""
                  for t in found.times]  # fmt: skip
    if labels is None:
        return [str(i) for i in range(ds.sizes["query"])]
    return [f"{i}@{label}" if label and label != str(i) else str(i)
            for i, label in enumerate(labels)]  # fmt: skip


def top_key_table(ds: xr.Dataset, batch: int = 0) -> pd.DataFrame:
    """For every query position, the key each head attends to most.

    Returns
    -------
    pandas.DataFrame
        One row per position (its label as index), one column per head (``head N``),
        each cell the label of the most attended key and its weight.
    """
    weights = np.asarray(ds["weights"].isel(batch=batch).values)
    labels = _labels(ds, batch)
    columns = {}
    for head in range(weights.shape[0]):
        top = weights[head].argmax(axis=1)
        peak = weights[head].max(axis=1)
        columns[f"head {int(ds['head'].values[head])}"] = [
            f"{labels[k]} ({w:.2f})" for k, w in zip(top, peak, strict=True)
        ]
    return pd.DataFrame(columns, index=pd.Index(labels, name="query"))


def describe(ds: xr.Dataset, batch: int = 0, positions: bool | None = None) -> str:
    """A plain-text report: attributes, the shape table and the per-head summary.

    ``positions`` adds, per query position, the key each head attends to most (by default
    for sequences of at most 64 positions, such as sentences).
    """
    attrs = ", ".join(f"{k}={v}" for k, v in ds.attrs.items() if k != "source")
    lines = [f"trace: {attrs}"]
    if ds.attrs.get("source"):
        lines.append(f"source: {str(ds.attrs['source']).splitlines()[0]}")
    lines += ["", shape_table(ds).to_string(index=False), "", f"heads, sample {batch}:"]
    summary = head_summary(ds, batch)
    queries = ds.sizes["query"]
    for row in summary.itertuples(index=False):
        count = round(row.top_offset_share * queries)  # a count: "0%" hid 1 of 480
        lines.append(
            f"  head {row.head}: mean distance {row.mean_distance:.1f}, "
            f"top key at offset {row.top_offset:+d} for {count} of {queries} queries, "
            f"entropy {row.entropy_vs_uniform:.2f} of uniform, most attended {row.most_attended}"
        )
    if positions or (positions is None and ds.sizes["query"] <= 64):
        lines += ["", "most attended key per query position:", top_key_table(ds, batch).to_string()]
    return "\n".join(lines)


def _masked_words(ds: xr.Dataset, mask) -> str:
    """The masking step as it was done: the fill the model wrote into blocked cells
    (recorded at capture), never a value it did not use; on the page (``mask`` "selected
    above") a mask other than the trace's own is recomputed here, with :data:`MASK_FILL`."""
    fill = ds.attrs.get("mask_fill")
    own = (
        f"blocked cells filled with {fill} by the model"
        if fill
        else "blocked cells masked (the model's fill is not recorded in this trace)"
    )
    if mask == "selected above":
        fill_used = MASK_FILL if normaliser(ds) == "softmax" else 0
        other = f"other masks recomputed with {fill_words((fill_used,))}"
        return f"{own} (its own mask: {ds.attrs.get('mask', 'none')}); {other}"
    blocks = mask != "none" or any(n in ds for n in ("padding", "blocked", "bias"))
    if not blocks:
        return "nothing blocked (mask none)"
    return f"{own} (mask {mask})"


def blocked_note(ds: xr.Dataset, sel: Selection) -> str:
    """What the black cells of the selection's map are, in words ("" where none are)."""
    mask = core.mask_mode(ds, sel)
    padded = "padding" in ds and bool(np.asarray(ds["padding"].isel(batch=sel.sample)).any())
    if sel.stage in core.PRE_MASK or (mask == "none" and not padded):
        return ""
    what = f"the {mask} mask" if mask != "none" else "padding"
    fill = ds.attrs.get("mask_fill") if mask == ds.attrs.get("mask", "none") else None
    filled = f" (the model fills their scores with {fill})" if fill else ""
    return f"black: cells {what} blocks{filled}, weight exactly 0 after the softmax"


def _feature_words(ds) -> str:
    """A linear attention's scores: its features' products, its feature map named where the
    capture read it (``feature_map``: of the layer's own projections z)."""
    named = ds.attrs.get("feature_map")
    return f"φ(q)·φ(k)ᵀ, φ(z) = {named}" if named else "φ(q)·φ(k)ᵀ (the features of q and k)"

"""Why a head attends, drawn: one cell's score split over the input (query side and key
side in two colours, on the input's own axis) and its channels' totals.

The numbers are :func:`attnpanel.score_attribution`'s ``(side, channel, position)`` shares
of the score's change from the baseline; these views sum them over channels (per
position) or over positions (per channel) and draw nothing else. Where there is no
attribution (a blocked cell, the mean of heads), the views are empty and their title says
why.
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import xarray as xr

from attnpanel.readouts import core

SIDE_WORDS = {"query": "through the query", "key": "through the key"}
SHARE = hv.Dimension("share", label="share of the score's change")
TOP_CHANNELS = 12  # rows of the channel table; the rest summed in one row


def share_text(value: float) -> str:
    """A share to three significant digits, signed (``+0.153``, ``-4.2e-05``)."""
    return f"{value:+.3g}" if np.isfinite(value) else "–"


def cell_words(found: xr.DataArray, labels: list[str] | None = None) -> str:
    """The cell, in words: ``sample 0, query 100 (07:40) → key 90 (07:30), head 3 of
    encoder.2.attention`` (each position's clock time or token where ``labels`` has it)."""
    a = found.attrs

    def named(position: int) -> str:
        ok = labels is not None and 0 <= position < len(labels) and labels[position]
        return f"{position} ({labels[position]})" if ok else str(position)

    return (
        f"sample {a['sample']}, query {named(a['query'])} → key {named(a['key'])}, "
        f"head {a['head']} of {a['layer']}"
    )


# what the score explained is, by the layer's normaliser
SCORE_WORDS = {
    "softmax": "score (before the softmax)",
    "row sum": "score φ(q)·φ(k) (before the row sum)",
}


def cell_table(found: xr.DataArray | None, reason: str = "", mask: str = "") -> hv.Table:
    """The cell, its score and what the shares add up to (the completeness check's
    numbers), one row each; where there is no attribution, the reason."""
    if found is None:
        rows = [("no attribution", reason)]
    else:
        a = found.attrs
        change = a["score"] - a["baseline_score"]
        error = a["completeness_error"]
        share = f" ({100 * abs(error) / abs(change):.2g} % of the change)" if change else ""
        rows = [
            ("cell", cell_words(found)),
            ("mask", f"the model's own ({mask}): the Mask menu recomputes maps, not the model"),
            (SCORE_WORDS[a.get("normaliser", "softmax")], f"{a['score']:.4g}"),
            (f"score at the {a['baseline']} baseline", f"{a['baseline_score']:.4g}"),
            ("change", share_text(change)),
            ("sum of the shares", share_text(float(found.sum()))),
            ("completeness error", f"{error:.1e}{share}"),
            ("method", f"{a['method']}, {a['steps']} steps"),
            ("attributed at", str(a["attributed_at"])),
        ]
    what, value = zip(*rows, strict=True)
    return hv.Table(
        {"what": np.array(what, dtype=object), "value": np.array(value, dtype=object)},
        kdims=["what"],
        vdims=["value"],
        group="WhyCell",
        label="the cell explained (integrated gradients from the baseline)",
    )


def _axis(ds: xr.Dataset, sel: core.Selection, positions: int) -> tuple[np.ndarray, str]:
    """The input's x values (clock times where the trace has them for every position)."""
    xs, name = core.position_axis(ds, sel)
    if len(xs) == positions:
        return xs, name
    return np.arange(positions), "position"


def cell_marks(ds: xr.Dataset, sel: core.Selection, key: int, xs=None) -> list[hv.VLine]:
    """The query's and the key's positions marked (groups ``QueryMark``, ``KeyMark``) on
    the input's axis ``xs`` (default: the trace's positions)."""
    if xs is None:
        xs, _ = _axis(ds, sel, ds.sizes["key"])
    return [
        hv.VLine(xs[min(at, len(xs) - 1)], group=group)
        for at, group in ((sel.query, "QueryMark"), (key, "KeyMark"))
    ]


def position_shares(
    ds: xr.Dataset,
    sel: core.Selection,
    key: int,
    found: xr.DataArray | None,
    reason: str = "",
    labels: list[str] | None = None,
) -> hv.Overlay:
    """Each position's share of the score's change (summed over the channels), through the
    query (group ``WhyQuery``) and through the key (``WhyKey``), with the query's and the
    key's positions marked (``sel.query``, ``key``); empty, titled ``reason``, where there
    is no attribution."""
    positions = ds.sizes["key"] if found is None else found.sizes["position"]
    xs, name = _axis(ds, sel, positions)
    xdim = hv.Dimension(name)
    layers = []
    for side, group in (("query", "WhyQuery"), ("key", "WhyKey")):
        # nothing to draw: no line, over this sample's positions (its axis, not the last's)
        missing = np.full(len(xs), np.nan)
        values = found.sel(side=side).sum("channel").values if found is not None else missing
        layers.append(hv.Curve((xs, values), xdim, SHARE, group=group, label=SIDE_WORDS[side]))
    layers += cell_marks(ds, sel, key, xs)
    if found is None:
        return hv.Overlay(layers, label=reason)
    return hv.Overlay(
        layers,
        label=f"why {cell_words(found, labels)}: shares per position, through the query (blue) and "
        "through the key (vermillion)",
    )


def largest(names: list[str], query: np.ndarray, key: np.ndarray, size: np.ndarray) -> list:
    """``(name, query share, key share)`` rows, the :data:`TOP_CHANNELS` of the largest
    ``size`` first, then the rest summed in one row."""
    order = np.argsort(-size, kind="stable")
    rows = [(names[i], query[i], key[i]) for i in order[:TOP_CHANNELS]]
    rest = order[TOP_CHANNELS:]
    if len(rest):
        rows.append((f"the other {len(rest)}", query[rest].sum(), key[rest].sum()))
    return rows


def channel_table(found: xr.DataArray | None) -> hv.Table:
    """Each channel's share through the query, through the key and in all, the largest
    first (:data:`TOP_CHANNELS`, then the rest summed in one row)."""
    columns = {"channel": [], "through the query": [], "through the key": [], "total": []}
    if found is not None:
        sums = found.sum("position")
        query, key = sums.sel(side="query").values, sums.sel(side="key").values
        names = [str(c) for c in found["channel"].values]
        for channel, q, k in largest(names, query, key, np.abs(query + key)):
            columns["channel"].append(channel)
            columns["through the query"].append(share_text(float(q)))
            columns["through the key"].append(share_text(float(k)))
            columns["total"].append(share_text(float(q + k)))
    data = {name: np.array(values, dtype=object) for name, values in columns.items()}
    return hv.Table(
        data,
        kdims=["channel"],
        vdims=["through the query", "through the key", "total"],
        group="WhyChannels",
        label="per input channel: its share of the score's change, the largest first",
    )


def parts_table(found: xr.DataArray | None, reason: str = "") -> hv.Table:
    """Each earlier part's share of the score (:func:`attnpanel.component_attribution`)
    through the query and through the key, the largest first; where the split does not
    apply, why."""
    columns = {"part": [], "through the query": [], "through the key": []}
    if found is None:
        columns = {"part": ["no split"], "through the query": [reason], "through the key": [""]}
    else:
        by_query = found.sum("key_part").to_series()
        by_key = found.sum("query_part").to_series()
        names = list(dict.fromkeys([*by_query.index, *by_key.index]))
        query = np.array([by_query.get(n, 0.0) for n in names])
        key = np.array([by_key.get(n, 0.0) for n in names])
        rows = largest(names, query, key, np.abs(query) + np.abs(key))
        bias = float(found.attrs.get("additive_bias", 0.0))
        if abs(bias) > 1e-6 * max(abs(float(found.attrs["score"])), 1.0):
            rows.append(("added to the score (a mask's or a position bias)", bias, bias))
        for name, q, k in rows:
            columns["part"].append(name)
            columns["through the query"].append(share_text(float(q)))
            columns["through the key"].append(share_text(float(k)))
    data = {name: np.array(values, dtype=object) for name, values in columns.items()}
    return hv.Table(
        data,
        kdims=["part"],
        vdims=["through the query", "through the key"],
        group="WhyParts",
        label="the score itself over the earlier parts that wrote the layer's input (each "
        "column adds up to the score)",
    )

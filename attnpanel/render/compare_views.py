"""Views of two captures compared: the heads ranked by divergence, and the titles of the
A, B and B - A maps.

Pure functions of the numbers :func:`attnpanel.readouts.compare.compare` computed (the
ranking of :func:`attnpanel.readouts.compare.ranked_heads`) returning HoloViews elements;
the comparison page's sections (``attnpanel.app.sections.comparison``) draw them through
the engine, and the offline report (:mod:`attnpanel.render.compare_report`) names its
heads the same way.
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import pandas as pd
import xarray as xr

from attnpanel.readouts import core
from attnpanel.render.palette import head_color
from attnpanel.render.views import FAST_DATATYPE

BAR_HALF = 0.38  # half a bar's height, in ranks
JS_LABEL = "Jensen-Shannon divergence (nats, mean over real queries)"


def head_name(layer_name: str, head: int) -> str:
    """A ranked head as the page names it: ``layer encoder.1.attn, head 3`` (``head 3`` for
    one layer)."""
    if not layer_name:
        return f"head {head}"
    return f"layer {core.layer_label(layer_name)}, head {head}"


COMPARED_TITLE_LINE = 40  # characters of a compared map's title line (a 300 px map)


def compared_title(which: str, ds: xr.Dataset, sel: core.Selection) -> str:
    """The title of one of the three maps: ``A · sample 0, layer 1, head 3``."""
    name = str(ds["layer"].item()) if "layer" in ds.coords and ds["layer"].ndim == 0 else ""
    head = head_name(name, int(sel.head))
    return core.fitted_title(f"{which} · sample {sel.sample}", ",", head, COMPARED_TITLE_LINE)


def ranking_ticks(ranking: pd.DataFrame) -> list[tuple[int, str]]:
    """The ranking chart's y ticks: each shown head's name at its rank (the first on top)."""
    return [
        (rank, head_name(row.layer_name, int(row.head)))
        for rank, row in enumerate(ranking.itertuples(index=False))
    ]


def ranking_view(ranking: pd.DataFrame) -> hv.Overlay:
    """The shown heads ranked by divergence: a bar per head (its ``js``, in its head's
    colour) and beside it the number and the largest ``|b - a|``.

    Parameters
    ----------
    ranking : pandas.DataFrame
        The heads shown, most different first (rows of
        :func:`attnpanel.readouts.compare.ranked_heads`).

    Returns
    -------
    holoviews.Overlay
        ``Rectangles`` (group ``Ranking``: bars at y = rank, the first on top) and
        ``Labels`` (group ``Ranking``).
    """
    ranks = np.arange(len(ranking), dtype=np.float64)
    js = np.nan_to_num(ranking["js"].to_numpy(dtype=np.float64))
    gaps = ranking["max_abs"].to_numpy(dtype=np.float64)
    bars = hv.Rectangles(
        {
            "x0": np.zeros(len(ranks)),
            "y0": ranks - BAR_HALF,
            "x1": js,
            "y1": ranks + BAR_HALF,
            "value": js,
            "max_abs": gaps,
            "name": [head_name(r.layer_name, int(r.head)) for r in ranking.itertuples()],
            "color": [head_color(int(h)) for h in ranking["head"]],
        },
        kdims=["x0", "y0", "x1", "y1"],
        vdims=["value", "max_abs", "name", "color"],
        group="Ranking",
        datatype=FAST_DATATYPE,
    )
    text = [
        f"{value:.3g} · max |b−a| {gap:.3g}" if np.isfinite(value) else "no real query"
        for value, gap in zip(ranking["js"], gaps, strict=True)
    ]
    labels = hv.Labels(
        {"x": np.full(len(ranks), 0.78 * label_column(ranking)), "y": ranks, "text": text},
        kdims=["x", "y"],
        vdims=["text"],
        group="Ranking",
    )
    return hv.Overlay([bars, labels], label="")


def opened_row(ranking: pd.DataFrame, layer: int, head: int) -> hv.Rectangles:
    """The open head's row of the ranking chart outlined (group ``Selected``; nothing when
    it is not among the heads shown)."""
    ranks = np.arange(len(ranking), dtype=np.float64)
    opened = (ranking["layer"].to_numpy() == layer) & (ranking["head"].to_numpy() == head)
    rows = ranks[opened]
    reach = label_column(ranking)
    return hv.Rectangles(
        {
            "x0": np.full(len(rows), -0.01 * reach),
            "y0": rows - 0.5,
            "x1": np.full(len(rows), 0.99 * reach),
            "y1": rows + 0.5,
        },
        kdims=["x0", "y0", "x1", "y1"],
        group="Selected",
        datatype=FAST_DATATYPE,
    )


def label_column(ranking: pd.DataFrame) -> float:
    """The x extent of the ranking chart: the largest ``js`` and room for the labels."""
    top = float(np.nanmax(ranking["js"].to_numpy(dtype=np.float64), initial=0.0))
    return 1.7 * top if top > 0 else 1.0


def ranked_at(ranking: pd.DataFrame, y: float) -> tuple[int, int] | None:
    """``(layer, head)`` of the bar under a click at ``y`` (its rank), or None."""
    rank = round(float(y))
    if not 0 <= rank < len(ranking):
        return None
    row = ranking.iloc[rank]
    return int(row["layer"]), int(row["head"])

"""The composition graph's data: heads as nodes by layer, pairs above the random baseline
as lines (:func:`attnpanel.circuits`'s Dataset; drawn by
:class:`attnpanel.app.sections.composition.HeadComposition`).

Only numbers of the result are drawn: a line for each pair whose score is above
``composition_baseline_p95`` of its mode, its width growing with the score; a node's
colour is its ``ov_copying``.
"""

from __future__ import annotations

import numpy as np
import xarray as xr
from matplotlib import colormaps
from matplotlib.colors import to_hex

COPYING_PALETTE = [to_hex(c) for c in colormaps["viridis"](np.linspace(0, 1, 256))]
NODE_TIPS = [("layer", "@layer"), ("head", "@head"), ("OV copying score", "@copying{0.000}")]
EDGE_TIPS = [
    ("earlier head", "@earlier"),
    ("later head", "@later"),
    ("composition score", "@score{0.000}"),
    ("x random p95", "@times{0.000}"),
]
PAIR_COLUMNS = ("earlier_layer", "earlier_head", "later_layer", "later_head")
NEAREST = 0.2  # a click this far from a line (in layer and head units) picks it
WIDEST = 7.0  # px of the line of the largest score
CURVE_POINTS = 17  # points along a line that skips a layer (drawn and hit as a polyline)
# the part of each line its hover answers on: not near its ends, where every line of a head
# meets (a hover on a head's dot listed them all, 480 px of tooltips)
HOVERED = (0.2, 0.8)


def curve(
    x0: float, y0: float, x1: float, y1: float, part: tuple[float, float] = (0.0, 1.0)
) -> tuple[np.ndarray, np.ndarray]:
    """The points of a line from head ``(x0, y0)`` to ``(x1, y1)``: straight between
    successive layers; over skipped layers a quadratic curve whose middle lies half-way
    between two heads (a straight line went through the skipped layer's dots), never
    beyond the heads it joins by more than half a head. ``part``: the span of the line (0
    to 1 along it) whose points are given."""
    if x1 - x0 <= 1:
        t = np.asarray(part, float)
        return x0 + t * (x1 - x0), y0 + t * (y1 - y0)
    t = np.linspace(*part, CURVE_POINTS)
    middle = (y0 + y1) / 2  # on a head's dot where a whole number: then half a head off,
    between = middle if middle % 1 else (middle - 0.5 if middle > 0 else 0.5)  # inwards
    control = 2 * between - middle  # the curve's middle point is (P0 + 2 C + P1) / 4
    xs = x0 + t * (x1 - x0)
    ys = (1 - t) ** 2 * y0 + 2 * t * (1 - t) * control + t**2 * y1
    return xs, ys


def _curves(x0, y0, x1, y1, part=(0.0, 1.0)) -> tuple[list, list]:
    points = [curve(*ends, part) for ends in zip(x0, y0, x1, y1, strict=True)]
    return [p[0] for p in points], [p[1] for p in points]


def node_columns(result: xr.Dataset) -> dict:
    """Every head: its place (x layer index, y head), names and OV copying score."""
    copying = result["ov_copying"]
    layers = [str(v) for v in result["layer"].values]
    index, heads = np.meshgrid(np.arange(len(layers)), result["head"].values, indexing="ij")
    return {
        "x": index.ravel().astype(float),
        "y": heads.ravel().astype(float),
        "layer": [layers[i] for i in index.ravel()],
        "head": heads.ravel(),
        "copying": np.asarray(copying.values, dtype=float).ravel(),
    }


def edge_columns(result: xr.Dataset, mode: str) -> dict:
    """Every pair of heads whose ``mode`` composition score is above the random p95."""
    scores = result["composition"].sel(mode=mode)
    p95 = float(result["composition_baseline_p95"].sel(mode=mode))
    layers = [str(v) for v in result["layer"].values]
    values = np.nan_to_num(np.asarray(scores.values, dtype=float), nan=-np.inf)
    found = np.argwhere(values > p95)  # (layer, head, later_layer, later_head)
    chosen = values[tuple(found.T)] if len(found) else np.zeros(0)
    top = chosen.max() if len(chosen) else 1.0
    later_names = [str(v) for v in scores["later_layer"].values]
    later_index = [layers.index(name) for name in later_names]
    x0, y0 = found[:, 0].astype(float), found[:, 1].astype(float)
    x1 = np.array([later_index[i] for i in found[:, 2]], dtype=float)
    y1 = found[:, 3].astype(float)
    xs, ys = _curves(x0, y0, x1, y1)
    hover_xs, hover_ys = _curves(x0, y0, x1, y1, HOVERED)
    return {
        "hover_xs": hover_xs,
        "hover_ys": hover_ys,
        "x0": x0,
        "y0": y0,
        "x1": x1,
        "y1": y1,
        "xs": xs,
        "ys": ys,
        "earlier": [f"{layers[a]} head {h}" for a, h in found[:, :2]],
        "later": [f"{later_names[a]} head {h}" for a, h in found[:, 2:]],
        "earlier_layer": [layers[a] for a in found[:, 0]],
        "later_layer": [later_names[a] for a in found[:, 2]],
        "earlier_head": found[:, 1],
        "later_head": found[:, 3],
        "score": chosen,
        "times": chosen / p95,
        "width": 1.0 + (WIDEST - 1.0) * (chosen - p95) / max(top - p95, 1e-12),
    }


def chosen_columns(pair: tuple | None, layers: list[str]) -> dict:
    """The line of the pair whose maps are drawn (none where ``pair`` is None)."""
    if pair is None:
        return {"xs": [], "ys": []}
    xs, ys = curve(float(layers.index(pair[0])), float(pair[1]),
                   float(layers.index(pair[2])), float(pair[3]))  # fmt: skip
    return {"xs": [xs], "ys": [ys]}


def graph_title(edges: dict, mode: str) -> str:
    """The graph's title: the mode, how many pairs are above random (``edges``:
    :func:`edge_columns` of it), and the largest."""
    count = len(edges["score"])
    if not count:
        return f"{mode}-composition: no pair of heads above random matrices (p95)"
    best = int(np.argmax(edges["score"]))
    return (
        f"{mode}-composition: {count} pairs above random (p95); the largest "
        f"{edges['earlier'][best]} → {edges['later'][best]}, {edges['times'][best]:.2f}x"
    )


def nearest_edge(edges: dict, x: float, y: float) -> tuple[str, int, str, int] | None:
    """The pair ``(earlier layer, head, later layer, head)`` of the line nearest a click,
    or None where none is within :data:`NEAREST`."""
    if not len(edges["xs"]):
        return None
    distance = np.array([_to_polyline(np.asarray(xs, float), np.asarray(ys, float), x, y)
                         for xs, ys in zip(edges["xs"], edges["ys"], strict=True)])  # fmt: skip
    i = int(np.argmin(distance))
    if distance[i] > NEAREST:
        return None
    return (
        str(edges["earlier_layer"][i]),
        int(edges["earlier_head"][i]),
        str(edges["later_layer"][i]),
        int(edges["later_head"][i]),
    )


def _to_polyline(xs: np.ndarray, ys: np.ndarray, x: float, y: float) -> float:
    """The distance of ``(x, y)`` to the polyline through ``(xs, ys)``."""
    x0, y0, dx, dy = xs[:-1], ys[:-1], np.diff(xs), np.diff(ys)
    along = np.clip(((x - x0) * dx + (y - y0) * dy) / np.maximum(dx * dx + dy * dy, 1e-12), 0, 1)
    return float(np.hypot(x0 + along * dx - x, y0 + along * dy - y).min())


def pair_head(pair: tuple, which: str, edges: dict, layers: list[str]) -> tuple[str, int]:
    """The earlier or the later head of a picked pair; where none is picked, of the line of
    the largest score; where there is no line, head 0 of the first or the last of
    ``layers``."""
    if not (pair[0] and pair[1] >= 0) and len(edges["score"]):
        best = int(np.argmax(edges["score"]))
        pair = tuple(edges[name][best] for name in PAIR_COLUMNS)
    layer, head = pair[:2] if which == "earlier" else pair[2:]
    if not layer or head < 0:
        return layers[0 if which == "earlier" else -1], 0
    return str(layer), int(head)

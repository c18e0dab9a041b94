"""Views of what the prediction needs: each head's importance, the prediction with heads
switched off, and the model's metrics with and without them.

Pure functions of numbers the model computed (its predictions, re-run with heads switched
off: :class:`attnpanel.interventions.model_run.ModelRun`) returning HoloViews elements; the
section (``attnpanel.app.sections.importance``) draws them through the engine.
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import xarray as xr

from attnpanel.readouts import core, quantities
from attnpanel.render.elements import Raster
from attnpanel.render.tables import NOT_AVAILABLE, WHY
from attnpanel.render.views import FAST_DATATYPE

OFF_SUFFIX = " (heads off)"


def importance_map(importance: xr.DataArray) -> Raster:
    """Layers (rows, the first on top: maps are drawn with y down) by heads, each cell a
    head's importance (group ``Importance``; NaN where a layer has fewer heads)."""
    values = np.asarray(importance.values, dtype=np.float32)
    rows, cols = values.shape
    sample = importance.attrs.get("sample")
    where = f", sample {sample}" if sample is not None else ""
    return Raster(
        values,  # rows by ascending y: layer i at y = i, drawn top down
        (-0.5, -0.5, cols - 0.5, rows - 0.5),
        "Importance",
        # no click hint: a click opens only the heads of layers in the trace, which the
        # section's words say (the hint "click opens a head" was untrue of the others)
        core.wrapped_title(f"head importance{where}"),
        "‖Δ output‖ / ‖output‖",
    )


def layer_ticks(layers) -> list[tuple[int, str]]:
    """The map's y ticks: each layer's name at its row (layer 0 on top)."""
    return [(i, core.layer_label(name)) for i, name in enumerate(layers)]


def tapped_head(heads: dict[str, int], x: float, y: float) -> tuple[str, int] | None:
    """The ``(layer, head)`` under a click on :func:`importance_map` of layers with
    ``heads`` (layer name to head count, in the map's order), or None."""
    row, head = round(y), round(x)
    layers = list(heads)
    if not 0 <= row < len(layers) or not 0 <= head < heads[layers[row]]:
        return None
    return layers[row], int(head)


def prediction_curves(
    ds: xr.Dataset,
    sel: core.Selection,
    plain: np.ndarray,
    ablated: np.ndarray,
    series: list[str],
    off: list[int],
) -> hv.Overlay:
    """The input signal with each predicted series, with all heads (solid) and with the
    switched-off heads ``off`` (dashed; the same as all heads when none is off)."""
    found = core.sequence_series(ds, sel, show_reference=False)
    length = plain.shape[-1]
    over_positions = len(found.xs) == length  # else a prediction of its own length
    xs = found.xs if over_positions else np.arange(length)
    xdim = hv.Dimension(found.xname)
    label, unit = quantities.prediction_axis(ds, found, with_signal=over_positions)
    ydim = hv.Dimension("value", label=label, unit=unit)
    curves = [
        hv.Curve((xs, values), xdim, ydim, group="Prediction", label=label, datatype=FAST_DATATYPE)
        for label, values in (found.series[:1] if over_positions else [])
    ]
    for name, with_all, without in zip(series, plain, ablated, strict=True):
        curves.append(
            hv.Curve(
                (xs, with_all), xdim, ydim, group="Prediction", label=f"{name}{core.PREDICTED}"
            )
        )
        curves.append(
            hv.Curve((xs, without), xdim, ydim, group="Prediction", label=f"{name}{OFF_SUFFIX}")
        )
    heads = ", ".join(map(str, off))
    heads = f"head {heads}" if len(off) == 1 else f"heads {heads}"
    what = f"{heads} switched off in this layer" if off else "every head on"
    return hv.Overlay(curves, label=f"the model's prediction, sample {sel.sample}: {what}")


def change_text(before: str, after: str, change: float) -> str:
    """A change written to the decimals of the two values it lies between (``10.91`` and
    ``10.92`` -> ``+0.01``; ``1`` and ``0.9152`` -> ``-0.0848``); four significant digits
    where either is in e-notation; one significant digit where it is too small for them."""
    if not np.isfinite(change):
        return "–"
    if change == 0:
        return "+0"
    if "e" in before or "e" in after:
        return f"{change:+.4g}"
    decimals = max(len(text.split(".")[1]) if "." in text else 0 for text in (before, after))
    text = f"{change:+.{decimals}f}"
    return f"{change:+.1g}" if float(text) == 0 else text


F1_UNDEFINED = (
    "F1 is undefined here: neither the truth nor the prediction is ever on in this sample"
)


def _metric_text(value: float) -> str:
    """A metric's value to four significant digits; "n/a" where it is undefined (NaN)."""
    return f"{value:.4g}" if np.isfinite(value) else NOT_AVAILABLE


def _why(name: str) -> str:
    return F1_UNDEFINED if name.startswith("F1") else f"{name} is undefined on this sample"


def metric_table(with_all: dict[str, float], without: dict[str, float], off: list[int]) -> hv.Table:
    """Each metric with every head and with the switched-off heads, and the change."""
    rows = []
    for name, value in with_all.items():
        shown, other = _metric_text(value), _metric_text(without[name])
        undefined = NOT_AVAILABLE in (shown, other)
        change = "–" if undefined else change_text(shown, other, without[name] - value)
        rows.append((name, shown, other, change, _why(name) if undefined else ""))
    label = "heads off" if off else "heads off (none)"
    return hv.Table(
        rows,
        kdims=["metric"],
        vdims=["every head", label, "change", WHY],
        group="Metrics",
        label="the model's metrics on this sample",
    )


def rollout_values(flow: xr.DataArray, sample: int = 0) -> tuple[np.ndarray, str, str]:
    """A rollout (:func:`attnpanel.rollout`) of one sample as a regridded map's
    ``(values, label, colour-bar title)``: rows by query."""
    values = np.asarray(flow.isel(batch=sample).values, dtype=np.float32)
    layers = flow.attrs.get("layers", "")
    kind = "rollout" if flow.attrs.get("weighted", "plain") == "plain" else "gradient rollout"
    label = f"{kind} through {layers} layers"
    return values, label, f"flow (residual {flow.attrs.get('residual', 0.5)})"

"""Views of what changes the prediction: every head's patching effect between a clean and a
corrupted input, and the prediction with one head patched.

Pure functions of numbers the model computed (:meth:`ModelRun.patching`, the model run with
a head's tensors taken from the clean run) returning HoloViews elements; the section
(``attnpanel.app.sections.patching``) draws them through the engine.
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import xarray as xr

from attnpanel.readouts import core, quantities
from attnpanel.render.elements import Raster
from attnpanel.render.views import FAST_DATATYPE

EFFECT_LABEL = "share restored"
CORRUPTED = " (corrupted)"
PATCHED = " (head patched)"


def effect_map(effect: xr.DataArray) -> Raster:
    """Layers (rows, the first on top) by heads, each cell a head's patching effect (group
    ``Patching``, centred on 0; NaN where a layer has fewer heads)."""
    values = np.asarray(effect.values, dtype=np.float32)
    rows, cols = values.shape
    what = effect.attrs.get("what", "output")
    return Raster(
        values,
        (-0.5, -0.5, cols - 0.5, rows - 0.5),
        "Patching",
        core.wrapped_title(
            f"{what} patched into {effect.attrs.get('corrupted', 'the corrupted input')}"
        ),
        EFFECT_LABEL,
    )


def no_effect(reason: str, layers: int, heads: int) -> Raster:
    """An empty map that says why there is no effect to draw."""
    values = np.full((layers, heads), np.nan, dtype=np.float32)
    return Raster(values, (-0.5, -0.5, heads - 0.5, layers - 0.5), "Patching", reason, EFFECT_LABEL)


def patched_curves(
    ds: xr.Dataset,
    sel: core.Selection,
    predictions: dict[str, np.ndarray],
    series: list[str],
    head: str,
    other: int | None = None,
) -> hv.Overlay:
    """Each predicted series on the clean input (solid), on the corrupted one (dashed) and,
    where a head is picked, on the corrupted one with that head patched (dotted).

    ``predictions``: ``clean``, ``corrupted`` and (optional) ``patched``, each ``(series,
    position)``; ``head`` names the patched head ("" for none); ``other``: the corrupted
    input is that other sample, whose own hours differ: where its curves are drawn on the
    shown sample's clock, the title says they are drawn there position by position.
    """
    found = core.sequence_series(ds, sel, show_reference=False)
    clean = predictions["clean"]
    length = clean.shape[-1]
    xs = found.xs if len(found.xs) == length else np.arange(length)
    xdim = hv.Dimension(found.xname if len(found.xs) == length else "position")
    label, unit = quantities.prediction_axis(ds, found, with_signal=False)
    ydim = hv.Dimension("value", label=label, unit=unit)
    suffixes = {"clean": core.PREDICTED, "corrupted": CORRUPTED, "patched": PATCHED}
    curves = []
    for kind, suffix in suffixes.items():
        if kind not in predictions:
            continue
        for name, values in zip(series, predictions[kind], strict=True):
            curves.append(
                hv.Curve(
                    (xs, values),
                    xdim,
                    ydim,
                    group="Prediction",
                    label=f"{name}{suffix}",
                    datatype=FAST_DATATYPE,
                )  # fmt: skip
            )
    what = head if head.startswith("nothing") else f"prediction on {head} patched in"
    corrupted = np.asarray(predictions.get("corrupted", []), dtype=float)
    drawn = corrupted.size and np.isfinite(corrupted).any()
    if other is not None and other != sel.sample and xdim.name == "time" and drawn:
        what += f"; sample {other} drawn by position on sample {sel.sample}'s clock"
    return hv.Overlay(curves, label=what)

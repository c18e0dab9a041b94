"""Figures for papers: a view of the page written as SVG, PDF or PNG, offline.

Each figure is drawn from the numbers the page draws for the same state (the same
functions of :mod:`attnpanel.readouts.core` and :mod:`attnpanel.readouts.model_map`, at
full resolution: one image pixel per cell, never regridded) by matplotlib itself: vector
output (SVG, PDF) with its title, axis labels, colour bar and clock or token ticks, sized
for one column of a two-column paper (3.4 in wide, 8 pt text) or both (the heads, the
model view). Bokeh's own SVG and PNG export needs a browser driver; matplotlib writes all
three formats from the process itself. A figure imports no plotting library of the page
(HoloViews' matplotlib layout of eight heads took 4 s to plot and 5 s to import).

=============  ==============================================================================
``matrix``     the selected head's map at the selected stage and mask (``core.attention_values``)
``heads``      every head's map of the sample at that stage and mask, four to a row across
               the page, each on its own colour scale (or one for all, stated)
``model``      every layer x head map of the sample (the model view's mosaic; a trace of
               one layer: its heads in one row)
``importance`` a head ranking (``attnpanel importance``, ``head_importance``): layer x head
=============  ==============================================================================
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr
from matplotlib.figure import Figure

from attnpanel.readouts import core, model_map
from attnpanel.traces.schema import FIGURE_VIEWS, HEAD_SCALES
from attnpanel.util.files import write_safely

FIGURE_FORMATS = {".svg": "svg", ".pdf": "pdf", ".png": "png"}
COLUMN_INCHES = 3.4  # one column of a two-column paper
PAGE_INCHES = 7.0  # both columns (the heads figure, the model view)
HEADS_PER_ROW = 4
SMALL_TICKS = 3  # clock or token ticks along a head's map
FONT_PT = 8
TICKS = 6  # clock or token ticks along a map's axis
DPI = 300  # a PNG's resolution
COLORMAP = "viridis"


def matrix(ds: xr.Dataset, sel: core.Selection, number: int | None = None) -> Figure:
    """The large matrix of the page for ``sel``: keys across, queries down (``number``:
    the sample's number in its trace where ``ds`` holds it alone, :func:`view_of`)."""
    values = np.asarray(core.attention_values(ds, sel), dtype=np.float32)
    figure = Figure(figsize=(COLUMN_INCHES, COLUMN_INCHES), layout="constrained")
    axes = figure.add_subplot()
    image = _map(axes, values, _ticks(ds, sel.sample), _limits(values), FONT_PT)
    axes.set_title(core.matrix_title(ds, sel, number), fontsize=FONT_PT)
    axes.set_xlabel("key", fontsize=FONT_PT)
    axes.set_ylabel("query", fontsize=FONT_PT)
    _colorbar(figure, image, axes, core.stage_label(ds, sel.stage), FONT_PT)
    return figure


def heads(
    ds: xr.Dataset, sel: core.Selection, scale: str = "own", number: int | None = None
) -> Figure:
    """Every head's map of ``sel``'s sample, stage and mask, four to a row across a page.

    ``scale="own"`` (the default): each head on its own colour scale, its bar beside it (on
    one scale, the heads whose weights are spread look uniformly dark beside a sharp one);
    ``"shared"``: one scale for every head, its range stated in the title.
    """
    if scale not in HEAD_SCALES:
        raise ValueError(f"scale {scale!r}: one of {', '.join(HEAD_SCALES)}")
    names = ds["head"].values.tolist()
    every = [
        np.asarray(core.attention_values(ds, sel.with_(head=int(h))), dtype=np.float32)
        for h in names
    ]
    ticks = _ticks(ds, sel.sample, count=SMALL_TICKS)
    shared = _limits(np.stack(every)) if scale == "shared" else None
    rows = -(-len(names) // HEADS_PER_ROW)
    side = PAGE_INCHES / HEADS_PER_ROW
    figure = Figure(figsize=(PAGE_INCHES, rows * side + 0.4), layout="constrained")
    grid = np.atleast_1d(figure.subplots(rows, HEADS_PER_ROW, squeeze=False).ravel())
    text = FONT_PT - 2
    for index, (head, values) in enumerate(zip(names, every, strict=True)):
        axes = grid[index]
        image = _map(axes, values, ticks, shared or _limits(values), text)
        axes.set_title(f"head {head}", fontsize=text)
        # the axis names once, on the left and at the bottom; the bars' name is the title's
        axes.set_ylabel("" if index % HEADS_PER_ROW else "query", fontsize=text)
        axes.set_xlabel("key" if index >= len(names) - HEADS_PER_ROW else "", fontsize=text)
        if shared is None:
            _colorbar(figure, image, axes, "", text)
    for axes in grid[len(names) :]:
        axes.set_visible(False)
    if shared is None:
        said = "each head on its own colour scale"
    else:
        _colorbar(figure, image, list(grid[: len(names)]), "", text)
        said = f"one colour scale for every head, {shared[0]:.3g} to {shared[1]:.3g}"
    figure.suptitle(f"{_heads_title(ds, sel, number)}; {said}", fontsize=FONT_PT)
    return figure


def _limits(values: np.ndarray) -> tuple[float, float]:
    """The colour scale of ``values``: their finite range (a constant map: around it)."""
    low, high = (float(f(values)) for f in (np.nanmin, np.nanmax))
    return (low, high) if high > low else (low - 0.5, high + 0.5)


def model(ds: xr.Dataset, sel: core.Selection, number: int | None = None) -> Figure:
    """Every layer x head map of one sample (a trace of one layer: its heads, one row),
    each map square."""
    mosaic = model_map.model_mosaic(ds, sel)
    n_layers, n_heads = mosaic.attrs["n_layers"], mosaic.attrs["n_heads"]
    layers = np.atleast_1d(ds["layer"].values) if "layer" in ds.coords else [0]
    names = [core.layer_label(n) for n in layers]
    every = "every layer and head" if n_layers > 1 else f"every head of {names[0]}"
    figure = Figure(
        figsize=(PAGE_INCHES, PAGE_INCHES * n_layers / n_heads + 0.6), layout="constrained"
    )
    axes = figure.add_subplot()
    values = mosaic.values
    image = axes.imshow(
        values,
        cmap=COLORMAP,
        interpolation="nearest",
        extent=(-0.5, n_heads - 0.5, n_layers - 0.5, -0.5),  # layer 0 on top
        clim=_limits(values),
    )
    axes.set_xticks(range(n_heads), [str(h) for h in range(n_heads)], fontsize=FONT_PT - 1)
    axes.set_yticks(range(n_layers), names, fontsize=FONT_PT - 1)
    axes.set_xlabel("head", fontsize=FONT_PT)
    axes.set_ylabel("layer", fontsize=FONT_PT)
    sample = _number(sel, number)
    axes.set_title(f"sample {sample}: {every} (keys across, queries down)", fontsize=FONT_PT)
    # a bar as tall as the maps (beside the axes' box, laid out for a taller one, it ran
    # the figure's height): an inset of the map's own axes, taken in by a tight bounding box
    bar = figure.colorbar(image, cax=axes.inset_axes((1.02, 0.0, 0.015, 1.0)))
    bar.ax.tick_params(labelsize=FONT_PT - 1)
    bar.set_label("softmax weights", fontsize=FONT_PT - 1)
    return figure


def importance(ranking: xr.DataArray) -> Figure:
    """A head ranking's map: layer (rows) x head, each head's importance."""
    from attnpanel.render import importance_views  # (HoloViews: only this view needs it)

    raster = importance_views.importance_map(ranking)
    rows, cols = raster.values.shape
    figure = Figure(figsize=(COLUMN_INCHES, COLUMN_INCHES * rows / cols + 1.0))
    figure.set_layout_engine("constrained")
    axes = figure.add_subplot()
    image = axes.imshow(
        raster.values,  # rows by ascending layer: layer 0 on top
        cmap=COLORMAP,
        interpolation="nearest",
        extent=(-0.5, cols - 0.5, rows - 0.5, -0.5),
    )
    positions, labels = zip(*importance_views.layer_ticks(ranking["layer"].values), strict=True)
    axes.set_xticks(range(cols), [str(h) for h in range(cols)], fontsize=FONT_PT - 1)
    axes.set_yticks(positions, labels, fontsize=FONT_PT - 1)
    axes.set_xlabel("head", fontsize=FONT_PT)
    axes.set_ylabel("layer", fontsize=FONT_PT)
    title = " ".join(raster.label.split())
    axes.set_title(title, fontsize=FONT_PT)
    _colorbar(figure, image, axes, raster.value_label, FONT_PT)
    return figure


def view_of(
    view: str,
    ds: xr.Dataset,
    sel: core.Selection,
    stacked=None,
    ranking=None,
    scale="own",
    number: int | None = None,
) -> Figure:
    """The figure ``view`` (``FIGURE_VIEWS``) of the trace ``ds`` (one layer) for ``sel``;
    ``stacked``: the capture of every layer (the model view); ``ranking``: a head ranking
    (the importance map); ``scale``: the heads' colour scales (:func:`heads`); ``number``:
    the sample's number in its trace, where ``ds`` holds that sample alone (read so:
    ``attnpanel.load(path, samples=[number])``, ``sel.sample`` 0)."""
    if view == "matrix":
        return matrix(ds, sel, number)
    if view == "heads":
        return heads(ds, sel, scale, number)
    if view == "model":  # a trace of one layer: that layer's heads
        return model(ds if stacked is None else stacked, sel, number)
    if view == "importance":
        if ranking is None:
            raise ValueError(
                "the importance map needs a head ranking: the model at hand, or a ranking file "
                "(attnpanel importance ... -o ranking.nc; attnpanel figure ranking.nc)"
            )
        return importance(ranking)
    raise ValueError(f"view {view!r}: one of {', '.join(FIGURE_VIEWS)}")


def write_figure(figure: Figure, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``figure`` as the file ``path`` names (``.svg``, ``.pdf`` or ``.png``)."""
    path = Path(path)
    kind = FIGURE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: a figure is written as .svg, .pdf or .png, not {path.suffix!r}")

    def render(target: Path) -> None:
        figure.savefig(target, format=kind, dpi=DPI, bbox_inches="tight", pad_inches=0.05)

    return write_safely(path, kind, render, overwrite)


def maps_of(figure: Figure) -> list:
    """The axes of a figure that draw a map (not its colour bars), in reading order."""
    return [axes for axes in figure.axes if axes.get_images() and axes.get_visible()]


def data_of(figure: Figure) -> np.ndarray:
    """The numbers a figure draws, rows by query (or layer) from the top, NaN where it
    leaves a cell blank: to compare with the page's."""
    found = [np.ma.filled(axes.get_images()[0].get_array(), np.nan) for axes in maps_of(figure)]
    return found[0] if len(found) == 1 else np.stack(found)


def _map(axes, values: np.ndarray, ticks, limits, fontsize: float):
    """``values`` (rows by query, query 0 on top) as a square map on ``axes``; its image."""
    length, keys = values.shape
    image = axes.imshow(
        values,
        cmap=COLORMAP,
        interpolation="nearest",
        extent=(-0.5, keys - 0.5, length - 0.5, -0.5),
        clim=limits,
    )
    axes.tick_params(labelsize=fontsize - 1)
    if ticks is not None:
        positions, labels = zip(*ticks, strict=True)
        axes.set_xticks(positions, labels, rotation=90)
        axes.set_yticks(positions, labels)
    return image


def _colorbar(figure: Figure, image, axes, label: str, fontsize: float) -> None:
    bar = figure.colorbar(image, ax=axes, fraction=0.046, pad=0.03)
    bar.ax.tick_params(labelsize=fontsize - 1)
    if label:
        bar.set_label(label, fontsize=fontsize)


def _ticks(ds: xr.Dataset, sample: int, count: int = TICKS) -> list[tuple[int, str]] | None:
    """A map's axis ticks, about ``count``: clock times (``time``) or tokens, else None
    (positions, matplotlib's own ticks)."""
    labels = core.clock_labels(ds, sample)
    if labels is None:
        labels = model_map.tokens(ds, sample)
    if labels is None:
        return None
    step = max(1, int(np.ceil(len(labels) / count)))
    return [(i, labels[i]) for i in range(0, len(labels), step)]


def _heads_title(ds: xr.Dataset, sel: core.Selection, number: int | None) -> str:
    mask = core.mask_mode(ds, sel)
    sample = _number(sel, number)
    return f"sample {sample}: every head, {core.stage_label(ds, sel.stage)} (mask {mask})"


def _number(sel: core.Selection, number: int | None) -> int:
    return sel.sample if number is None else number

"""Figures for papers: a view of the page written as SVG, PDF or PNG, offline.

Each figure is drawn from the numbers the page draws for the same state (the same
functions of :mod:`attnpanel.readouts.core` and :mod:`attnpanel.render.model_views`, at
full resolution, no rasterizing), as a HoloViews element rendered by its matplotlib
backend: vector output (SVG, PDF) with its title, axis labels, colour bar and clock or
token ticks, sized for one column of a two-column paper (3.4 in wide, 8 pt text). Bokeh's
own SVG and PNG export needs a browser driver; matplotlib writes all three formats from
the process itself.

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

import holoviews as hv
import holoviews.plotting.mpl  # noqa: F401 - the matplotlib backend: its options, its renderer
import matplotlib
import numpy as np
import xarray as xr

from attnpanel.readouts import core
from attnpanel.render import importance_views, model_views
from attnpanel.render.importance_views import CLICK_WORDS
from attnpanel.traces.schema import FIGURE_VIEWS, HEAD_SCALES
from attnpanel.util.files import write_safely

FIGURE_FORMATS = {".svg": "svg", ".pdf": "pdf", ".png": "png"}
COLUMN_INCHES = 3.4  # one column of a two-column paper
PAGE_INCHES = 7.0  # both columns (the heads figure)
HEADS_PER_ROW = 4
SMALL_TICKS = 3  # clock or token ticks along a head's map
FONT_PT = 8
TICKS = 6  # clock or token ticks along a map's axis
DPI = 300  # a PNG's resolution


def matrix(ds: xr.Dataset, sel: core.Selection) -> hv.Image:
    """The large matrix of the page for ``sel``: keys across, queries down."""
    values = np.asarray(core.attention_values(ds, sel), dtype=np.float32)
    title = core.matrix_title(ds, sel)
    return _map(values, title, core.STAGE_LABELS[sel.stage], _ticks(ds, sel.sample))


def heads(ds: xr.Dataset, sel: core.Selection, scale: str = "own") -> hv.Layout:
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
    label = core.STAGE_LABELS[sel.stage]
    ticks = _ticks(ds, sel.sample, count=SMALL_TICKS)
    shared = _limits(np.stack(every)) if scale == "shared" else None
    maps = []
    for index, (head, values) in enumerate(zip(names, every, strict=True)):
        element = _map(values, f"head {head}", label, ticks, small=True)
        bar = shared is None or index == len(every) - 1
        # the axis names once, on the left and at the bottom; the bars' name is the title's
        labels = {"ylabel": "" if index % HEADS_PER_ROW else "query"}
        labels["xlabel"] = "key" if index >= len(every) - HEADS_PER_ROW else ""
        limits = shared or _limits(values)
        maps.append(
            element.opts(backend="matplotlib", clim=limits, colorbar=bar, clabel=" ", **labels)
        )
    if shared is None:
        said = "each head on its own colour scale"
    else:
        said = f"one colour scale for every head, {shared[0]:.3g} to {shared[1]:.3g}"
    return (
        hv.Layout(maps)
        .cols(HEADS_PER_ROW)
        .opts(
            hv.opts.Layout(
                backend="matplotlib",
                title=f"{_heads_title(ds, sel)}; {said}",
                fontsize={"title": FONT_PT},
                sublabel_format="",  # each map says its head
                fig_inches=PAGE_INCHES / HEADS_PER_ROW,  # (a layout's: each map's)
                hspace=0.9,
                vspace=0.45,
            )
        )
    )


def _limits(values: np.ndarray) -> tuple[float, float]:
    """The colour scale of ``values``: their finite range (a constant map: around it)."""
    low, high = (float(f(values)) for f in (np.nanmin, np.nanmax))
    return (low, high) if high > low else (low - 0.5, high + 0.5)


def model(ds: xr.Dataset, sel: core.Selection) -> hv.Image:
    """Every layer x head map of one sample (a trace of one layer: its heads, one row)."""
    mosaic = model_views.model_mosaic(ds, sel)
    n_layers, n_heads = mosaic.attrs["n_layers"], mosaic.attrs["n_heads"]
    element = hv.Image(
        mosaic.values[::-1],
        bounds=(-0.5, -0.5, n_heads - 0.5, n_layers - 0.5),
        kdims=["head", "layer"],
        vdims=[hv.Dimension("weight", label="softmax weights")],
    )
    layers = np.atleast_1d(ds["layer"].values) if "layer" in ds.coords else [0]
    names = [core.layer_label(n) for n in layers]
    every = "every layer and head" if n_layers > 1 else f"every head of {names[0]}"
    return element.opts(
        backend="matplotlib",
        title=f"sample {sel.sample}: {every} (keys across, queries down)",
        xticks=[(h, str(h)) for h in range(n_heads)],
        yticks=list(enumerate(names)),
        invert_yaxis=True,
        **_style(),
    )


def importance(ranking: xr.DataArray) -> hv.Image:
    """A head ranking's map: layer (rows) x head, each head's importance."""
    raster = importance_views.importance_map(ranking)
    rows, cols = raster.values.shape
    element = hv.Image(
        raster.values[::-1],
        bounds=raster.bounds,
        kdims=["head", "layer"],
        vdims=[hv.Dimension("importance", label=raster.value_label)],
    )
    return element.opts(
        backend="matplotlib",
        title=" ".join(raster.label.split()).replace(CLICK_WORDS, "").strip(),
        xticks=[(h, str(h)) for h in range(cols)],
        yticks=importance_views.layer_ticks(ranking["layer"].values),
        invert_yaxis=True,
        **_style(),
    )


def view_of(
    view: str, ds: xr.Dataset, sel: core.Selection, stacked=None, ranking=None, scale="own"
):
    """The figure ``view`` (``FIGURE_VIEWS``) of the trace ``ds`` (one layer) for ``sel``;
    ``stacked``: the capture of every layer (the model view); ``ranking``: a head ranking
    (the importance map); ``scale``: the heads' colour scales (:func:`heads`)."""
    if view == "matrix":
        return matrix(ds, sel)
    if view == "heads":
        return heads(ds, sel, scale)
    if view == "model":  # a trace of one layer: that layer's heads
        return model(ds if stacked is None else stacked, sel)
    if view == "importance":
        if ranking is None:
            raise ValueError(
                "the importance map needs a head ranking: the model at hand, or a ranking file "
                "(attnpanel importance ... -o ranking.nc; attnpanel figure ranking.nc)"
            )
        return importance(ranking)
    raise ValueError(f"view {view!r}: one of {', '.join(FIGURE_VIEWS)}")


def write_figure(element, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``element`` as the figure ``path`` names (``.svg``, ``.pdf`` or ``.png``)."""
    path = Path(path)
    kind = FIGURE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: a figure is written as .svg, .pdf or .png, not {path.suffix!r}")

    def render(target: Path) -> None:
        rendered(element, kind).savefig(target, format=kind, dpi=DPI, bbox_inches="tight")

    return write_safely(path, kind, render, overwrite)


def rendered(element, kind: str = "png"):
    """``element`` drawn by HoloViews' matplotlib backend: a ``matplotlib.figure.Figure``."""
    matplotlib.use("Agg")  # no screen: the figure is only written
    return hv.renderer("matplotlib").instance(fig=kind, dpi=DPI).get_plot(element).state


def data_of(element) -> np.ndarray:
    """The numbers a figure draws, rows by query (or layer) from the top: to compare with
    the page's."""
    return (
        np.asarray(element.data)[::-1]
        if isinstance(element, hv.Image)
        else np.stack([np.asarray(e.data)[::-1] for e in element])
    )


def _map(values, title: str, value_label: str, ticks, small: bool = False) -> hv.Image:
    length, keys = values.shape
    element = hv.Image(
        values[::-1],  # rows by ascending y; the y axis is inverted: query 0 on top
        bounds=(-0.5, -0.5, keys - 0.5, length - 0.5),
        kdims=["key", "query"],
        vdims=[hv.Dimension("value", label=value_label)],
    )
    style = _style(small)
    if ticks is not None:
        style.update(xticks=ticks, yticks=ticks, xrotation=90)
    return element.opts(backend="matplotlib", title=title, invert_yaxis=True, **style)


def _style(small: bool = False) -> dict:
    inches = PAGE_INCHES / HEADS_PER_ROW if small else COLUMN_INCHES
    text = FONT_PT - 2 if small else FONT_PT
    return dict(
        cmap="viridis",
        colorbar=not small,
        fig_inches=inches,
        fontsize={"title": text, "labels": text, "ticks": text - 1, "cticks": text - 1},
        aspect="equal",
    )


def _ticks(ds: xr.Dataset, sample: int, count: int = TICKS) -> list[tuple[int, str]] | None:
    """A map's axis ticks, about ``count``: clock times (``time``) or tokens, else None
    (positions, matplotlib's own ticks)."""
    labels = core.clock_labels(ds, sample)
    if labels is None:
        tokens = model_views.tokens(ds, sample)
        labels = None if tokens is None else list(tokens)
    if labels is None:
        return None
    step = max(1, int(np.ceil(len(labels) / count)))
    return [(i, labels[i]) for i in range(0, len(labels), step)]


def _heads_title(ds: xr.Dataset, sel: core.Selection) -> str:
    mask = core.mask_mode(ds, sel)
    return f"sample {sel.sample}: every head, {core.STAGE_LABELS[sel.stage]} (mask {mask})"

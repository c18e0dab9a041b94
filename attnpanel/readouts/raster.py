"""Regridding a map to the pixels of its plot, by windows, with one colour-limit rule.

A map is a ``(rows, cols)`` array of cells centred on whole positions. What a plot shows
is a *window* of it (the whole map, or the zoomed part): :func:`window_raster` cuts the
window's cells (snapped outwards to whole cells) and regrids them with datashader to the
plot's pixels, never finer than the cells, so nothing is invented; a window holding no
more cells than pixels is the cells themselves. :func:`image_limits` is the one colour
rule every map follows. numpy and datashader only.
"""

from __future__ import annotations

import math

import datashader as dsh
import numpy as np
import xarray as xr


def raster_values(
    values: np.ndarray, bounds, width: int, height: int, x_range=None, y_range=None, agg="mean"
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Regrid a cell-centred grid to at most ``width x height`` pixels with datashader.

    Every cell of the full array contributes (``agg``, ``mean`` or ``max``, when several
    cells share a pixel); the grid is never finer than the data over the range, so
    nothing is invented.

    Parameters
    ----------
    values : numpy.ndarray
        ``(rows, cols)`` with rows by ascending y.
    bounds : tuple of float
        ``(left, bottom, right, top)`` of the grid.
    width, height : int
        Pixel size of the plot frame.
    x_range, y_range : tuple of float, optional
        The visible window; defaults to the whole grid.

    Returns
    -------
    raster : numpy.ndarray
        float32, rows by ascending y.
    bounds : tuple of float
        ``(left, bottom, right, top)`` of the raster.
    """
    n_rows, n_cols = values.shape
    x0, y0, x1, y1 = bounds
    x_range = (x0, x1) if x_range is None else tuple(sorted(x_range))
    y_range = (y0, y1) if y_range is None else tuple(sorted(y_range))
    cell_x, cell_y = (x1 - x0) / n_cols, (y1 - y0) / n_rows
    grid = xr.DataArray(
        values,
        coords={
            "y": y0 + cell_y * (0.5 + np.arange(n_rows)),
            "x": x0 + cell_x * (0.5 + np.arange(n_cols)),
        },
        dims=("y", "x"),
    )
    cols = max(1, min(int(width), int(np.ceil((x_range[1] - x_range[0]) / cell_x))))
    rows = max(1, min(int(height), int(np.ceil((y_range[1] - y_range[0]) / cell_y))))
    window = (x_range[0], y_range[0], x_range[1], y_range[1])
    if n_rows == 1 or n_cols == 1:
        # datashader infers a grid's cell size from its coordinates, which one row or
        # column does not give (a one-position trace); every pixel then shows its cell.
        return nearest_cells(values, bounds, window, rows, cols), window
    canvas = dsh.Canvas(plot_width=cols, plot_height=rows, x_range=x_range, y_range=y_range)
    raster = canvas.raster(grid, agg=agg)
    return np.asarray(raster.values, dtype=np.float32), window


def nearest_cells(values: np.ndarray, bounds, window, rows: int, cols: int) -> np.ndarray:
    """``rows x cols`` pixels over ``window``, each the grid cell under its centre (NaN off it)."""
    x0, y0, x1, y1 = bounds
    left, bottom, right, top = window

    def cells(low, high, start, stop, count, pixels):
        centres = low + (high - low) * (np.arange(pixels) + 0.5) / pixels
        index = np.floor((centres - start) / ((stop - start) / count)).astype(np.int64)
        return index, (index >= 0) & (index < count)

    row, row_in = cells(bottom, top, y0, y1, values.shape[0], rows)
    col, col_in = cells(left, right, x0, x1, values.shape[1], cols)
    out = np.full((rows, cols), np.nan, dtype=np.float32)
    out[np.ix_(row_in, col_in)] = values[np.ix_(row[row_in], col[col_in])]
    return out


COLOR_TOP_PERCENTILE = 99.5  # top of every map's colour scale


def color_limits(values: np.ndarray, floor: float | None = None) -> tuple[float, float]:
    """The colour scale of a map: its minimum (or ``floor``) to its 99.5th percentile.

    A few sharp cells (a first query's weight of 1 under a causal mask) must not flatten
    the rest of the map; hover still shows exact values, heavier cells take the top colour.
    """
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return (0.0, 1.0)
    low = float(finite.min()) if floor is None else floor
    high = float(np.percentile(finite, COLOR_TOP_PERCENTILE))
    if high <= low:
        high = float(finite.max())
    return (low, high if high > low else low + 1e-9)


def image_limits(values: np.ndarray, centred: bool = False) -> tuple[float, float]:
    """The colour scale of a drawn map, the one rule every map, render and update follows.

    A map of values >= 0 (weights) runs from 0 to its 99.5th percentile, so that 0 always
    has the lowest colour and maps compare; a map with negative values (raw or scaled
    scores, weight matrices) is centred on 0, so that a diverging colormap's middle colour
    means 0, out to the 99.5th percentile of its magnitude. ``centred``: a signed map by
    nature (a difference ``b - a``) is centred on 0 even where the values shown happen to
    have one sign (a zoomed window, two equal maps). :func:`scale_title` states the rule in
    a colour bar's title.
    """
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return (-1.0, 1.0) if centred else (0.0, 1.0)
    if centred or float(finite.min()) < 0:  # signed: centred on 0
        magnitude = np.abs(finite)
        reach = float(np.percentile(magnitude, COLOR_TOP_PERCENTILE)) or float(magnitude.max())
        return (-reach, reach) if reach > 0 else (-1e-9, 1e-9)
    return color_limits(finite, 0.0)


def scale_title(label: str, low: float) -> str:
    """A colour bar's title: what the map shows and the colour rule its scale follows."""
    rule = (
        f"±p{COLOR_TOP_PERCENTILE:g} of |value|" if low < 0 else f"0 to p{COLOR_TOP_PERCENTILE:g}"
    )
    return f"{label} ({rule})" if label else rule


def snap_window(bounds, shape, width: int, height: int, x_range, y_range):
    """The part of a visible window to rasterize, snapped outwards to whole cells.

    Parameters
    ----------
    bounds : tuple of float
        ``(left, bottom, right, top)`` of the full grid.
    shape : tuple of int
        ``(rows, cols)`` of the grid.
    width, height : int
        Pixel size of the plot frame (for the whole visible window).
    x_range, y_range : tuple of float
        The visible window (either order: an inverted axis has ``start > end``).

    Returns
    -------
    tuple or None
        ``(width, height, x_range, y_range)`` to pass to ``views.raster_values``: the
        window clipped to the grid and widened to cell edges, with the pixel size scaled to
        the part of the frame it covers; ``None`` when no cell is visible.
    """
    left, bottom, right, top = bounds
    rows, cols = shape
    cell_x, cell_y = (right - left) / cols, (top - bottom) / rows
    x0, x1 = sorted(float(v) for v in x_range)
    y0, y1 = sorted(float(v) for v in y_range)
    if x1 <= x0 or y1 <= y0:
        return None
    # Whole cells, so that a window holding fewer cells than pixels shows the cells exactly.
    sx0 = left + cell_x * math.floor(round((max(x0, left) - left) / cell_x, 6))
    sx1 = left + cell_x * math.ceil(round((min(x1, right) - left) / cell_x, 6))
    sy0 = bottom + cell_y * math.floor(round((max(y0, bottom) - bottom) / cell_y, 6))
    sy1 = bottom + cell_y * math.ceil(round((min(y1, top) - bottom) / cell_y, 6))
    if sx1 <= sx0 or sy1 <= sy0:
        return None
    px = max(1, round(width * (sx1 - sx0) / (x1 - x0)))
    py = max(1, round(height * (sy1 - sy0) / (y1 - y0)))
    return px, py, (sx0, sx1), (sy0, sy1)


def window_raster(
    values, width: int, height: int, window: tuple | None = None
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """The pixels a plot of ``width x height`` shows of a map, for its visible window.

    Parameters
    ----------
    values : numpy.ndarray or map source
        ``(rows, cols)`` map with rows by ascending y, cells centred on whole positions;
        or a map too large to hold, an object with ``shape`` and ``raster(width, height,
        window)`` answering this function's question itself
        (:class:`attnpanel.readouts.windows.VirtualMap`).
    width, height : int
        Pixel size of the plot frame.
    window : tuple, optional
        ``((x0, x1), (y0, y1))`` visible (either order); the whole map when None.

    Returns
    -------
    raster : numpy.ndarray
        float32, rows by ascending y: the window's cells themselves when they are no more
        than the pixels, else datashader's mean per pixel (:func:`raster_values`).
    bounds : tuple of float
        ``(left, bottom, right, top)`` of the raster.
    """
    if not isinstance(values, np.ndarray):
        return values.raster(width, height, window)
    rows, cols = values.shape
    bounds = (-0.5, -0.5, cols - 0.5, rows - 0.5)
    snapped = None if window is None else snap_window(bounds, values.shape, width, height, *window)
    if snapped is None:
        return raster_values(values, bounds, width, height)
    width, height, (x0, x1), (y0, y1) = snapped
    # A contiguous block: datashader's kernel for a strided slice of the full array is
    # a second numba specialization (1.3 s to compile on the first zoom).
    block = np.ascontiguousarray(
        values[round(y0 + 0.5) : round(y1 + 0.5), round(x0 + 0.5) : round(x1 + 0.5)]
    )
    if block.shape[0] <= height and block.shape[1] <= width:
        # No more cells than pixels: datashader would return the cells themselves
        # (raster_values never upsamples), so skip its ~3-5 ms per map.
        return block.astype(np.float32, copy=False), (x0, y0, x1, y1)
    return raster_values(block, (x0, y0, x1, y1), width, height)

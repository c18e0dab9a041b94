"""The pixels of any window of a virtual trace's map, and the one row a query click needs.

A virtual trace (:mod:`attnpanel.traces.virtual`) at L = 65,536 holds 4.3 G cells per head: no
view can hold its map. A :class:`VirtualMap` is what a view holds instead: it answers
:meth:`VirtualMap.raster` for the window a plot shows, with the same contract as
:func:`attnpanel.readouts.raster.window_raster` on a dense array (rows by ascending query, the
raster's bounds), from the cheapest source that is exact at the plot's pixels:

- a window holding at most :data:`EXACT_CELLS` cells is computed from ``q``, ``k`` and
  each row's ``lse``: its cells themselves where they are no more than the pixels
  (:func:`attnpanel.traces.virtual.window`), else each pixel's maximum over its cells in one
  streaming pass (:func:`attnpanel.kernels.tiles.overview` of the window);
- a larger window (the whole map) is cut from the stored overview
  (:class:`attnpanel.traces.overviews.Overviews`): each of its pixels is the exact maximum of a
  block of ``L / 480`` cells square, so the window shows those blocks, coarser than the
  screen, until it is zoomed under :data:`EXACT_CELLS`.

Maps show each pixel's **maximum** weight (a single sharp key is never averaged away);
cells the mask blocks in a whole pixel are NaN (drawn apart from the colour scale).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels import masks, tiles
from attnpanel.readouts.raster import raster_values, snap_window
from attnpanel.traces import virtual
from attnpanel.traces.overviews import PIXELS, Entry, Overviews
from attnpanel.traces.stages import normaliser

# A 480 x 480 map computes windows of up to 4,096 x 4,096 cells from q and k at once (about
# 0.2 s on two cores); a smaller plot, its share of that (a 140 px head tile ~1,200^2):
# larger windows are first cut from the overview, then refined.
EXACT_CELLS = 2**24
CURVE_BINS = 1600  # pixel columns a long curve is cut to (min and max of each), page and export
EXACT_PIXELS = 480 * 480
TOP_KEYS = 10  # the keys a query click lists


@dataclass(frozen=True)
class VirtualMap:
    """The softmax weights of one sample and head of a virtual trace, by window.

    Parameters
    ----------
    ds : xarray.Dataset
        One layer of a virtual trace.
    overviews : attnpanel.traces.overviews.Overviews
        Where the whole map's overview is read (or computed once and kept).
    sample, head : int
        Which map.
    mask : str
        The mask mode (the trace's own or another, recomputed from ``q`` and ``k``).
    lse : torch.Tensor or callable
        Each row's log-sum-exp under ``mask``, ``(1, H, L)`` float64
        (:func:`attnpanel.traces.virtual.row_lse` of the sample), or a function that gives it:
        called only for a window computed from q and k (the stored overview needs none,
        so another mask's whole map shows without its pass of the fused kernel).
    layer : int, optional
        The layer's index in a stacked trace (the overview's key).
    qk : SampleQK, optional
        The sample's ``q`` and ``k`` (:func:`sample_qk`); cut from the trace when None.
    exact : bool
        Compute a window of any size from ``q`` and ``k`` (each pixel the maximum of its
        own cells), where the stored overview's blocks would be coarser than the pixels:
        the refinement :meth:`refined` gives, seconds for the largest windows.
    """

    ds: xr.Dataset
    overviews: Overviews
    sample: int
    head: int
    mask: str
    lse: torch.Tensor | Callable[[], torch.Tensor]
    layer: int | None = None
    qk: SampleQK | None = None
    exact: bool = False  # a window of any size computed from q and k (seconds at 30,000^2)

    def row_lse(self) -> torch.Tensor:
        """Each row's log-sum-exp under the map's mask, ``(1, H, L)``."""
        return self.lse() if callable(self.lse) else self.lse

    def sample_qk(self) -> SampleQK:
        """The sample's ``q`` and ``k``."""
        return self.qk or sample_qk(self.ds, self.sample)

    @property
    def shape(self) -> tuple[int, int]:
        """``(queries, keys)`` of the whole map."""
        return self.ds.sizes["query"], self.ds.sizes["key"]

    @property
    def entry(self) -> Entry:
        """The whole map's overview entry."""
        return Entry(self.sample, self.head, self.mask, self.layer)

    def raster(self, width: int, height: int, window: tuple | None = None):
        """The pixels a plot of ``width x height`` shows of ``window``.

        Parameters
        ----------
        width, height : int
            Pixel size of the plot frame.
        window : tuple, optional
            ``((x0, x1), (y0, y1))`` visible, in key and query positions (either order);
            the whole map when None.

        Returns
        -------
        raster : numpy.ndarray
            float32, rows by ascending query; each pixel the maximum weight of its cells,
            NaN where the mask blocks all of them.
        bounds : tuple of float
            ``(left, bottom, right, top)`` of the raster.
        """
        plan = self._plan(width, height, window)
        if plan[0] == "overview":
            return self._overview(*plan[1:])
        _, queries, keys, bounds, pixels = plan
        if pixels is None:
            return self.cells(queries, keys), bounds
        return self._reduce(queries, keys, pixels), bounds

    def _hide_padded(self, values: np.ndarray, queries: slice) -> np.ndarray:
        """``values`` with NaN on every pixel row whose queries are all padded: as on the
        dense page, a padded query's row holds nothing the model uses (a pixel row that
        also holds real queries keeps its maximum over all of them)."""
        padding = self._masking().key_padding
        if padding is None or not bool(padding.any()):
            return values
        padded = padding[0, queries].numpy()
        starts = tiles.pixel_starts(len(padded), values.shape[0])
        real = np.add.reduceat((~padded).astype(np.int64), starts) if len(padded) else []
        values[np.asarray(real) == 0] = np.nan
        return values

    def refined(self, width: int, height: int, window: tuple | None = None):
        """This map computed exactly for ``window``, or None where :meth:`raster` already
        is: a window over :func:`exact_limit` cells whose stored overview blocks are more
        than twice as coarse as its pixels (at L = 64,800, windows of 4,097 to ~32,000
        positions: their exact pixels take 0.1-3 s, so they are drawn after the overview's).
        """
        plan = self._plan(width, height, window)
        if self.exact or plan[0] != "overview" or window is None or plan[-1] == self._full():
            return None
        _, px, py, (x0, y0, x1, y1) = plan
        rows, cols = self.shape
        block_rows, block_cols = -(-rows // min(rows, PIXELS[0])), -(-cols // min(cols, PIXELS[1]))
        if block_rows <= 2 * (y1 - y0) / py and block_cols <= 2 * (x1 - x0) / px:
            return None  # the overview's blocks are about the window's pixels already
        return replace(self, exact=True)

    def _full(self) -> tuple:
        rows, cols = self.shape
        return (-0.5, -0.5, cols - 0.5, rows - 0.5)

    def describe(self, width: int, height: int, window: tuple | None = None) -> str:
        """What a pixel of :meth:`raster` holds, in words (for a title)."""
        plan = self._plan(width, height, window)
        if plan[0] == "overview":
            rows, cols = self.shape
            found = self.overviews.get(self.entry).max.shape
            per_row, per_col = -(-rows // found[0]), -(-cols // found[1])
            if per_row == per_col == 1:
                return "every cell"
            return f"max of ≤{per_row}x{per_col} cells/pixel (overview)"
        _, queries, keys, _, pixels = plan
        if pixels is None:
            return "every cell"
        n_rows, n_cols = queries.stop - queries.start, keys.stop - keys.start
        per_row, per_col = -(-n_rows // pixels[0]), -(-n_cols // pixels[1])
        return f"max of ≤{per_row}x{per_col} cells/pixel (this window)"

    def _plan(self, width: int, height: int, window):
        """Where the pixels of a window come from: ``("overview", width, height, bounds)``,
        or ``("window", queries, keys, bounds, pixels)`` (``pixels`` None: the cells)."""
        rows, cols = self.shape
        full = self._full()
        snapped = snap_window(full, (rows, cols), width, height, *window) if window else None
        if snapped is None:
            return ("overview", width, height, full)
        px, py, (x0, x1), (y0, y1) = snapped
        queries = slice(round(y0 + 0.5), round(y1 + 0.5))
        keys = slice(round(x0 + 0.5), round(x1 + 0.5))
        bounds = (x0, y0, x1, y1)
        cells = (queries.stop - queries.start) * (keys.stop - keys.start)
        if cells > exact_limit(width, height) and not self.exact:
            return ("overview", px, py, bounds)
        if queries.stop - queries.start <= py and keys.stop - keys.start <= px:
            return ("window", queries, keys, bounds, None)
        return ("window", queries, keys, bounds, (py, px))

    def cells(self, queries: slice, keys: slice) -> np.ndarray:
        """The exact weights of a window, float32, blocked cells NaN."""
        values = virtual.window(
            self.ds,
            self.sample,
            self.head,
            queries,
            keys,
            self.mask,
            self.row_lse(),
            self.sample_qk(),
        ).copy()
        blocked = self._masking().blocked(queries, keys)
        if blocked is not None:
            values[blocked.reshape(blocked.shape[-2:]).expand(values.shape).numpy()] = np.nan
        return self._hide_padded(values, queries)

    def _masking(self) -> masks.Masking:
        found = virtual.masking(self.ds, self.mask, self.sample)
        return tiles.sample_masking(found, 0, 0)

    def _reduce(self, queries: slice, keys: slice, pixels: tuple[int, int]) -> np.ndarray:
        q, k = self.sample_qk()
        one = slice(self.head, self.head + 1)
        found = tiles.overview(
            q[:, one],
            k[:, one],
            self.row_lse()[:, one],
            self._masking(),
            float(self.ds.attrs["scale"]),
            pixels=pixels,
            window=(queries, keys),
        )
        return self._hide_padded(_shown(found.max[0, 0], found.blocked[0, 0]), queries)

    def _overview(self, width: int, height: int, bounds: tuple):
        """The stored overview's pixels over ``bounds``, regridded by maximum to at most
        ``width x height`` (never finer than the overview)."""
        found = self.overviews.get(self.entry)
        rows, cols = self.shape
        values = self._hide_padded(_shown(found.max, found.blocked), slice(0, rows))
        n_rows, n_cols = values.shape
        left, bottom, right, top = bounds
        # pixel edges in cell coordinates: pixel c covers keys [starts[c], starts[c + 1])
        col_edges = np.append(tiles.pixel_starts(cols, n_cols), cols) - 0.5
        row_edges = np.append(tiles.pixel_starts(rows, n_rows), rows) - 0.5
        c0 = max(0, int(np.searchsorted(col_edges, left, "right")) - 1)
        c1 = min(n_cols, int(np.searchsorted(col_edges, right, "left")))
        r0 = max(0, int(np.searchsorted(row_edges, bottom, "right")) - 1)
        r1 = min(n_rows, int(np.searchsorted(row_edges, top, "left")))
        block = np.ascontiguousarray(values[r0:r1, c0:c1])
        edges = (col_edges[c0], row_edges[r0], col_edges[c1], row_edges[r1])
        if block.shape[0] <= height and block.shape[1] <= width:
            return block, edges
        return raster_values(block, edges, width, height, agg="max")


def exact_limit(width: int, height: int) -> float:
    """The most cells a plot of ``width x height`` pixels computes from q and k at once:
    :data:`EXACT_CELLS` for a 480 x 480 map, a smaller plot its share of it."""
    return EXACT_CELLS * min(1.0, width * height / EXACT_PIXELS)


def _shown(peak: np.ndarray, blocked: np.ndarray) -> np.ndarray:
    """Pixel maxima as a map draws them: NaN where every cell is blocked."""
    values = np.array(peak, dtype=np.float32)
    values[np.asarray(blocked) >= 1] = np.nan
    return values


def softmax_only(ds: xr.Dataset, what: str) -> None:
    """Refuse, by name, to recompute ``what`` as a softmax of q and k for a trace whose
    weights another normaliser formed (a linear attention's: always held dense)."""
    if normaliser(ds) != "softmax":
        raise ValueError(
            f"{what} is recomputed as a softmax; this trace's weights are formed by "
            f"{normaliser(ds)!r}: read its stored weights"
        )


def query_row(
    ds: xr.Dataset, sample: int, head: int, query: int, mask: str, qk: SampleQK | None = None
) -> np.ndarray:
    """The selected query's softmax weights over every key, float32: its one row of
    logits from ``q`` and ``k`` (blocked keys filled as the model fills them), softmaxed
    in float64. ``S`` cells and no row statistics: 50-90 ms at S = 64,800 under any mask.
    ``qk``: the sample's (:func:`sample_qk`), cut from the trace when None. A linear
    attention's (its rows divided by their sums) is refused: it is always held dense."""
    softmax_only(ds, "a query's row")
    q, k = qk or sample_qk(ds, sample)
    one = slice(head, head + 1)
    masking = tiles.sample_masking(virtual.masking(ds, mask, sample), 0, 0)
    logits, _ = tiles.logits_tile(
        q[:, one].double(),
        k[:, one].double(),
        masking,
        float(ds.attrs["scale"]),
        slice(query, query + 1),
        slice(0, k.shape[2]),
    )
    return torch.softmax(logits, dim=-1)[0, 0, 0].float().numpy()


def top_keys(row: np.ndarray, count: int = TOP_KEYS) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` heaviest keys of a row, heaviest first, and their weights."""
    count = min(count, row.size)
    found = np.argpartition(row, row.size - count)[-count:]
    found = found[np.argsort(-row[found], kind="stable")]
    return found, row[found]


def envelope(xs: np.ndarray, ys: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """A curve of many points cut to ``bins`` bins, each drawn by its minimum and maximum
    in their order (``2 x bins`` points): at the plot's width it draws the same line as
    every point, so no peak is lost; a curve of at most ``2 x bins`` points is kept."""
    n = len(ys)
    if n <= 2 * bins:
        return xs, ys
    starts = tiles.pixel_starts(n, bins)
    values = np.asarray(ys, dtype=np.float64)
    finite = np.isfinite(values)
    index = np.arange(n)
    widths = np.diff(np.append(starts, n))
    at = []
    for reduce, missing in ((np.maximum, -np.inf), (np.minimum, np.inf)):
        filled = np.where(finite, values, missing)
        extreme = np.repeat(reduce.reduceat(filled, starts), widths)
        at.append(_first_at(filled, extreme, index, starts))
    at_high, at_low = at
    first = np.minimum(at_high, at_low)
    second = np.maximum(at_high, at_low)
    picks = np.stack([first, second], axis=1).ravel()
    return xs[picks], np.asarray(ys)[picks]


def _first_at(values, target, index, starts) -> np.ndarray:
    """Per bin, the first index whose value equals the bin's target (or the bin's start)."""
    hit = np.where(values == target, index, len(values))
    found = np.minimum.reduceat(hit, starts)
    return np.where(found < len(values), found, starts)


class SampleQK(NamedTuple):
    """One sample's ``q`` ``(1, H, L, E)`` and ``k`` ``(1, H, S, E)`` (:func:`virtual.qk`)."""

    q: torch.Tensor
    k: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held (what a :class:`attnpanel.readouts.core.StageCache` counts)."""
        return sum(t.element_size() * t.nelement() for t in self)


def sample_qk(ds: xr.Dataset, sample: int, cache=None, layer: int = 0) -> SampleQK:
    """The ``q`` and ``k`` of one sample, cut from the trace once (kept in ``cache``, a
    :class:`attnpanel.readouts.core.StageCache`, when given): cutting them takes 10-90 ms at
    L = 64,800, and a linked zoom reads them for nine maps."""

    def compute():
        return SampleQK(*virtual.qk(ds, sample))

    if cache is None:
        return compute()
    return cache.get(("qk", layer, sample), compute)


def sample_row_lse(
    ds: xr.Dataset, sample: int, mask: str, cache=None, layer: int = 0
) -> torch.Tensor:
    """Each row's ``lse`` of one sample under ``mask``, ``(1, H, L)`` float64: the trace's
    own for its mode, else one pass of the fused kernel (kept in ``cache``, a
    :class:`attnpanel.readouts.core.StageCache`, when given)."""

    def compute():
        return virtual.row_lse(ds, mask, sample)

    if cache is None:
        return compute()
    return cache.get(("lse", layer, sample, mask), compute)


def live_rows(masking: masks.Masking, queries: slice, keys: int) -> np.ndarray:
    """Which of the rows ``queries`` have an unblocked key (their weights sum to 1; a row
    whose every key is blocked is all zeros), from the mask's structure alone."""
    rows = np.arange(queries.start, queries.stop)
    padding = masking.key_padding
    open_keys = np.ones(keys, dtype=bool) if padding is None else ~padding[0].numpy()
    if masking.mode == "causal":
        count = np.cumsum(open_keys)[np.minimum(rows, keys - 1)]
    else:
        count = np.full(rows.size, open_keys.sum())
        if masking.mode == "diagonal":
            count = count - open_keys[np.minimum(rows, keys - 1)] * (rows < keys)
    return count > 0


def streamed_mass_share(
    ds: xr.Dataset,
    sample: int,
    heads,
    mask: str,
    lse: torch.Tensor,
    queries: slice,
    keys: slice,
    qk: SampleQK | None = None,
) -> np.ndarray:
    """Per head, the share of the attention of the rows ``queries`` that falls on the
    ``keys``: the box's weights summed exactly in one streaming pass (its cells only), over
    the number of its rows with an unblocked key (each such row's weights sum to 1).
    ``qk``: the sample's (:func:`sample_qk`), cut from the trace when None. A linear
    attention's (its rows divided by their sums) is refused: it is always held dense."""
    softmax_only(ds, "a box's attention mass")
    q, k = qk or sample_qk(ds, sample)
    masking = tiles.sample_masking(virtual.masking(ds, mask, sample), 0, 0)
    live = int(live_rows(masking, queries, ds.sizes["key"]).sum())
    cells = (queries.stop - queries.start) * (keys.stop - keys.start)
    shares = np.zeros(len(heads))
    for i, head in enumerate(heads):
        one = slice(head, head + 1)
        found = tiles.overview(
            q[:, one],
            k[:, one],
            lse[:, one],
            masking,
            float(ds.attrs["scale"]),
            pixels=(1, 1),
            window=(queries, keys),
        )
        shares[i] = float(found.mean[0, 0, 0, 0]) * cells / live if live else 0.0
    return shares

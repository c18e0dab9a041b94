"""The maps a standalone HTML export stores: one sample's heads at display resolution,
quantised to 8 bits and zlib-compressed, under each mask shown.

A dense trace's maps are reduced by datashader (each pixel the mean of its cells). A
virtual trace (:mod:`attnpanel.traces.virtual`) has no map to reduce: each head's map is its
overview (:class:`attnpanel.traces.overviews.Overviews`: each pixel the *maximum* weight of
its cells, as the long explorer draws it, so a single sharp key is never averaged away).
The page (:mod:`attnpanel.render.export_page`) inflates a map with the browser's own
``DecompressionStream`` when a widget asks for it.
"""

from __future__ import annotations

import base64
import zlib

import datashader
import numpy as np
import xarray as xr

from attnpanel.kernels import tiles
from attnpanel.readouts.raster import image_limits
from attnpanel.traces import virtual
from attnpanel.traces.overviews import PIXELS, Entry, Overviews
from attnpanel.traces.stages import attention_stage, mask_options, masked_cells

LEVELS = 254  # quantisation levels for visible cells; 255 marks a masked cell (black)
MASKED = 255
MASKED_SHARE = 0.4  # a reduced cell is drawn masked from this share of masked area
DISPLAY = 400  # frame of the large map, in pixels: the stored resolution
# a virtual trace's maps: its overviews' side (what the explorer and `attnpanel overviews`
# store), so that a stored trace exports without computing a map
OVERVIEW_DISPLAY = PIXELS[0]


def map_palette(n: int = LEVELS + 1) -> list[str]:
    """Blue (low) to red (high), as the explorer draws attention."""
    from bokeh.palettes import interp_palette

    return list(interp_palette(("#2b3a8c", "#4a90d9", "#f7f7f7", "#f4a05a", "#b2182b"), n))


def display_resolution(weights: xr.DataArray, size: int) -> np.ndarray:
    """Reduce a ``(query, key)`` map to at most ``size`` x ``size`` cells.

    Masked cells must be NaN. A display cell holds the mean of its visible cells, and is
    masked (NaN) when at least ``MASKED_SHARE`` of its area is masked: a masked diagonal
    stays a visible black line as long as a pixel covers no more than about 2.5 positions,
    and the picture does not darken a whole band of pixels around it.
    """
    length = weights.sizes["query"]
    if length <= size:
        return np.asarray(weights.values, dtype=np.float32)
    canvas = datashader.Canvas(
        plot_width=size,
        plot_height=size,
        x_range=(-0.5, length - 0.5),
        y_range=(-0.5, length - 0.5),
    )
    grid = weights.rename(query="y", key="x").astype(np.float64)
    reduced = np.asarray(canvas.raster(grid, agg="mean", downsample_method="mean").values)
    masked = grid.isnull().astype(np.float64)
    share = np.asarray(canvas.raster(masked, agg="mean", downsample_method="mean").values)
    reduced[share >= MASKED_SHARE] = np.nan
    return reduced.astype(np.float32)


def encode_map(values: np.ndarray, centred: bool = False) -> tuple[str, tuple[float, float]]:
    """Quantise a map to uint8 (255 = masked), zlib + base64 encoded, with its (low, top).

    ``centred``: a signed map (a difference) whose scale is centred on 0 (``image_limits``).
    """
    # the explorer's one colour rule: weights from 0 to their 99.5th percentile (a few sharp
    # cells must not push the rest of the map into one colour)
    low, top = image_limits(values, centred)
    scaled = np.clip(np.round((np.nan_to_num(values) - low) / (top - low) * LEVELS), 0, LEVELS)
    levels = np.where(np.isnan(values), MASKED, scaled)
    raw = levels.astype(np.uint8).tobytes()
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii"), (low, top)


def shown_masks(ds: xr.Dataset, masks: list[str] | None = None) -> list[str]:
    """The mask modes an export shows: ``masks`` (checked), else every mode the trace can
    be shown under for a dense trace, and only its own for a virtual one (another mode
    costs a pass over every cell of each head's map).

    Raises
    ------
    ValueError
        Naming a mask the trace cannot be shown under, and those it can.
    """
    options = mask_options(ds)
    if masks is None:
        return [ds.attrs.get("mask", "none")] if virtual.is_virtual(ds) else options
    masks = list(dict.fromkeys(masks))
    if not masks:
        raise ValueError(f"no mask to export: give one or more of {', '.join(options)}")
    for mask in masks:
        if mask not in options:
            raise ValueError(
                f"mask {mask!r} is not one this trace can be shown under: {', '.join(options)}"
            )
    return masks


def export_maps(
    ds: xr.Dataset,
    sample: int = 0,
    size: int | None = None,
    masks: list[str] | None = None,
    overviews: Overviews | None = None,
    layer: int | None = None,
) -> dict:
    """Encoded softmax maps of one sample for every head under each mask shown.

    A dense trace's maps are reduced to ``size`` (default :data:`DISPLAY`) by the mean
    (:func:`display_resolution`); a virtual trace's are its overviews at ``size`` (default
    :data:`OVERVIEW_DISPLAY`), each pixel the maximum weight of its cells
    (:class:`OverviewMaps`). ``masks``, ``overviews`` and ``layer``: see
    :func:`export_html`.

    Returns
    -------
    dict
        ``{"n": cells per side, "length": L, "masks": [...], "maps": {mask: [b64, ...]},
        "scales": {mask: [(low, top), ...]}}``: each map's colour scale.
    """
    masks = shown_masks(ds, masks)
    if virtual.is_virtual(ds):
        size = OVERVIEW_DISPLAY if size is None else size
        return OverviewMaps(ds, sample, size, masks, overviews, layer).payload(size)
    size = DISPLAY if size is None else size
    maps, scales, n = {}, {}, None
    for mask in masks:
        maps[mask], scales[mask] = [], []
        for head in range(ds.sizes["head"]):
            weights = attention_stage(ds, "softmax", mask=mask, batch=sample, head=head)
            blocked = masked_cells(ds, mask, batch=sample, head=head)
            if blocked is not None:
                weights = weights.where(~xr.DataArray(blocked, dims=("query", "key")))
            values = display_resolution(weights, size)
            n = values.shape[0]
            encoded, scale = encode_map(values)
            maps[mask].append(encoded)
            scales[mask].append(scale)
    return {"n": n, "length": ds.sizes["query"], "masks": masks, "maps": maps, "scales": scales}


class OverviewMaps:
    """Each head's overview of one sample of a virtual trace under each mask shown, and
    the maps the export stores from them.

    A stored map holds each pixel's maximum weight, masked where at least
    :data:`MASKED_SHARE` of its cells are blocked. Query ``i`` lies in pixel row
    ``i * n // L`` (:func:`attnpanel.kernels.tiles.pixel_starts`). A smaller map is cut from the
    same overviews by whole blocks of ``m x m`` pixels: the maximum of their maxima, exact,
    and for a side ``n = side / m`` exactly the overview computed at ``n`` (its pixel
    ``r`` starts at ``ceil(r * L / n)``, as pixel ``m * r`` of the overview). Only when no
    divisor of the overview's side comes within half of the side asked for (a prime
    side) are overviews computed again, at that side.

    Parameters
    ----------
    ds : xarray.Dataset
        One layer of a virtual trace.
    sample : int
        Which batch item.
    size : int
        The overviews' side, in pixels (a shorter map keeps one cell per pixel).
    masks : list of str
        The mask modes.
    overviews : attnpanel.traces.overviews.Overviews, optional
        Where the overviews are read (and new ones stored); None computes them in memory.
    layer : int, optional
        The layer's index in the stacked trace that ``overviews`` holds.
    """

    def __init__(
        self,
        ds: xr.Dataset,
        sample: int,
        size: int,
        masks: list[str],
        overviews: Overviews | None = None,
        layer: int | None = None,
    ):
        if ds.sizes["query"] != ds.sizes["key"]:
            raise ValueError(
                f"the export draws square maps; this virtual trace has {ds.sizes['query']} "
                f"queries and {ds.sizes['key']} keys"
            )
        self.overviews = Overviews(ds) if overviews is None else overviews
        held = self.overviews.ds
        if ("layer" in held.dims) != (layer is not None):
            raise ValueError(
                "give the layer's index for overviews of a stacked trace, and only then: "
                f"these overviews hold {held.sizes.get('layer', 'no')} layers, layer={layer}"
            )
        for dim in ("batch", "head", "query", "key"):
            if held.sizes[dim] != ds.sizes[dim]:
                raise ValueError(
                    f"these overviews are of another trace: {held.sizes[dim]} {dim} "
                    f"positions, the trace {ds.sizes[dim]}"
                )
        self.sample, self.masks, self.layer = sample, masks, layer
        self.heads, self.length = ds.sizes["head"], ds.sizes["query"]
        self.found = self._read(size)

    def _read(self, size: int) -> dict[str, list[tiles.Overview]]:
        """Every head's overview at ``size`` under each mask (read, or computed and kept)."""
        return {
            mask: [
                self.overviews.get(Entry(self.sample, head, mask, self.layer, (size, size)))
                for head in range(self.heads)
            ]
            for mask in self.masks
        }

    @property
    def side(self) -> int:
        """The overviews' side in pixels."""
        return next(iter(self.found.values()))[0].max.shape[0]

    def payload(self, size: int) -> dict:
        """The encoded maps at the largest side up to ``size`` that whole blocks of the
        overviews give (see :func:`export_maps` for the fields)."""
        n = _largest_divisor(self.side, size)
        if 2 * n < min(size, self.length):
            self.found = self._read(size)
            n = self.side
        factor = self.side // n
        maps, scales = {}, {}
        for mask, heads in self.found.items():
            encoded = [encode_map(_coarsened(found, self.length, factor)) for found in heads]
            maps[mask] = [text for text, _ in encoded]
            scales[mask] = [scale for _, scale in encoded]
        return {"n": n, "length": self.length, "masks": self.masks, "maps": maps, "scales": scales}


def _largest_divisor(side: int, most: int) -> int:
    """The largest divisor of ``side`` that is at most ``most`` (1 at least)."""
    return max((d for d in range(1, min(side, most) + 1) if side % d == 0), default=1)


def _coarsened(found: tiles.Overview, length: int, factor: int) -> np.ndarray:
    """One overview's maxima over whole blocks of ``factor x factor`` pixels, float32, NaN
    (drawn masked) where at least :data:`MASKED_SHARE` of the block's cells are blocked."""
    side = found.max.shape[0]
    n = side // factor
    per_side = np.diff(np.append(tiles.pixel_starts(length, side), length))
    cells = np.outer(per_side, per_side).astype(np.float64)  # each pixel's cells
    # whole numbers of blocked cells: the float32 share times the cells, rounded
    blocked = np.rint(found.blocked.astype(np.float64) * cells)

    def blocks(values, reduce):  # (side, side) -> (n, n)
        return reduce(values.reshape(n, factor, n, factor), axis=(1, 3))

    values = blocks(found.max, np.max).astype(np.float32)
    values[blocks(blocked, np.sum) / blocks(cells, np.sum) >= MASKED_SHARE] = np.nan
    return values

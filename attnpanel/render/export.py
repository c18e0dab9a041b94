"""Standalone, offline HTML export of a trace's attention maps.

The file is one self-contained page built with Bokeh's inline resources: no script, style
sheet or image is fetched from anywhere. Every head of one sample is stored at display
resolution, quantised to 8 bits and zlib-compressed; the page inflates a map with the
browser's own ``DecompressionStream`` when a widget asks for it. So the file's size depends
on the display resolution, not on the square of the sequence length.

A dense trace's maps are reduced by datashader (each pixel the mean of its cells) under
every mask mode. A virtual trace (:mod:`attnpanel.traces.virtual`, L up to 65,536 and more) has
no map to reduce: each head's map is its overview (:class:`attnpanel.traces.overviews.Overviews`:
each pixel the *maximum* weight of its cells, as the long explorer draws it, so a single
sharp key is never averaged away), read from the stores beside the trace file where they
exist, under the trace's own mask unless others are asked for.
"""

from __future__ import annotations

import base64
import math
import zlib
from functools import partial
from html import escape
from pathlib import Path

import datashader
import numpy as np
import xarray as xr
from bokeh.embed import file_html
from bokeh.layouts import column, gridplot, row
from bokeh.models import (
    BoxAnnotation,
    ColorBar,
    ColumnDataSource,
    CustomJS,
    CustomJSHover,
    CustomJSTickFormatter,
    Div,
    HoverTool,
    LinearColorMapper,
    RadioButtonGroup,
    Range1d,
    Select,
    Slider,
    Span,
)
from bokeh.plotting import figure
from bokeh.resources import Resources

from attnpanel.kernels import tiles
from attnpanel.readouts.core import Selection, sequence_series
from attnpanel.readouts.raster import image_limits, scale_title
from attnpanel.readouts.windows import CURVE_BINS, envelope
from attnpanel.render.palette import HIGHLIGHT, curve_styles, head_color
from attnpanel.traces import virtual
from attnpanel.traces.overviews import PIXELS, Entry, Overviews
from attnpanel.traces.stages import attention_stage, mask_options, masked_cells
from attnpanel.util.files import check_target, write_safely


class _SelfContained(Resources):
    """Bokeh's inline resources without the script and style URLs of other libraries' models.

    Bokeh adds the ``__javascript__`` and ``__css__`` of every model class registered in the
    process, used or not; once panel is imported that includes relative URLs such as
    panel's ``es-module-shims``, which a file opened from disk cannot load. The export uses
    Bokeh models only, so those URLs are dropped.
    """

    def _collect_external_resources(self, resource_attr):
        return []

    def clone(self, *, components=None):
        return _SelfContained(
            mode="inline", components=components if components is not None else self.components
        )


LEVELS = 254  # quantisation levels for visible cells; 255 marks a masked cell (black)
MASKED = 255
MASKED_SHARE = 0.4  # a reduced cell is drawn masked from this share of masked area
SMALL = 120  # frame of each head's small map, in pixels
MAX_BYTES = 5_000_000  # the file's default size limit (5 MB)
# Each head is a small map of its own (about 6 KB of page before any map is stored); the
# largest models have 128 heads per layer.
MAX_HEADS = 256
DISPLAY = 400  # frame of the large map, in pixels: the stored resolution
# a virtual trace's maps: its overviews' side (what the explorer and `attnpanel overviews`
# store), so that a stored trace exports without computing a map
OVERVIEW_DISPLAY = PIXELS[0]


def _palette(n: int = LEVELS + 1) -> list[str]:
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


def _encode(values: np.ndarray) -> tuple[str, tuple[float, float]]:
    """Quantise a map to uint8 (255 = masked), zlib + base64 encoded, with its (low, top)."""
    # the explorer's one colour rule: weights from 0 to their 99.5th percentile (a few sharp
    # cells must not push the rest of the map into one colour)
    low, top = image_limits(values)
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
            encoded, scale = _encode(values)
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
            encoded = [_encode(_coarsened(found, self.length, factor)) for found in heads]
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


DECODE_JS = """
async function inflate(b64) {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
async function show() {
  const mask = masks[mask_widget.active];
  const head = parseInt(head_widget.value);
  const flats = await Promise.all(payload.maps[mask].map(inflate));
  // the sources hold (n, n) uint8 ndarrays: a new one of the same class and shape
  const fill = (source, flat) => {
    const old = source.data.image[0];
    source.data = {image: [new old.constructor(flat, old.shape)]};
  };
  fill(main_source, flats[head]);
  for (let h = 0; h < small_sources.length; h++) fill(small_sources[h], flats[h]);
  const [low, top] = payload.scales[mask][head];
  shown.data = {flat: [flats[head]], low: [low], top: [top]};
  mark();
  main_title.text = `Head ${head} · mask ${mask} · softmax weights${drawn}`;
  colorbar.change.emit();
  document.body.dataset.attnpanelView = `${mask}/${head}`;
}
show();
"""

# The selected query: its row marked on every map, its stored weights painted behind the
# curve (one band per stored column, darker for more weight) and the curve's marker moved.
# Maps of pixel maxima (a virtual trace's) mark the whole pixel row that holds the query:
# queries ceil(row * L / n) to ceil((row + 1) * L / n) - 1, as the overview bins them.
QUERY_JS = """
function mark() {
  const query = query_widget.value;
  const row = Math.min(n - 1, Math.floor(query * n / length));
  const first = pixel_rows ? Math.ceil(row * length / n) : query;
  const last = pixel_rows ? Math.ceil((row + 1) * length / n) - 1 : query;
  for (const box of row_boxes) { box.bottom = first - 0.5; box.top = last + 0.5; }
  if (query_span !== null) query_span.location = positions.data.x[query];
  const flat = shown.data.flat[0], low = shown.data.low[0], top = shown.data.top[0];
  if (flat.length === 0 || band === null) return;
  const weights = new Array(n);
  let most = 0;
  for (let j = 0; j < n; j++) {
    const level = flat[row * n + j];
    weights[j] = level === masked ? 0 : low + level / levels * (top - low);
    most = Math.max(most, weights[j]);
  }
  band.data = Object.assign({}, band.data, {
    weight: weights, alpha: weights.map((w) => most > 0 ? 0.6 * w / most : 0)});
  band_title.text = first === last
    ? `weights of query ${query} (head ${head_widget.value}), ` +
      `stored at ${n} columns, behind the curve`
    : `max weight of queries ${first}-${last} (the pixel row of query ${query}, ` +
      `head ${head_widget.value}) per stored column, behind the curve`;
}
"""

# A virtual trace's hover: the queries or keys of the pixel under the pointer (as the
# overview bins them) and its maximum weight.
CELLS_JS = """
const i = Math.max(0, Math.min(length - 1, Math.round(value)));
const p = Math.min(n - 1, Math.floor(i * n / length));
const first = Math.ceil(p * length / n), last = Math.ceil((p + 1) * length / n) - 1;
return first === last ? `${first}` : `${first}-${last}`;
"""
LEVEL_JS = """
if (value === masked) return "masked";
const [low, top] = [shown.data.low[0], shown.data.top[0]];
const weight = (low + value / levels * (top - low)).toPrecision(3);
return value === levels ? `>= ${weight}` : weight;
"""


def export_html(
    ds: xr.Dataset,
    path: str | Path,
    sample: int = 0,
    size: int | None = None,
    title: str = "attnpanel",
    max_bytes: int | None = MAX_BYTES,
    subtitle: str | None = None,
    overwrite: bool = False,
    query: int = 0,
    masks: list[str] | None = None,
    overviews: Overviews | None = None,
    layer: int | None = None,
) -> Path:
    """Write one sample's attention maps as a standalone HTML file that works offline.

    Above the maps, the sample's input sequence (the input signal with each reference
    series' truth and prediction, where the trace holds them) with the selected query's
    weights behind it; a query slider (or a click on the large map) moves the query, whose
    row is marked on every map.

    A virtual trace (:func:`attnpanel.traces.virtual.is_virtual`) is drawn from its overviews:
    each pixel the maximum weight of its cells (a single sharp key is never averaged
    away), masked where at least :data:`MASKED_SHARE` of them are blocked; the titles say
    so, and the query's marks cover the pixel row that holds it.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.
    path : str or Path
        The HTML file to write.
    sample : int
        Which batch item (by position).
    size : int, optional
        Display resolution: maps longer than this are reduced to ``size`` x ``size``;
        default :data:`DISPLAY` (400) for a dense trace and, for a virtual one, the side
        of the overviews the explorer stores (:data:`OVERVIEW_DISPLAY`, 480), so that
        stored overviews are read rather than computed.
    title : str
        The page title.
    max_bytes : int or None
        The file's size limit. Maps that compress badly (noise-like attention) are stored
        at a lower resolution until the file fits (a virtual trace's by whole blocks of
        its overviews' pixels); ``None`` keeps ``size``.
    subtitle : str, optional
        What the page shows, in its header before the sample (such as the layer's module
        name and group).
    overwrite : bool
        Replace an existing HTML page at ``path`` (anything else there is never replaced).
    query : int
        The query selected when the page opens.
    masks : list of str, optional
        The mask modes shown (see :func:`attnpanel.traces.stages.mask_options`). Default: every
        mode for a dense trace; only the trace's own (``ds.attrs["mask"]``) for a virtual
        one, since each other mode costs a pass over every cell of each head's map (about
        10 s a head at L = 65,536 on 2 cores) unless its overviews are stored.
    overviews : attnpanel.traces.overviews.Overviews, optional
        A virtual trace's overviews (:func:`attnpanel.traces.overviews.folder_for` the trace
        file's, to read those stored and store new ones); None computes them in memory.
        Unused for a dense trace.
    layer : int, optional
        The layer's index when ``overviews`` holds a stacked trace (``layer`` dim).

    Returns
    -------
    Path

    Raises
    ------
    ValueError
        For a sample, query or mask the trace does not have, too many heads, or maps that
        do not fit ``max_bytes``.
    """
    if not 0 <= sample < ds.sizes["batch"]:
        raise ValueError(
            f"sample {sample} is out of range: the trace has {ds.sizes['batch']} samples"
        )
    if ds.sizes["head"] > MAX_HEADS:
        raise ValueError(
            f"the export draws every head as a small map, and {ds.sizes['head']} heads are "
            f"more than the {MAX_HEADS} it lays out; export a selection, such as "
            f"ds.isel(head=slice(0, {MAX_HEADS}))"
        )
    if not 0 <= query < ds.sizes["query"]:
        raise ValueError(
            f"query {query} is out of range: the trace has {ds.sizes['query']} query positions"
        )
    masks = shown_masks(ds, masks)
    check_target(path, "html", overwrite)  # before the work
    if virtual.is_virtual(ds):
        size = OVERVIEW_DISPLAY if size is None else size
        encode = OverviewMaps(ds, sample, size, masks, overviews, layer).payload
    else:
        size = DISPLAY if size is None else size
        encode = partial(export_maps, ds, sample, masks=masks)
    frame = size  # the large map's frame in pixels stays, whatever resolution is stored
    payload = encode(size)
    html = _page(ds, payload, title, sample, frame, subtitle, query)
    for _ in range(4):
        if max_bytes is None or len(html.encode("utf-8")) <= max_bytes:
            break
        # maps shrink with the square of their side; the page around them does not
        maps = sum(len(m) for per_mask in payload["maps"].values() for m in per_mask)
        page = len(html.encode("utf-8")) - maps
        if page >= max_bytes:
            raise ValueError(
                f"a page of {ds.sizes['head']} heads takes {page} bytes before any map is "
                f"stored, over max_bytes={max_bytes} (max_bytes=None lifts the limit)"
            )
        size = int(payload["n"] * math.sqrt(0.95 * (max_bytes - page) / maps))
        payload = encode(size)
        html = _page(ds, payload, title, sample, frame, subtitle, query)
    if max_bytes is not None and len(html.encode("utf-8")) > max_bytes:
        raise ValueError(f"could not fit the maps in max_bytes={max_bytes}")
    return write_safely(path, "html", lambda target: target.write_text(html, "utf-8"), overwrite)


ROW_STYLE = dict(fill_color=HIGHLIGHT, fill_alpha=0.15, line_color=HIGHLIGHT, line_width=1.5)


def _pixel_row(query: int, length: int, n: int, pixel_rows: bool) -> tuple[int, int]:
    """The first and last query of the stored row that holds ``query``: for maps of pixel
    maxima, the pixel row (query ``i`` in row ``i * n // L``, as the overview bins it);
    else the query alone."""
    if not pixel_rows:
        return query, query
    row = min(n - 1, query * n // length)
    return -(-row * length // n), -(-(row + 1) * length // n) - 1


def _band_title(query: int, head: int, n: int, rows: tuple[int, int]) -> str:
    """What the bands behind the curve show (the page's script writes the same)."""
    first, last = rows
    if first == last:
        return f"weights of query {query} (head {head}), stored at {n} columns, behind the curve"
    return (
        f"max weight of queries {first}-{last} (the pixel row of query {query}, head {head}) "
        "per stored column, behind the curve"
    )


def _sequence_figure(
    ds: xr.Dataset, payload: dict, sample: int, query: int, width: int, pixel_rows: bool
):
    """The sample's input sequence with the query's weights behind it, or ``(None, {...})``
    for a trace whose keys are not the sequence's positions (cross-attention). (A virtual
    trace with neither a signal nor an input ``x`` shows its query norm:
    :func:`attnpanel.readouts.core.sequence_series`.)

    A curve of more than ``2 x CURVE_BINS`` points is stored by each bin's minimum and
    maximum (:func:`attnpanel.readouts.windows.envelope`): at the plot's width the same line, no
    peak lost; zoomed in, the page shows those bins, not every point."""
    length, n = payload["length"], payload["n"]
    none = dict(positions=None, query_span=None, band=None, band_title=None)
    found = sequence_series(ds, Selection(sample=sample))
    if len(found.xs) != length or length == 0:
        return None, none
    timed = np.issubdtype(np.asarray(found.xs).dtype, np.datetime64)
    xs = (
        np.asarray(found.xs).astype("datetime64[ns]").astype(np.int64) / 1e6  # ms, as Bokeh
        if timed
        else np.asarray(found.xs, dtype=np.float64)
    )
    fig = figure(
        width=width + 700,  # the legend takes about 300 px
        height=230,
        x_axis_type="datetime" if timed else "linear",
        tools="xpan,xwheel_zoom,reset",
        output_backend="webgl" if length > 5_000 else "canvas",
        title=_band_title(query, 0, n, _pixel_row(query, length, n, pixel_rows)),
        name="sequence",
    )
    fig.xaxis.axis_label = found.xname
    fig.yaxis.axis_label = f"{found.ylabel} ({found.unit})" if found.unit else found.ylabel
    values = [np.asarray(v, dtype=np.float64) for _, v in found.series]
    low = float(min(np.nanmin(v) for v in values))
    high = float(max(np.nanmax(v) for v in values))
    # one band per stored column: positions j * L / n - 0.5 to (j + 1) * L / n - 0.5, or
    # for pixel maxima the column's whole keys (key j in column j * n // L)
    columns = (
        np.append(tiles.pixel_starts(length, n), length) - 0.5
        if pixel_rows
        else np.arange(n + 1) * length / n - 0.5
    )
    edges = np.interp(
        columns,
        np.arange(-0.5, length + 0.5),
        np.concatenate(
            [[1.5 * xs[0] - 0.5 * xs[1]], (xs[:-1] + xs[1:]) / 2, [1.5 * xs[-1] - 0.5 * xs[-2]]]
        )
        if length > 1
        else [xs[0] - 0.5, xs[0] + 0.5],
    )
    band = ColumnDataSource(
        dict(
            left=edges[:-1],
            right=edges[1:],
            bottom=np.full(n, low),
            top=np.full(n, high),
            weight=np.zeros(n),
            alpha=np.zeros(n),
        )
    )
    fig.quad(
        left="left",
        right="right",
        bottom="bottom",
        top="top",
        source=band,
        fill_color="#b2182b",
        fill_alpha="alpha",
        line_color=None,
        legend_label="max weight of the query's pixel row"
        if pixel_rows
        else "weights of the selected query",
    )
    labels = [label for label, _ in found.series]
    for label, series, line in zip(labels, values, curve_styles(labels), strict=True):
        cut_xs, cut_ys = envelope(xs, series, CURVE_BINS)
        fig.line(cut_xs, cut_ys, legend_label=label, **line)  # canvas text, never HTML
    span = Span(location=xs[query], dimension="height", line_color=HIGHLIGHT, line_width=3)
    fig.add_layout(span)
    fig.legend.click_policy = "hide"
    fig.legend.ncols = 2 if len(found.series) > 6 else 1
    fig.legend.label_text_font_size = "8pt"
    fig.add_layout(fig.legend[0], "right")
    positions = ColumnDataSource({"x": xs})  # each position's x, for the query's marker
    return fig, dict(positions=positions, query_span=span, band=band, band_title=fig.title)


def _page(
    ds: xr.Dataset,
    payload: dict,
    title: str,
    sample: int,
    frame: int,
    subtitle: str | None = None,
    query: int = 0,
) -> str:
    """The standalone page (HTML text) showing encoded maps of :func:`export_maps`."""
    length, n, heads = payload["length"], payload["n"], ds.sizes["head"]
    # a virtual trace's maps hold pixel maxima: titles, hover and query marks say so
    pixel_rows = virtual.is_virtual(ds)
    per_pixel = -(-length // n)
    reduced = pixel_rows and per_pixel > 1
    drawn = f" · max of ≤{per_pixel} x {per_pixel} cells per pixel" if reduced else ""
    x_range = Range1d(-0.5, length - 0.5)
    y_range = Range1d(length - 0.5, -0.5)  # query 0 at the top, as a matrix reads
    mapper = LinearColorMapper(palette=_palette(), low=0, high=LEVELS, high_color="black")
    # the map shown now (its stored levels) and its colour scale: for the colour bar's ticks
    # and the query's weights behind the curve
    shown = ColumnDataSource({"flat": [np.zeros(0, dtype=np.uint8)], "low": [0.0], "top": [1.0]})

    def matrix_figure(frame, tools):
        fig = figure(
            frame_width=frame,
            frame_height=frame,
            x_range=x_range,
            y_range=y_range,
            tools=tools,
            active_scroll="wheel_zoom",
            output_backend="canvas",  # an image: see attnpanel.render.figures.WEBGL_MIN_POINTS
        )
        fig.grid.visible = False
        source = ColumnDataSource({"image": [np.zeros((n, n), dtype=np.uint8)]})
        fig.image(
            image="image",
            source=source,
            x=-0.5,
            y=-0.5,
            dw=length,
            dh=length,
            color_mapper=mapper,
        )
        return fig, source

    main, main_source = matrix_figure(frame, "pan,wheel_zoom,box_zoom,reset,save")
    main.name = "attention map"
    main.title.text = "softmax"
    main.xaxis.axis_label, main.yaxis.axis_label = "key", "query"
    if pixel_rows:
        cells = CustomJSHover(args=dict(n=n, length=length), code=CELLS_JS)
        weight = CustomJSHover(args=dict(shown=shown, levels=LEVELS, masked=MASKED), code=LEVEL_JS)
        tooltips = [("queries", "$y{cells}"), ("keys", "$x{cells}"), ("max weight", "@image{w}")]
        formatters = {"$y": cells, "$x": cells, "@image": weight}
        main.add_tools(HoverTool(tooltips=tooltips, formatters=formatters))
    else:
        main.add_tools(HoverTool(tooltips=[("query", "$y{0}"), ("key", "$x{0}")]))
    formatter = CustomJSTickFormatter(
        args={"shown": shown, "levels": LEVELS},
        code="const [low, top] = [shown.data.low[0], shown.data.top[0]];"
        "return (low + tick / levels * (top - low)).toPrecision(2);",
    )
    colorbar = ColorBar(
        color_mapper=mapper,
        formatter=formatter,
        title=scale_title("max weight" if reduced else "weight", 0.0),
    )
    main.add_layout(colorbar, "right")

    smalls, small_sources = [], []
    for head in range(heads):
        fig, source = matrix_figure(SMALL, "pan,wheel_zoom,box_zoom,reset")
        fig.title.text = f"head {head}"
        fig.outline_line_color = head_color(head)
        fig.outline_line_width = 3
        fig.axis.visible = False
        smalls.append(fig)
        small_sources.append(source)

    first, last = _pixel_row(query, length, n, pixel_rows)
    row_boxes = [
        BoxAnnotation(
            bottom=first - 0.5, top=last + 0.5, level="overlay", name="query row", **ROW_STYLE
        )
        for _ in range(1 + heads)
    ]
    for fig, box in zip([main, *smalls], row_boxes, strict=True):
        fig.add_layout(box)
    query_widget = Slider(title="Query", start=0, end=length - 1, value=query, step=1, width=300)
    sequence, parts = _sequence_figure(ds, payload, sample, query, frame, pixel_rows)
    head_widget = Select(title="Head", value="0", options=[str(h) for h in range(heads)])
    masks = payload["masks"]
    own = ds.attrs.get("mask", "none")
    mask_widget = RadioButtonGroup(labels=masks, active=masks.index(own) if own in masks else 0)
    stage = Div(text="<b>Stage</b>: softmax (the attention weights)")
    shows = f"{escape(subtitle)} · " if subtitle else ""
    stored = f"stored at {n} x {n}"
    if reduced:
        stored += f", each pixel the max of ≤{per_pixel} x {per_pixel} cells (the overview)"
    header = Div(
        text=f"<h2>{escape(title)}</h2><p>{shows}sample {sample} · {heads} heads"
        f" · {length} positions"
        f" · {stored} · zoom or pan any map: all heads follow</p>"
    )
    marks = dict(
        n=payload["n"],
        length=length,
        query_widget=query_widget,
        head_widget=head_widget,
        row_boxes=row_boxes,
        shown=shown,
        masked=MASKED,
        levels=LEVELS,
        pixel_rows=pixel_rows,
        **parts,
    )
    callback = CustomJS(
        args=dict(
            payload=payload,
            masks=masks,
            mask_widget=mask_widget,
            main_source=main_source,
            small_sources=small_sources,
            main_title=main.title,
            drawn=drawn,
            colorbar=colorbar,
            **marks,
        ),
        code=QUERY_JS + DECODE_JS,
    )
    head_widget.js_on_change("value", callback)
    mask_widget.js_on_change("active", callback)
    query_widget.js_on_change("value", CustomJS(args=marks, code=QUERY_JS + "mark();"))
    # a click on a row of the large map picks its query
    main.js_on_event(
        "tap",
        CustomJS(
            args=dict(query_widget=query_widget, length=length),
            code="query_widget.value = Math.max(0, Math.min(length - 1, Math.round(cb_obj.y)));",
        ),
    )
    controls = column(Div(text="<b>Mask</b>"), mask_widget, head_widget, query_widget, stage)
    layout = column(
        header,
        *([sequence] if sequence is not None else []),
        row(controls, main),
        gridplot(smalls, ncols=min(heads, 8), toolbar_location=None),
    )
    from bokeh.document import Document

    document = Document()
    document.add_root(layout)
    document.js_on_event("document_ready", callback)
    return file_html(document, resources=_SelfContained(mode="inline"), title=title)

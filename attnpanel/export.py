"""Standalone, offline HTML export of a trace's attention maps.

The file is one self-contained page built with Bokeh's inline resources: no script, style
sheet or image is fetched from anywhere. Every head of one sample under every mask mode is
stored at display resolution (datashader reduces longer sequences to ``size`` x ``size``),
quantised to 8 bits and zlib-compressed; the page inflates a map with the browser's own
``DecompressionStream`` when a widget asks for it. So the file's size depends on the display
resolution, not on the square of the sequence length.
"""

from __future__ import annotations

import base64
import math
import zlib
from html import escape
from pathlib import Path

import datashader
import numpy as np
import xarray as xr
from bokeh.embed import file_html
from bokeh.layouts import column, gridplot, row
from bokeh.models import (
    ColorBar,
    ColumnDataSource,
    CustomJS,
    CustomJSTickFormatter,
    Div,
    HoverTool,
    LinearColorMapper,
    RadioButtonGroup,
    Range1d,
    Select,
)
from bokeh.plotting import figure
from bokeh.resources import Resources

from attnpanel.files import check_target, write_safely
from attnpanel.palette import head_color  # the explorer's head colours
from attnpanel.trace import attention_stage, mask_options, masked_cells


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
TOP_PERCENTILE = 99.5  # the colour scale's top; heavier cells are drawn in the top colour


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
    visible = values[np.isfinite(values)]
    low = float(visible.min()) if visible.size else 0.0
    # a robust top: a few sharp cells must not push the rest of the map into one colour
    top = float(np.percentile(visible, TOP_PERCENTILE)) if visible.size else 1.0
    top = top if top > low else low + 1e-12
    scaled = np.clip(np.round((np.nan_to_num(values) - low) / (top - low) * LEVELS), 0, LEVELS)
    levels = np.where(np.isnan(values), MASKED, scaled)
    raw = levels.astype(np.uint8).tobytes()
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii"), (low, top)


def export_maps(ds: xr.Dataset, sample: int = 0, size: int = DISPLAY) -> dict:
    """Encoded softmax maps of one sample for every head and every computable mask mode.

    Returns
    -------
    dict
        ``{"n": cells per side, "length": L, "masks": [...], "maps": {mask: [b64, ...]},
        "scales": {mask: [(low, top), ...]}}``: each map's colour scale.
    """
    masks = mask_options(ds)
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
  state.data = {low: [low], top: [top]};
  const scale = `${low.toPrecision(2)} to ${top.toPrecision(3)}`;
  main_title.text = `Head ${head} · mask ${mask} · softmax (colour scale ${scale})`;
  colorbar.change.emit();
  document.body.dataset.attnpanelView = `${mask}/${head}`;
}
show();
"""


def export_html(
    ds: xr.Dataset,
    path: str | Path,
    sample: int = 0,
    size: int = DISPLAY,
    title: str = "attnpanel",
    max_bytes: int | None = MAX_BYTES,
    subtitle: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write one sample's attention maps as a standalone HTML file that works offline.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.
    path : str or Path
        The HTML file to write.
    sample : int
        Which batch item (by position).
    size : int
        Display resolution: maps longer than this are reduced to ``size`` x ``size``.
    title : str
        The page title.
    max_bytes : int or None
        The file's size limit. Maps that compress badly (noise-like attention) are stored
        at a lower resolution until the file fits; ``None`` keeps ``size``.
    subtitle : str, optional
        What the page shows, in its header before the sample (such as the layer's module
        name and group).
    overwrite : bool
        Replace an existing HTML page at ``path`` (anything else there is never replaced).

    Returns
    -------
    Path
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
    check_target(path, "html", overwrite)  # before the work
    frame = size  # the large map's frame in pixels stays, whatever resolution is stored
    payload = export_maps(ds, sample, size)
    html = _page(ds, payload, title, sample, frame, subtitle)
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
        payload = export_maps(ds, sample, size)
        html = _page(ds, payload, title, sample, frame, subtitle)
    if max_bytes is not None and len(html.encode("utf-8")) > max_bytes:
        raise ValueError(f"could not fit the maps in max_bytes={max_bytes}")
    return write_safely(path, "html", lambda target: target.write_text(html, "utf-8"), overwrite)


def _page(
    ds: xr.Dataset,
    payload: dict,
    title: str,
    sample: int,
    frame: int,
    subtitle: str | None = None,
) -> str:
    """The standalone page (HTML text) showing encoded maps of :func:`export_maps`."""
    length, n, heads = payload["length"], payload["n"], ds.sizes["head"]
    x_range = Range1d(-0.5, length - 0.5)
    y_range = Range1d(length - 0.5, -0.5)  # query 0 at the top, as a matrix reads
    mapper = LinearColorMapper(palette=_palette(), low=0, high=LEVELS, high_color="black")
    state = ColumnDataSource({"low": [0.0], "top": [1.0]})  # the shown map's colour scale

    def matrix_figure(frame, tools):
        fig = figure(
            frame_width=frame,
            frame_height=frame,
            x_range=x_range,
            y_range=y_range,
            tools=tools,
            active_scroll="wheel_zoom",
            output_backend="webgl",
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
    main.title.text = "softmax"
    main.xaxis.axis_label, main.yaxis.axis_label = "key", "query"
    main.add_tools(HoverTool(tooltips=[("query", "$y{0}"), ("key", "$x{0}")]))
    formatter = CustomJSTickFormatter(
        args={"state": state, "levels": LEVELS},
        code="const [low, top] = [state.data.low[0], state.data.top[0]];"
        "return (low + tick / levels * (top - low)).toPrecision(2);",
    )
    colorbar = ColorBar(color_mapper=mapper, formatter=formatter, title="weight")
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

    head_widget = Select(title="Head", value="0", options=[str(h) for h in range(heads)])
    masks = payload["masks"]
    own = ds.attrs.get("mask", "none")
    mask_widget = RadioButtonGroup(labels=masks, active=masks.index(own) if own in masks else 0)
    stage = Div(text="<b>Stage</b>: softmax (the attention weights)")
    shows = f"{escape(subtitle)} · " if subtitle else ""
    header = Div(
        text=f"<h2>{escape(title)}</h2><p>{shows}sample {sample} · {heads} heads"
        f" · {length} positions"
        f" · stored at {n} x {n} · zoom or pan any map: all heads follow</p>"
    )
    callback = CustomJS(
        args=dict(
            payload=payload,
            masks=masks,
            mask_widget=mask_widget,
            head_widget=head_widget,
            main_source=main_source,
            small_sources=small_sources,
            main_title=main.title,
            colorbar=colorbar,
            state=state,
        ),
        code=DECODE_JS,
    )
    head_widget.js_on_change("value", callback)
    mask_widget.js_on_change("active", callback)
    layout = column(
        header,
        row(column(Div(text="<b>Mask</b>"), mask_widget, head_widget, stage), main),
        gridplot(smalls, ncols=min(heads, 8), toolbar_location=None),
    )
    from bokeh.document import Document

    document = Document()
    document.add_root(layout)
    document.js_on_event("document_ready", callback)
    return file_html(document, resources=_SelfContained(mode="inline"), title=title)

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
    BoxAnnotation,
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
    Slider,
    Span,
)
from bokeh.plotting import figure
from bokeh.resources import Resources

from attnpanel.files import check_target, write_safely
from attnpanel.palette import HIGHLIGHT, curve_styles, head_color  # the explorer's
from attnpanel.raster import image_limits, scale_title
from attnpanel.readouts import Selection, sequence_series
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
  shown.data = {flat: [flats[head]], low: [low], top: [top]};
  mark();
  main_title.text = `Head ${head} · mask ${mask} · softmax weights`;
  colorbar.change.emit();
  document.body.dataset.attnpanelView = `${mask}/${head}`;
}
show();
"""

# The selected query: its row marked on every map, its stored weights painted behind the
# curve (one band per stored column, darker for more weight) and the curve's marker moved.
QUERY_JS = """
function mark() {
  const query = query_widget.value;
  for (const box of row_boxes) { box.bottom = query - 0.5; box.top = query + 0.5; }
  if (query_span !== null) query_span.location = positions.data.x[query];
  const flat = shown.data.flat[0], low = shown.data.low[0], top = shown.data.top[0];
  if (flat.length === 0 || band === null) return;
  const row = Math.min(n - 1, Math.floor(query * n / length));
  const weights = new Array(n);
  let most = 0;
  for (let j = 0; j < n; j++) {
    const level = flat[row * n + j];
    weights[j] = level === masked ? 0 : low + level / levels * (top - low);
    most = Math.max(most, weights[j]);
  }
  band.data = Object.assign({}, band.data, {
    weight: weights, alpha: weights.map((w) => most > 0 ? 0.6 * w / most : 0)});
  band_title.text = `weights of query ${query} (head ${head_widget.value}), ` +
    `stored at ${n} columns, behind the curve`;
}
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
    query: int = 0,
) -> Path:
    """Write one sample's attention maps as a standalone HTML file that works offline.

    Above the maps, the sample's input sequence (the household power with each appliance's
    truth and prediction for a NILM trace) with the selected query's weights behind it; a
    query slider (or a click on the large map) moves the query, whose row is marked on
    every map.

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
    query : int
        The query selected when the page opens.

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
    if not 0 <= query < ds.sizes["query"]:
        raise ValueError(
            f"query {query} is out of range: the trace has {ds.sizes['query']} query positions"
        )
    check_target(path, "html", overwrite)  # before the work
    frame = size  # the large map's frame in pixels stays, whatever resolution is stored
    payload = export_maps(ds, sample, size)
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
        payload = export_maps(ds, sample, size)
        html = _page(ds, payload, title, sample, frame, subtitle, query)
    if max_bytes is not None and len(html.encode("utf-8")) > max_bytes:
        raise ValueError(f"could not fit the maps in max_bytes={max_bytes}")
    return write_safely(path, "html", lambda target: target.write_text(html, "utf-8"), overwrite)


ROW_STYLE = dict(fill_color=HIGHLIGHT, fill_alpha=0.15, line_color=HIGHLIGHT, line_width=1.5)


def _sequence_figure(ds: xr.Dataset, payload: dict, sample: int, query: int, width: int):
    """The sample's input sequence with the query's weights behind it, or ``(None, {...})``
    for a trace whose keys are not the sequence's positions (cross-attention)."""
    found = sequence_series(ds, Selection(sample=sample))
    length, n = payload["length"], payload["n"]
    none = dict(positions=None, query_span=None, band=None, band_title=None)
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
        title=f"weights of query {query} (head 0) behind the curve",
        name="sequence",
    )
    fig.xaxis.axis_label = found.xname
    fig.yaxis.axis_label = f"{found.ylabel} ({found.unit})" if found.unit else found.ylabel
    values = [np.asarray(v, dtype=np.float64) for _, v in found.series]
    low = float(min(np.nanmin(v) for v in values))
    high = float(max(np.nanmax(v) for v in values))
    # one band per stored column: positions j * L / n - 0.5 to (j + 1) * L / n - 0.5
    edges = np.interp(
        np.arange(n + 1) * length / n - 0.5,
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
        legend_label="weights of the selected query",
    )
    labels = [label for label, _ in found.series]
    for label, series, line in zip(labels, values, curve_styles(labels), strict=True):
        fig.line(xs, series, legend_label=label, **line)  # canvas text, never HTML
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
            output_backend="canvas",  # an image: see attnpanel.figures.WEBGL_MIN_POINTS
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
    main.add_tools(HoverTool(tooltips=[("query", "$y{0}"), ("key", "$x{0}")]))
    formatter = CustomJSTickFormatter(
        args={"shown": shown, "levels": LEVELS},
        code="const [low, top] = [shown.data.low[0], shown.data.top[0]];"
        "return (low + tick / levels * (top - low)).toPrecision(2);",
    )
    colorbar = ColorBar(color_mapper=mapper, formatter=formatter, title=scale_title("weight", 0.0))
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

    row_boxes = [
        BoxAnnotation(
            bottom=query - 0.5, top=query + 0.5, level="overlay", name="query row", **ROW_STYLE
        )
        for _ in range(1 + heads)
    ]
    for fig, box in zip([main, *smalls], row_boxes, strict=True):
        fig.add_layout(box)
    query_widget = Slider(title="Query", start=0, end=length - 1, value=query, step=1, width=300)
    sequence, parts = _sequence_figure(ds, payload, sample, query, frame)
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
    marks = dict(
        n=payload["n"],
        length=length,
        query_widget=query_widget,
        head_widget=head_widget,
        row_boxes=row_boxes,
        shown=shown,
        masked=MASKED,
        levels=LEVELS,
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

"""The standalone export's page: Bokeh models and the scripts that run them offline.

One self-contained document built with Bokeh's inline resources: no script, style sheet or
image is fetched from anywhere. The maps arrive encoded (:mod:`attnpanel.render.export_maps`);
the page's scripts inflate the one a widget asks for, mark the selected query on every map
and draw its weights behind the input sequence.
"""

from __future__ import annotations

from html import escape

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
from attnpanel.readouts.raster import scale_title
from attnpanel.readouts.windows import CURVE_BINS, envelope
from attnpanel.render.export_maps import LEVELS, MASKED, map_palette
from attnpanel.render.palette import HIGHLIGHT, curve_styles, head_color, legend_swatch
from attnpanel.traces import virtual


class SelfContained(Resources):
    """Bokeh's inline resources without the script and style URLs of other libraries' models.

    Bokeh adds the ``__javascript__`` and ``__css__`` of every model class registered in the
    process, used or not; once panel is imported that includes relative URLs such as
    panel's ``es-module-shims``, which a file opened from disk cannot load. The export uses
    Bokeh models only, so those URLs are dropped.
    """

    def _collect_external_resources(self, resource_attr):
        return []

    def clone(self, *, components=None):
        return SelfContained(
            mode="inline", components=components if components is not None else self.components
        )


SMALL = 120  # frame of each head's small map, in pixels


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
    shading = fig.quad(
        left="left",
        right="right",
        bottom="bottom",
        top="top",
        source=band,
        fill_color="#b2182b",
        fill_alpha="alpha",
        line_color=None,
    )
    # the band's first row has a weight's alpha (0 at query 0, where the mask blocks it)
    swatch = legend_swatch(
        fig,
        "#b2182b",
        0.6,
        legend_label="max weight of the query's pixel row"
        if pixel_rows
        else "selected query's weights",
    )
    item = next(i for i in fig.legend[0].items if swatch in i.renderers)
    item.renderers.append(shading)  # a click on the legend hides the shading too
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


def page_html(
    ds: xr.Dataset,
    payload: dict,
    title: str,
    sample: int,
    frame: int,
    subtitle: str | None = None,
    query: int = 0,
) -> str:
    """The standalone page (HTML text) showing the encoded maps of
    :func:`attnpanel.render.export_maps.export_maps`."""
    length, n, heads = payload["length"], payload["n"], ds.sizes["head"]
    # a virtual trace's maps hold pixel maxima: titles, hover and query marks say so
    pixel_rows = virtual.is_virtual(ds)
    per_pixel = -(-length // n)
    reduced = pixel_rows and per_pixel > 1
    drawn = f" · max of ≤{per_pixel} x {per_pixel} cells per pixel" if reduced else ""
    x_range = Range1d(-0.5, length - 0.5)
    y_range = Range1d(length - 0.5, -0.5)  # query 0 at the top, as a matrix reads
    mapper = LinearColorMapper(palette=map_palette(), low=0, high=LEVELS, high_color="black")
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
    return file_html(document, resources=SelfContained(mode="inline"), title=title)

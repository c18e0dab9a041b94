"""The comparison of two captures as one standalone HTML page that works offline.

``attnpanel compare a.nc b.nc -o report.html`` and ``CompareExplorer.save`` write it: the
heads ranked by divergence (a table of every head: Jensen-Shannon divergence, largest
``|b - a|``, rows compared) and, for the most different heads, A, B and B - A of one sample
side by side (zoom one, the other two follow). Each map is regridded as the page regrids
it (:func:`attnpanel.readouts.raster.window_raster`), quantised to 8 bits and
zlib-compressed (:func:`attnpanel.render.export_maps.encode_map`); the page inflates them
with the browser's own ``DecompressionStream``. Bokeh's inline resources: nothing is
fetched from anywhere.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr
from bokeh.document import Document
from bokeh.embed import file_html
from bokeh.layouts import column, row
from bokeh.models import (
    ColorBar,
    ColumnDataSource,
    CustomJS,
    CustomJSHover,
    CustomJSTickFormatter,
    Div,
    FixedTicker,
    HoverTool,
    LinearColorMapper,
    Range1d,
)
from bokeh.palettes import RdBu11, interp_palette
from bokeh.plotting import figure

from attnpanel.readouts import core
from attnpanel.readouts.raster import scale_title, window_raster
from attnpanel.render.compare_views import head_name
from attnpanel.render.export_maps import LEVELS, MASKED, encode_map, map_palette
from attnpanel.render.export_page import SelfContained
from attnpanel.render.tables import TABLE_CSS
from attnpanel.util.files import check_target, write_safely

REPORT_HEADS = 8  # the most different heads whose maps the report draws
REPORT_SIZE = 260  # frame of each map, in pixels (and the most pixels it stores a side)
MAX_REPORT_HEADS = 64

INFLATE_JS = """
async function inflate(b64) {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
// the sources hold (rows, cols) uint8 ndarrays: a new one of the same class and shape
const fill = async (source, b64) => {
  const flat = await inflate(b64);
  const old = source.data.image[0];
  source.data = Object.assign({}, source.data, {image: [new old.constructor(flat, old.shape)]});
};
Promise.all(sources.map((source, i) => fill(source, maps[i]))).then(() => {
  document.body.dataset.attnpanelReport = "drawn";
});
"""
VALUE_JS = "return (low + tick / levels * (top - low)).toPrecision(3);"
HOVER_JS = (
    "if (value === masked) return 'masked';"
    "return (low + value / levels * (top - low)).toPrecision(4);"
)
DRAWN_ROW_CSS = "tr.drawn td:first-child { font-weight: 600; }"  # heads with maps


def difference_palette() -> list[str]:
    """Blue (B attends less) through white (0) to red (B attends more), one colour a level."""
    return list(interp_palette(RdBu11, LEVELS + 1))  # Bokeh's RdBu runs blue to red


def compared_maps(
    a: xr.Dataset, b: xr.Dataset, layer: int, head: int, sample: int, size: int
) -> dict[str, np.ndarray]:
    """A, B and B - A of one head and sample, each regridded to at most ``size`` pixels a
    side as the page draws them (masked cells NaN), float32."""
    sel = core.Selection(sample=sample, head=head, layer=layer)  # each capture's own mask
    first = core.attention_values(core.at_layer(a, layer), sel)
    second = core.attention_values(core.at_layer(b, layer), sel)
    found = {"A": first, "B": second, "B − A": second - first}
    return {which: window_raster(values, size, size)[0] for which, values in found.items()}


def ranking_table(ranking: pd.DataFrame, drawn: int) -> str:
    """Every head as an HTML table row, most different first; the drawn ones in bold."""
    rows = []
    for rank, found in enumerate(ranking.itertuples(index=False), start=1):
        js = f"{found.js:.4g}" if np.isfinite(found.js) else "–"
        gap = f"{found.max_abs:.4g}" if np.isfinite(found.max_abs) else "–"
        cells = (rank, head_name(found.layer_name, int(found.head)), js, gap, int(found.rows))
        mark = ' class="drawn"' if rank <= drawn else ""
        rows.append(f"<tr{mark}>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{name}</th>"
        for name in ("rank", "head", "JS divergence (nats)", "max |b − a|", "rows")
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _map_figure(which: str, values: np.ndarray, frame: int, ranges: dict, title: str):
    """One map of the report: its figure, its source (filled by the page) and its encoding."""
    centred = which == "B − A"
    encoded, (low, top) = encode_map(values, centred)
    rows, cols = values.shape
    palette = difference_palette() if centred else map_palette()
    mapper = LinearColorMapper(palette=palette, low=0, high=LEVELS, high_color="black")
    fig = figure(
        frame_width=frame,
        frame_height=frame,
        tools="pan,wheel_zoom,box_zoom,reset,save",
        active_scroll="wheel_zoom",
        output_backend="canvas",
        title=title,
        **ranges,
    )
    fig.toolbar.autohide = True
    fig.grid.visible = False
    fig.title.text_font_size = "10pt"
    fig.xaxis.axis_label, fig.yaxis.axis_label = "key", "query"
    left, right = ranges["x_range"].start, ranges["x_range"].end
    bottom, top_edge = ranges["y_range"].end, ranges["y_range"].start
    source = ColumnDataSource({"image": [np.zeros((rows, cols), dtype=np.uint8)]})
    fig.image(
        image="image",
        source=source,
        x=left,
        y=bottom,
        dw=right - left,
        dh=top_edge - bottom,
        color_mapper=mapper,
    )
    scale = dict(low=low, top=top, levels=LEVELS, masked=MASKED)
    fig.add_tools(
        HoverTool(
            tooltips=[("query", "$y{0}"), ("key", "$x{0}"), ("value", "@image{value}")],
            formatters={"@image": CustomJSHover(args=scale, code=HOVER_JS)},
        )
    )
    bar = ColorBar(
        color_mapper=mapper,
        formatter=CustomJSTickFormatter(args=scale, code=VALUE_JS),
        # the ends, the middle (0 of a difference) and the quarters, in stored levels
        ticker=FixedTicker(ticks=[LEVELS * i / 4 for i in range(5)]),
        title=scale_title("", low),
        title_text_font_style="italic",
        major_label_text_font_size="8pt",
        width=10,
        padding=3,
    )
    fig.add_layout(bar, "right")
    return fig, source, encoded


def report_html(
    a: xr.Dataset,
    b: xr.Dataset,
    ranking: pd.DataFrame,
    sample: int = 0,
    heads: int = REPORT_HEADS,
    size: int = REPORT_SIZE,
    labels: tuple[str, str] = ("a", "b"),
) -> str:
    """The report's HTML text (see :func:`compare_html`)."""
    drawn = ranking.head(heads)
    title = "attnpanel · comparison"
    parts, sources, maps = [], [], []
    n_query, n_key = a.sizes["query"], a.sizes["key"]
    for rank, found in enumerate(drawn.itertuples(index=False), start=1):
        name = head_name(found.layer_name, int(found.head))
        numbers = (
            f"JS divergence {found.js:.4g} nats · max |b − a| {found.max_abs:.4g}"
            if np.isfinite(found.js)
            else "no real query row"
        )
        parts.append(Div(text=f"<h3>{rank}. {escape(name)}</h3><p>{escape(numbers)}</p>"))
        ranges = dict(
            x_range=Range1d(-0.5, n_key - 0.5),
            y_range=Range1d(n_query - 0.5, -0.5),  # query 0 on top, as a matrix reads
        )
        figures = []
        computed = compared_maps(a, b, int(found.layer), int(found.head), sample, size)
        for which, values in computed.items():
            fig, source, encoded = _map_figure(
                which, values, size, ranges, f"{which} · sample {sample}, {name}"
            )
            figures.append(fig)
            sources.append(source)
            maps.append(encoded)
        parts.append(row(*figures))
    a_label, b_label = (escape(str(label)) for label in labels)
    header = Div(
        text=f"<h2>{title}</h2><p><b>A</b>: {a_label} · <b>B</b>: {b_label}, run on the same "
        f"inputs. Heads by the Jensen-Shannon divergence of their query rows (nats, mean "
        f"over every sample's real queries; at most ln 2 = 0.693), most different first. "
        f"Below, for the {len(drawn)} most different heads (bold), sample {sample}: "
        f"A, B (the models' own {core.both_weights_words(a, b)}; rows: queries, columns: "
        "keys; masked cells black) and B − A (centred on 0: red where B attends more, blue "
        "where less). "
        "Zoom or pan a map: the other two follow.</p>",
        width=1000,
    )
    table = Div(
        text=f"<style>{TABLE_CSS}{DRAWN_ROW_CSS}</style>{ranking_table(ranking, len(drawn))}",
        width=640,
    )
    layout = column(header, table, *parts)
    document = Document()
    document.add_root(layout)
    document.js_on_event(
        "document_ready",
        CustomJS(args=dict(sources=sources, maps=maps), code=INFLATE_JS),
    )
    return file_html(document, resources=SelfContained(mode="inline"), title=title)


def compare_html(
    a: xr.Dataset,
    b: xr.Dataset,
    ranking: pd.DataFrame,
    path: str | Path,
    sample: int = 0,
    heads: int = REPORT_HEADS,
    size: int = REPORT_SIZE,
    labels: tuple[str, str] = ("a", "b"),
    overwrite: bool = False,
) -> Path:
    """Write the comparison of two captures as a standalone HTML file that works offline.

    Parameters
    ----------
    a, b : xarray.Dataset
        The two dense captures compared (one layer, or a ``layer`` dim).
    ranking : pandas.DataFrame
        Their heads, most different first (:func:`attnpanel.readouts.compare.ranked_heads`).
    path : str or Path
        The HTML file to write.
    sample : int
        The sample whose maps are drawn (by position).
    heads : int
        How many of the most different heads get their A, B and B - A maps.
    size : int
        Each map's frame in pixels; a longer map is regridded to it (the mean of its cells,
        as the page draws a map zoomed out).
    labels : (str, str)
        What the page calls A and B.
    overwrite : bool
        Replace an existing HTML page at ``path`` (anything else there is never replaced).

    Returns
    -------
    Path

    Raises
    ------
    ValueError
        For a sample the captures do not have, or a number of heads out of 1 to
        :data:`MAX_REPORT_HEADS`.
    """
    if not 0 <= sample < a.sizes["batch"]:
        raise ValueError(
            f"sample {sample} is out of range: the captures have {a.sizes['batch']} samples"
        )
    if not 1 <= heads <= MAX_REPORT_HEADS:
        raise ValueError(f"heads={heads}: the report draws 1 to {MAX_REPORT_HEADS} heads' maps")
    check_target(path, "html", overwrite)  # before the work
    html = report_html(a, b, ranking, sample, heads, size, labels)
    return write_safely(path, "html", lambda target: target.write_text(html, "utf-8"), overwrite)

"""The sections of the explorer of a virtual trace (any length: L = 65,536 and beyond).

A virtual trace holds no map (:mod:`attnpanel.traces.virtual`): every map here is a
:class:`attnpanel.readouts.windows.VirtualMap`, whose pixels for the visible window come from the
stored overview or are computed from ``q``, ``k`` and each row's ``lse``. The sections
follow the same state, engine and linked zoom as the dense page; the views that need a
whole ``(head, query, key)`` array of a sample (value aggregation, merge, per-head
statistics) are not on this page.

- :class:`LongControls`: sample, head, query (slider and number), mask, colour map;
- :class:`LongSequence`: the input power over the whole sample (each curve drawn by the
  minimum and maximum of its points per pixel column, redrawn for the visible part);
- :class:`QueryRow`: the selected query's weights over every key, computed alone, and
  its heaviest keys;
- :class:`WindowedMatrix`: the large map, linked with :class:`LongHeads`, every head's map.
"""

from __future__ import annotations

import time
from functools import partial

import holoviews as hv
import numpy as np
import panel as pn
import param
from bokeh.models import CustomJSHover, CustomJSTickFormatter, HoverTool
from holoviews.plotting.util import process_cmap

from attnpanel.app import linked
from attnpanel.app.documents import one_message
from attnpanel.app.prefetch import MatrixPrefetch, switch_in_browser
from attnpanel.app.sections.base import Section
from attnpanel.app.sections.controls import (
    ImmediateIntSlider,
    ImmediateSelect,
    WidgetRow,
    head_selector,
    layer_selector,
)
from attnpanel.app.sections.heads import HEAD_MAP_SIZE, HeadComparison
from attnpanel.app.sections.matrix import MATRIX_SIZE, matrix_style
from attnpanel.app.sections.sequence import sequence_styles
from attnpanel.app.sources import VirtualSource
from attnpanel.readouts import core, windows
from attnpanel.readouts.windows import CURVE_BINS
from attnpanel.render import axes
from attnpanel.render.elements import MAP_KEY

SEQUENCE_HEIGHT = 220
ROW_HEIGHT = 200
REDRAW_AFTER_MS = 150  # the curves are redrawn for a new x range once it rests this long
RECUT = ("sequence view", "query row")  # the views cut to the shared x range

# Clock time of a position in the browser: positions stay the coordinates, the trace's
# regular step turns them into times (UTC, as the trace stores them).
CLOCK_CODE = """
const i = Math.round({value});
if (i < 0 || i >= n) return '';
const d = new Date(start + i * step);
const p = (v) => String(v).padStart(2, '0');
const day = p(d.getUTCMonth() + 1) + '-' + p(d.getUTCDate());
const clock = p(d.getUTCHours()) + ':' + p(d.getUTCMinutes());
return {prefix}day + ' ' + clock;
"""


def clock_args(ds, sample: int) -> dict | None:
    """``start``, ``step`` (ms) and ``n`` of a sample's regular clock, or None."""
    step = core.time_step(ds, sample)
    if step is None:
        return None
    time_ = ds["time"]
    if "batch" in time_.dims:
        time_ = time_.isel(batch=sample)
    start = np.asarray(time_.values[:1]).astype("datetime64[ms]").astype(np.int64)[0]
    return dict(start=int(start), step=int(step / np.timedelta64(1, "ms")), n=time_.size)


class Clock:
    """The clock-time labels of a section's position axes and hover fields, following
    the selected sample (another sample has other hours)."""

    def __init__(self, engine):
        self.state = engine.state
        self._formatters: list = []
        engine.follow(self._follow, ["sample", "layer"])  # with the maps, not ahead of them

    def _args(self) -> dict | None:
        return clock_args(self.state.trace, self.state.sample)

    def label(self, figure, x: str = "key", y: str | None = None) -> None:
        """Label ``figure``'s x axis (and its y axis, given ``y``) with clock times; the
        hover names them ``x`` and ``y``. Nothing for a trace without a regular clock."""
        args = self._args()
        if args is None:
            return
        tick = CustomJSTickFormatter(args=args, code=CLOCK_CODE.format(value="tick", prefix=""))
        code = CLOCK_CODE.format(value="value", prefix="i + ' (' + ")
        hover = CustomJSHover(args=args, code=code.replace("+ clock;", "+ clock + ')';"))
        self._formatters += [tick, hover]
        fields = {"$x": x} if y is None else {"$x": x, "$y": y}
        figure.xaxis.formatter = tick
        if y is not None:
            figure.yaxis.formatter = tick
        for tool in figure.select({"type": HoverTool}):
            values = [(n, f) for n, f in (tool.tooltips or []) if f.startswith("@")]
            kept = {k: v for k, v in (tool.formatters or {}).items() if k.startswith("@")}
            tool.formatters = {**kept, **dict.fromkeys(fields, hover)}
            tool.tooltips = [(n, f"{f}{{custom}}") for f, n in fields.items()] + values

    def _follow(self, *_events) -> None:
        args = self._args()
        if args is not None:
            for formatter in self._formatters:
                formatter.args = args


def visible(x_range, n: int) -> slice:
    """The positions ``0 .. n-1`` an x range shows (all of them before it is set)."""
    start, end = x_range.start, x_range.end
    if start is None or end is None:
        return slice(0, n)
    low, high = sorted((start, end))
    return slice(max(0, int(np.floor(low))), min(n, int(np.ceil(high)) + 1))


class LongControls(WidgetRow):
    """Sample, head, query (a slider and an exact number), mask and colour map."""

    def make_widgets(self, state) -> dict:
        widgets = layer_selector(state)
        widgets.update(
            sample=ImmediateIntSlider.from_param(state.param.sample, name="Sample", width=150),
            head=head_selector(state, width=110),
            query=ImmediateIntSlider.from_param(state.param.query, name="Query", width=320),
            query_number=pn.widgets.IntInput.from_param(
                state.param.query, name="Query (exact)", width=120
            ),
            mask=ImmediateSelect.from_param(state.param.mask, name="Mask", width=110),
            colormap=ImmediateSelect.from_param(state.param.colormap, name="Colormap", width=110),
        )
        return widgets


class LongSequence(Section):
    """The input sequence over the whole sample, its curves cut to the plot's columns for
    the visible part, the selected query marked; a click picks the query."""

    def __init__(self, x_range, **params):
        super().__init__(**params)
        self.x_range = x_range
        self.clock = Clock(self.engine)
        self._changed_at = 0.0
        self._scheduled = False

    def build(self):
        state = self.state
        shown = self.engine.add(
            "sequence view", self.curves, ["sample", "show_reference"], "sequence"
        )
        marker = self.engine.add(
            "position marker",
            lambda sel: hv.VLine(sel.query, group="Marker"),
            ["query"],
            "sequence",
            title=False,
            first=True,
        )
        layer_style = sequence_styles(shown, state.show_reference)
        style = dict(
            responsive=True,
            height=SEQUENCE_HEIGHT,
            legend=True,
            legend_cols=2 if len(shown) > 6 else 1,
            layer_style=layer_style,
            x_range=self.x_range,
            toolbar=True,
            tools=("hover", "xpan", "xwheel_zoom", "reset"),
        )
        pane = self.engine.render(
            hv.Overlay([*shown, marker], label=shown.label),
            "sequence",
            style=style,
            on_tap=self.click,
            sizing_mode="stretch_width",
            height=SEQUENCE_HEIGHT,
            margin=(0, 5),
        )
        self.clock.label(pane.object, x="position")
        for attr in ("start", "end"):
            self.x_range.on_change(attr, self._on_range)
        return pane

    def curves(self, sel) -> hv.Overlay:
        """The sample's curves over the visible positions, each cut to
        :data:`CURVE_BINS` columns by its minimum and maximum (:func:`windows.envelope`)."""
        found = core.sequence_series(self.trace, sel, show_reference=True)
        shown = visible(self.x_range, len(found.xs))
        positions = np.arange(shown.start, shown.stop, dtype=np.float32)
        ydim = hv.Dimension(found.yname, label=found.ylabel, unit=found.unit)
        curves = []
        for label, values in found.series:
            cut = np.asarray(values, dtype=np.float32)[shown]
            xs, ys = windows.envelope(positions, cut, CURVE_BINS)
            curves.append(hv.Curve((xs, ys), "position", ydim, group="Sequence", label=label))
        title = found.title.replace("click to pick", "click or use the row below to pick")
        return hv.Overlay(curves, label=title)

    def _on_range(self, attr, old, new) -> None:
        doc = pn.state.curdoc
        self._changed_at = time.monotonic()
        if doc is None or doc.session_context is None:
            self._recut()
            return
        if not self._scheduled:
            self._scheduled = True
            doc.add_timeout_callback(partial(self._rested, doc), REDRAW_AFTER_MS)

    def _rested(self, doc) -> None:
        wait = REDRAW_AFTER_MS - 1000 * (time.monotonic() - self._changed_at)
        if wait > 1:
            doc.add_timeout_callback(partial(self._rested, doc), wait)
            return
        self._scheduled = False
        with one_message(doc):
            self._recut()

    def _recut(self) -> None:
        self.engine.redraw(lambda view: view.name in RECUT)

    def click(self, x=None, y=None) -> None:
        """A click on the curve picks the nearest position as the query."""
        if x is None:
            return
        query = int(np.clip(round(float(x)), 0, self.trace.sizes["query"] - 1))
        self.engine.soon(self.state.param.update, query=query)


class QueryRow(Section):
    """The selected query's softmax weights over every key (one row, computed alone in
    tens of milliseconds), under the input sequence on the same axis, with its heaviest
    keys marked and listed."""

    source = param.ClassSelector(class_=VirtualSource, doc="The virtual trace's maps and rows.")

    title = "The selected query's weights over every key"

    def __init__(self, x_range, **params):
        super().__init__(**params)
        self.x_range = x_range
        self.clock = Clock(self.engine)

    def row(self, sel) -> np.ndarray:
        """The selected query's weights over every key, float32 (blocked keys 0)."""
        return windows.query_row(
            self.trace, sel.sample, int(sel.head), sel.query, sel.mask, self.source.qk(sel)
        )

    def weights(self, sel) -> hv.Overlay:
        """The row as a curve over key positions, its top keys as points."""
        row = self.row(sel)
        keys, top = windows.top_keys(row)
        shown = visible(self.x_range, row.size)
        positions = np.arange(shown.start, shown.stop, dtype=np.float32)
        xs, ys = windows.envelope(positions, row[shown], CURVE_BINS)
        curve = hv.Curve((xs, ys), "key", "weight", group="QueryRow", label="weight")
        points = hv.Scatter((keys.astype(np.float32), top), "key", "weight", group="TopKeys")
        label = (
            f"query {sel.query}, head {sel.head}: weights over all {row.size:,} keys "
            f"(mask {sel.mask}); heaviest key {keys[0]} ({top[0]:.4f})"
        )
        return hv.Overlay([curve, points], label=label)

    def top_table(self, sel) -> hv.Table:
        """The heaviest keys of the selected query: rank, key, clock time, weight."""
        row = self.row(sel)
        keys, top = windows.top_keys(row)
        clock = core.clock_labels(self.trace, sel.sample)
        data = {"rank": np.arange(1, len(keys) + 1), "key": keys}
        if clock is not None:  # a trace without a clock has no time column, not an empty one
            data["time"] = [clock[k] for k in keys]
        data["weight"] = [f"{w:.5f}" for w in top]
        return hv.Table(data, kdims=["rank"], vdims=[name for name in data if name != "rank"])

    def build(self):
        overlay = self.engine.add(
            "query row", self.weights, ["sample", "head", "query", "mask"], "query row"
        )
        style = dict(
            responsive=True,
            height=ROW_HEIGHT,
            x_range=self.x_range,
            toolbar=True,
            tools=("hover", "xpan", "xwheel_zoom", "reset"),
            title_size="10pt",
        )
        plot = self.engine.render(
            overlay, "query row", style=style, sizing_mode="stretch_width", height=ROW_HEIGHT
        )
        # one width (0.000015: a weight over 65,536 keys): a new query lays nothing out
        axes.steady_labels(plot.object.yaxis[0], chars=8)
        self.clock.label(plot.object)
        table = self.engine.add(
            "top keys",
            self.top_table,
            ["sample", "head", "query", "mask"],
            "top keys",
            title=False,
        )
        listed = self.engine.render(table, "top keys", style=dict(width=420, height=280))
        return pn.Row(
            pn.Column(self.heading(), plot, sizing_mode="stretch_width", margin=0),
            listed,
            sizing_mode="stretch_width",
            margin=0,
        )


class WindowedMatrix(Section):
    """The large map of the selected head: the stored overview over the whole map,
    computed from q and k once zoomed under :data:`attnpanel.readouts.windows.EXACT_CELLS` cells."""

    source = param.ClassSelector(class_=VirtualSource, doc="The virtual trace's maps and rows.")

    title = "Attention matrix (wheel to zoom every map; click a row to pick its query)"

    def __init__(self, **params):
        super().__init__(**params)
        self.clock = Clock(self.engine)
        self.prefetch: MatrixPrefetch | None = None  # the map's neighbours sent ahead
        self.state.param.watch(self._on_colormap, "colormap")

    def switch_in_browser(self, widgets: dict) -> None:
        """Let the head and mask widgets redraw the map in the browser from the maps of the
        shown window sent ahead while the page is idle, those quick to make (their overview
        at hand); any other change goes to the server (:mod:`attnpanel.app.prefetch`)."""
        if self.prefetch is None:
            self.prefetch = switch_in_browser(self.engine, widgets, ready=self.source.ready)

    def values(self, sel):
        """``(map, title, colour-bar label)`` of the selected head for the engine."""
        return self._values(self.source.virtual_map(sel), sel)

    def exact_values(self, sel):
        """The same for the window's own pixels, where :meth:`values` cut the overview
        coarser than the screen (None elsewhere): drawn next, once computed."""
        found = self.source.virtual_map(sel).refined(MATRIX_SIZE, MATRIX_SIZE, self.engine.window)
        return None if found is None else self._values(found, sel)

    def _values(self, found, sel):
        window = self.engine.window
        resolution = found.describe(MATRIX_SIZE, MATRIX_SIZE, window)
        if found.refined(MATRIX_SIZE, MATRIX_SIZE, window) is not None:
            resolution += "; computing this window's own…"
        title = f"sample {sel.sample}, head {sel.head}, mask {sel.mask}: weights, {resolution}"
        return found, title, "weight (max per pixel)"

    def build(self):
        raster = self.engine.add(
            "attention matrix",
            self.values,
            ["sample", "head", "mask"],
            "matrix",
            raster=(MATRIX_SIZE, MATRIX_SIZE),
            group="Attention",
            first=True,
            refine=self.exact_values,
        )
        # the words every redraw writes (colour bar, hover): what a pixel holds
        image = raster.element(hv.Dimension("weight", label=raster.value_label))
        plot = self.marked(image, "query marker", "matrix", first=True)
        style = matrix_style(self.state.colormap, title_size="10pt")
        pane = self.engine.render(plot, "matrix", style=style, linked=True, on_tap=self.click)
        self.clock.label(pane.object, x="key", y="query")
        return pn.Column(self.heading(), pane, margin=0)

    def click(self, x=None, y=None) -> None:
        """A click on the map picks the query of the clicked row."""
        if y is None:
            return
        query = int(np.clip(round(float(y)), 0, self.trace.sizes["query"] - 1))
        self.engine.soon(self.state.param.update, query=query)

    def _on_colormap(self, event) -> None:
        palette = process_cmap(event.new, 256)
        for handles in self.engine.handles("matrix", MAP_KEY):
            handles["color_mapper"].palette = palette
        if self.prefetch is not None:
            self.prefetch.layer.recolour(palette)


class LongHeads(HeadComparison):
    """Every head's map (from its overview, or its window's cells once zoomed), linked
    with the large map; a box drawn on a tile compares the heads' attention in it."""

    source = param.ClassSelector(class_=VirtualSource, doc="The virtual trace's maps and rows.")

    title = "Every head: softmax weights, max per pixel (drag a box to compare the heads)"

    def head_values(self, head: int, sel):
        return self.source.virtual_map(sel, head), f"head {head}"

    def head_refined(self, head: int, sel):
        found = self.source.virtual_map(sel, head)
        exact = found.refined(HEAD_MAP_SIZE, HEAD_MAP_SIZE, self.engine.window)
        return None if exact is None else (exact, f"head {head}")

    def mass_shares(self, sel) -> linked.MassShares:
        def shares(queries, keys):
            return windows.streamed_mass_share(
                self.trace,
                sel.sample,
                range(self.state.n_heads),
                sel.mask,
                self.source.row_lse(sel),
                queries,
                keys,
                self.source.qk(sel),
            )

        return linked.mass_shares(self.trace, sel, self.cache, self.linked.box, shares)

    def make_toggles(self):
        return pn.Spacer(height=0, margin=0)  # no merge on this page: nothing to switch off

    def make_summary(self):
        return pn.pane.Markdown(
            "Per-head summaries (distance, lag, entropy) read every cell of a sample; "
            "for a virtual trace they are not computed on the page.",
            styles={"font-size": "12px"},
            margin=(5, 5),
        )


__all__ = [
    "LongControls",
    "LongHeads",
    "LongSequence",
    "QueryRow",
    "WindowedMatrix",
]

"""The large attention matrix of the selected head and stage, and the unmasked one beside it.

The matrix is regridded by datashader from the full array for its window (see
:mod:`attnpanel.readouts.raster`); the selected query's row is a separate marker, so moving the
query never touches the image. A click on a row picks that query.
"""

from __future__ import annotations

import html

import numpy as np
import panel as pn
from bokeh.models import CustomJSHover, CustomJSTickFormatter, HoverTool, InlineStyleSheet
from holoviews.plotting.util import process_cmap
from panel.models import HTML

from attnpanel.app.prefetch import MatrixPrefetch, switch_in_browser
from attnpanel.app.scroll import MATRIX
from attnpanel.app.sections.base import Section
from attnpanel.readouts import core, summary
from attnpanel.readouts.core import MissingVariable
from attnpanel.render import model_views
from attnpanel.render.elements import MAP_KEY, PlotKey
from attnpanel.render.figures import CELL, cell_format

MATRIX_SIZE = 480  # one pixel per cell at the demo length
NOTE_CSS = ":host { font-size: 12px; color: #444; } .swatch { color: #000; }"
# Browser-side lookups of a position's clock time (the labels are data passed as args).
TICK_CODE = "const i = Math.round(tick); return (i >= 0 && i < labels.length) ? labels[i] : '';"
HOVER_CODE = (
    "const i = Math.round(value); "
    "return (i >= 0 && i < labels.length) ? i + ' (' + labels[i] + ')' : String(i);"
)


LEVEL_LABEL = 8  # characters of a key label still written level ("05-02 08:00" is slanted)
SLANTED = 0.7  # radians


def clock_axes(figure, labels: list[str], n_query: int, n_key: int) -> None:
    """Label a map's axes and hover with clock times (positions stay the coordinates)."""
    for axis, n in ((figure.xaxis, n_key), (figure.yaxis, n_query)):
        if n == len(labels):
            axis.formatter = CustomJSTickFormatter(args=dict(labels=labels), code=TICK_CODE)
    typical = sorted(map(len, labels))[len(labels) // 2] if labels else 0  # not a token's
    if n_key == len(labels) and typical > LEVEL_LABEL:
        figure.xaxis.major_label_orientation = SLANTED  # spans ("00:06–00:21") side by side
    formatter = CustomJSHover(args=dict(labels=labels), code=HOVER_CODE)
    for hover in figure.select({"type": HoverTool}):
        fields = {k: v for k, v in (hover.formatters or {}).items() if k not in ("$x", "$y")}
        if n_key == len(labels):
            fields["$x"] = formatter
        if n_query == len(labels):
            fields["$y"] = formatter
        hover.formatters = fields
        tips = list(hover.tooltips or [])
        names = [name for name, _ in tips]
        names = names if len(names) == 3 else ["key", "query", "value"]
        value = tips[2][1] if len(tips) == 3 else CELL + "{custom}"
        if value.startswith(CELL):
            fields.setdefault(CELL, cell_format("Attention"))
        hover.tooltips = [  # the names the map gave (key, query, its value's own), as clocks
            (names[0], "$x{custom}" if "$x" in fields else "$x{0}"),
            (names[1], "$y{custom}" if "$y" in fields else "$y{0}"),
            (names[2], value),
        ]


def clock_key_axis(figure, labels: list[str]) -> None:
    """Label a chart's key axis with clock times (a bar per key: the query's weights)."""
    figure.xaxis.formatter = CustomJSTickFormatter(args=dict(labels=labels), code=TICK_CODE)
    if sorted(map(len, labels))[len(labels) // 2] > LEVEL_LABEL:
        figure.xaxis.major_label_orientation = SLANTED


def set_clock_labels(figure, labels: list[str]) -> None:
    """Point a map's time formatters at another sample's clock times."""
    formatters = [figure.xaxis[0].formatter, figure.yaxis[0].formatter]
    for hover in figure.select({"type": HoverTool}):
        formatters.extend(dict(hover.formatters or {}).values())
    for model in formatters:  # the clock's formatters, not the others (a value's range)
        if isinstance(model, CustomJSTickFormatter | CustomJSHover) and "labels" in model.args:
            model.args = {**model.args, "labels": labels}


def matrix_style(
    cmap: str | None, title_size: str = "12pt", size: int = MATRIX_SIZE, **more
) -> dict:
    """How a map looks (``attnpanel.render.figures.draw``'s keywords): ``size`` px square
    (the large matrix's 480 by default), a colour bar, a toolbar with the map tools (wheel
    zoom); ``cmap`` None: the group's own."""
    return dict(
        frame_width=size,
        frame_height=size,
        cmap=cmap,
        colorbar=True,
        toolbar=True,
        map_tools=True,
        title_size=title_size,
        **more,
    )


class PositionMap(Section):
    """A section of maps over the trace's positions (rows: queries, columns: keys): clock
    times on their axes and in their hover, and a click on a row picks that query."""

    # the group of the maps it labels, and the (pane, key) of each
    map_group = "Attention"
    map_panes: tuple[tuple[str, PlotKey], ...] = ()

    def __init__(self, **params):
        super().__init__(**params)
        self.engine.follow(self._relabel_axes, ["sample", "layer"])
        self.engine.on_render(self._on_render)

    def click(self, x=None, y=None) -> None:
        """What a click on a map does: pick the query of the clicked row, and the clicked
        cell's key as the cell "why this cell" explains."""
        if y is None:
            return
        n_query, n_key = self.trace.sizes["query"], self.trace.sizes["key"]
        picked = dict(query=int(np.clip(round(float(y)), 0, n_query - 1)))
        if x is not None:
            picked["why_key"] = int(np.clip(round(float(x)), 0, n_key - 1))
        self.engine.soon(self.state.param.update, **picked)

    def _on_render(self, figure, element, handles) -> None:
        if getattr(element, "group", "") != self.map_group:
            return  # (every figure of the page comes here: the clock only for its maps)
        labels = core.clock_labels(self.trace, self.state.sample)
        if labels is None:
            return
        clock_axes(figure, labels, self.trace.sizes["query"], self.trace.sizes["key"])

    def _ticks(self) -> dict:
        """A token trace's maps: each position's token on both axes (the style's ticks)."""
        ticks = model_views.token_ticks(self.trace, self.state.sample)
        if not ticks:
            return {}
        pairs = list(ticks.items())
        return dict(xticks=pairs, yticks=pairs, xrotation=90)

    def _relabel_axes(self, *_events) -> None:
        """The shown sample's clock times, or tokens, on every map of the section."""
        labels = core.clock_labels(self.trace, self.state.sample)
        ticks = model_views.token_ticks(self.trace, self.state.sample)
        overrides = {int(k): v for k, v in (ticks or {}).items()}
        for pane, key in self.map_panes:
            for handles in self.engine.handles(pane, key):
                if labels is not None:
                    set_clock_labels(handles["plot"], labels)
                for axis in ("xaxis", "yaxis"):
                    if overrides and axis in handles:
                        handles[axis].major_label_overrides = overrides


class AttentionMatrix(PositionMap):
    """The matrix, its colour map, token tick labels, and the side-by-side unmasked copy."""

    title = "Attention matrix (click a cell to pick its query and key)"
    map_panes = (("matrix", MAP_KEY), ("unmasked", MAP_KEY))

    def __init__(self, **params):
        super().__init__(**params)
        self._unmasked = None
        self._beside = None
        self.prefetch: MatrixPrefetch | None = None  # the matrix's maps sent ahead
        self.state.param.watch(self._on_colormap, "colormap")
        self.state.param.watch(self._on_side_by_side, "side_by_side")

    def build(self):
        try:
            main = self._matrix("matrix")
        except MissingVariable as err:
            return pn.Column(self.missing(err, MATRIX_SIZE))
        # what black is, under the map (the hover says it of each cell): Panel's HTML model
        # as the tables have it (a pane brought Panel's design style sheets from its CDN
        # into an offline notebook), of a fixed size (new words lay nothing out again)
        self.note = HTML(
            width=MATRIX_SIZE + 40,
            height=34,
            disable_math=True,
            run_scripts=False,
            stylesheets=[InlineStyleSheet(css=NOTE_CSS)],
        )
        self._renote()
        self.engine.follow(self._renote, ["sample", "mask", "stage", "layer"])
        # Hidden (and taking no room) until side_by_side; built the first time it shows.
        self._beside = pn.Column(
            self.heading("Without mask"),  # a heading as the matrix's: the maps level
            margin=0,
            visible=self.state.param.side_by_side,
        )
        if self.state.side_by_side:
            self._show_unmasked()
        note = pn.pane.Bokeh(self.note, margin=(0, 10))
        return pn.Row(
            pn.Column(self.heading(), main, note, margin=0),
            self._beside,
            margin=0,
            css_classes=[MATRIX],  # what a click that opens a head far below scrolls to
        )

    def _renote(self) -> None:
        """The note's words for the shown map (escaped once more, as Panel sends HTML)."""
        words = summary.blocked_note(self.trace, self.state.selection)
        shown = f"<span class='swatch'>■</span> {html.escape(words)}" if words else ""
        self.note.text = html.escape(shown)

    def _show_unmasked(self) -> None:
        if self._unmasked is None:
            self._unmasked = self._matrix(
                "unmasked", mask_override="none", active=lambda: self.state.side_by_side
            )
            self._beside.append(self._unmasked)

    def _matrix(self, pane: str, mask_override=None, active=None):
        def build(sel):
            if mask_override is not None:
                sel = sel.with_(mask=mask_override)
            return (
                core.attention_values(self.trace, sel, self.cache),
                core.matrix_title(self.trace, sel),
                core.stage_label(self.trace, sel.stage),
            )

        parameters = {"sample", "head", "mask", "stage", "enabled_heads"}
        if mask_override is not None:
            parameters.discard("mask")
        raster = self.engine.add(
            "attention matrix",
            build,
            parameters,
            pane,
            raster=(MATRIX_SIZE, MATRIX_SIZE),
            active=active,
            group="Attention",
            first=True,
        )
        image = raster.element(core.stage_label(self.trace, self.state.stage))
        plot = self.marked(image, "query marker", pane, active=active, first=True)
        style = matrix_style(self.state.colormap, **self._ticks())
        # zooms with the head maps
        return self.engine.render(plot, pane, style=style, linked=True, on_tap=self.click)

    def switch_in_browser(self, widgets: dict, bars: str | None = None) -> None:
        """Let the head, stage and mask widgets redraw the matrix in the browser from maps
        sent ahead while the page is idle, and the query widget the query's weights bars
        drawn in pane ``bars`` (:func:`attnpanel.app.prefetch.switch_in_browser`)."""
        if self.prefetch is None:
            self.prefetch = switch_in_browser(self.engine, widgets, bars=bars)

    def _on_colormap(self, event) -> None:
        palette = process_cmap(event.new, 256)
        for pane in ("matrix", "unmasked"):
            for handles in self.engine.handles(pane, MAP_KEY):
                handles["color_mapper"].palette = palette
        if self.prefetch is not None:
            self.prefetch.layer.recolour(palette)

    def _on_side_by_side(self, event) -> None:
        if not event.new or self._layout is None:
            return
        if self._unmasked is None:
            self._show_unmasked()  # drawn with the current selection
        else:
            self.engine.redraw(lambda view: view.pane == "unmasked")

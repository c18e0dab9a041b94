"""The attention explorer: one Panel ``Viewer`` that binds every view of a trace.

``AttentionExplorer(trace)`` exposes the selection (sample, head, query, mask, stage,
enabled heads, colour map ...) as ``param`` parameters. Each view of ``attnpanel.views``
is rendered once by HoloViews (styled by ``views.options``); a parameter change then
re-runs only the views that depend on it and writes their new data straight into the
rendered Bokeh data sources (captured by a plot hook), so no figure is rebuilt and no
HoloViews re-render runs on the hot path. That path costs ~1 ms per plot, where a
``DynamicMap`` refresh measured 25-45 ms per plot here: with ten plots depending on the
query, the difference is the latency budget (see ``docs/explorer.md``).

The large attention matrix is rasterized by datashader from the full array; the selected
query row is a separate annotation, so moving the query never touches the image.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from dataclasses import dataclass
from functools import partial

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401 - registers the Bokeh backend and its options
import numpy as np
import panel as pn
import param
import xarray as xr
from holoviews.plotting.util import process_cmap
from panel.io.notebook import push_notebook
from panel.io.state import set_curdoc

from attnpanel import explorer_model, linked, model_views, untrusted, views
from attnpanel.attention import MASK_MODES
from attnpanel.trace import STAGES, mask_options
from attnpanel.views import MissingVariable, Selection, StageCache

log = logging.getLogger(__name__)
hv.Store.set_current_backend("bokeh")

COLORMAPS = ("coolwarm", "RdBu_r", "bwr", "fire", "viridis")
STAGE_NAMES = {"raw scores": "raw", "scaled": "scaled", "masked": "masked", "softmax": "softmax"}
MATRIX_SIZE = 520
HEAD_MAP_SIZE = 150
SELECTION_PARAMS = ("sample", "head", "query", "mask", "stage", "enabled_heads", "layer")
IMAGE_PARAMS = {"sample", "head", "mask", "stage", "layer"}
SECONDARY_DELAY_MS = 120
QUERY_DELAY_MS = 30
RECT_COLUMNS = {"left": "x0", "right": "x1", "bottom": "y0", "top": "y1"}


def _ms(value) -> float:
    """Bokeh's number for an axis value: datetimes become milliseconds since the epoch."""
    if isinstance(value, np.datetime64):
        return float(value.astype("datetime64[ns]").astype(np.int64) / 1e6)
    return float(value)


@dataclass
class _Raster:
    """A rasterized image on the hot path: the array the Bokeh Image glyph draws.

    Building an ``hv.Image`` costs ~20 ms of parameter validation; the nine images a mask
    change redraws skip it and only the first render goes through HoloViews.
    """

    values: np.ndarray  # float32, rows by ascending y
    bounds: tuple  # (left, bottom, right, top)
    group: str
    label: str
    value_label: str = ""  # the colour bar's title

    def element(self, vdim: str = "value") -> hv.Image:
        return hv.Image(
            self.values[::-1],
            bounds=self.bounds,
            kdims=["key", "query"],
            vdims=[vdim],
            group=self.group,
            label=self.label,
        ).opts(clim=views.image_limits(self.values, self.group))  # as every update sets it


def _layer_key(element) -> tuple[str, str, str]:
    # Labels change with the selection (they carry the titles) except for the sequence
    # curves, whose labels name the appliance.
    if isinstance(element, _Raster):
        return "Image", element.group, ""
    label = element.label if element.group == "Sequence" else ""
    return type(element).__name__, element.group, label


URL_PARAMS = ("sample", "head", "query", "mask", "stage")  # mirrored in the page URL


@dataclass
class _View:
    """One view on the hot path: how to build it and where its output is drawn."""

    name: str
    build: object  # Selection -> hv element
    parameters: frozenset
    pane: str  # the key of the rendered plot the view draws into
    raster: tuple[int, int] | None = None  # build gives (values, label): rasterize to this
    title: bool = True  # whether the element's label is the plot's title
    active: object = None  # () -> bool; skipped while False (a hidden plot)
    pane_group: str = ""  # group of the rasterized image (Attention, HeadMap)
    first: bool = False  # drawn in the same message as the change, before the others


class AttentionExplorer(pn.viewable.Viewer):
    """Explore every stage of one multi-head attention layer captured in a trace.

    Parameters
    ----------
    trace : xarray.Dataset
        A trace (see ``attnpanel.trace``); only ``weights`` is required, views that need
        missing variables say so in their place.
    **params
        Initial values of the parameters below.
    """

    sample = param.Integer(default=0, bounds=(0, 0), doc="Sample (batch index) shown.")
    head = param.Selector(
        default=0,
        objects=[0, "mean"],
        doc='Head of the large matrix, or "mean" of the enabled heads.',
    )
    query = param.Integer(default=0, bounds=(0, 0), doc="Selected query position.")
    mask = param.Selector(
        default="none",
        objects=list(MASK_MODES),
        doc="Mask mode; weights are recomputed live from q and k.",
    )
    stage = param.Selector(
        default="softmax",
        objects=list(STAGES),
        doc="Stage of the score-to-weight pipeline in the large matrix.",
    )
    enabled_heads = param.ListSelector(
        default=[], objects=[], doc="Heads kept in the merge and the output."
    )
    colormap = param.Selector(
        default="coolwarm",
        objects=list(COLORMAPS),
        doc="Colour map of the large matrix (low to high).",
    )
    side_by_side = param.Boolean(
        default=False, doc="Show the matrix without a mask beside the masked one."
    )
    show_appliances = param.Boolean(
        default=True, doc="Overlay each appliance's ground truth on the top view."
    )
    layer = param.Integer(
        default=0,
        bounds=(0, 0),
        doc="Layer shown, for a trace with a `layer` dim: every view follows.",
    )
    show_positional = param.Boolean(
        default=False,
        doc=(
            "Show the sinusoidal positional encoding; on at start when the trace's attribute "
            "`positional_encoding` is 'sinusoidal'."
        ),
    )
    show_head_average = param.Boolean(
        default=False,
        doc=("Show the head average (what nn.MultiheadAttention returns) beside the head maps."),
    )
    last_error = param.String(default="", doc="The last error a callback reported.")

    def __init__(self, trace: xr.Dataset, **params):
        if not isinstance(trace, xr.Dataset) or "weights" not in trace:
            raise ValueError("AttentionExplorer needs a trace: an xarray.Dataset with 'weights'")
        if trace["weights"].size == 0:
            sizes = ", ".join(f"{d}={n}" for d, n in trace["weights"].sizes.items())
            raise ValueError(f"this trace is empty ({sizes}): there is no attention to show")
        self.layers = trace if "layer" in trace.dims else None  # every layer, for the model view
        trace = explorer_model.current_layer(trace, params.get("layer", 0))
        params.setdefault("show_positional", model_views.uses_sinusoidal(trace))
        self.trace = trace
        self.cache = StageCache() if self.layers is None else model_views.LayerCache()
        n_batch, n_heads = trace.sizes["batch"], trace.sizes["head"]
        masks = mask_options(trace)
        own_mask = trace.attrs.get("mask", "none")
        late = {
            n: params.pop(n)
            for n in ("sample", "head", "query", "mask", "enabled_heads", "layer")
            if n in params
        }
        super().__init__(**params)
        if self.layers is not None:
            self.param.layer.bounds = (0, self.layers.sizes["layer"] - 1)
            self.cache.layer = late.get("layer", 0)
        self.param.sample.bounds = (0, n_batch - 1)
        self.param.query.bounds = (0, trace.sizes["query"] - 1)
        self.param.head.objects = list(range(n_heads)) + ["mean"]
        self.param.mask.objects = masks
        self.param.enabled_heads.objects = list(range(n_heads))
        with param.parameterized.discard_events(self):
            self.mask = own_mask if own_mask in masks else masks[0]
            self.enabled_heads = list(range(n_heads))
        self.param.update(**late)
        self._views: list[_View] = []
        self._handles: dict[str, dict[tuple, list[dict]]] = {}
        self._layout = None
        self._unmasked = None
        self._pending: dict[int, _View] = {}
        self._scheduled = False
        self.linked = linked.LinkedMaps(self)  # linked zoom and box select of the maps
        self.param.watch(self._on_change, list(SELECTION_PARAMS) + ["show_appliances"])
        self.param.watch(self._on_colormap, "colormap")
        self.param.watch(self._on_side_by_side, "side_by_side")

    @property
    def selection(self) -> Selection:
        """The current selection as a plain value (what the views read)."""
        return Selection(
            sample=self.sample,
            head=self.head,
            query=self.query,
            mask=self.mask,
            stage=self.stage,
            enabled_heads=tuple(sorted(self.enabled_heads)),
        )

    def _report(self, err: BaseException, where: str) -> None:
        """Show an error as a notification and log it; the session goes on."""
        message = f"{where} failed: {err}"
        log.error("%s\n%s", message, "".join(traceback.format_exception(err)))
        self.last_error = message
        if pn.state.notifications is not None:
            pn.state.notifications.error(untrusted.html_text(message), duration=8000)

    def _capture(self, pane: str):
        """A HoloViews hook that records the Bokeh handles of each layer drawn into ``pane``.

        It holds the explorer weakly: HoloViews caches the options that carry it for the
        life of the process, and a closed session's explorer must be freed.
        """
        explorer = weakref.ref(self)

        def hook(plot, element):
            owner = explorer()
            if owner is None:
                return
            plot.state.output_backend = "webgl"
            if plot.state.toolbar is not None:
                # shown while the mouse is over the plot: at rest it hid small plots' titles
                plot.state.toolbar.autohide = True
            if element.group == "Marker" and isinstance(element, hv.HSpan | hv.VLine):
                # Overlay-level annotations repaint on the 2D overlay canvas alone: moving
                # the query never redraws the WebGL image or curves beneath (~30-60 ms each
                # with software GL).
                plot.handles["glyph"].level = "overlay"
            if isinstance(element, hv.Overlay):
                # HoloViews sets an overlay's active tools after its layers' hooks ran
                owner.linked.restore_drag(plot.state)
            key = ("Overlay", "", "") if isinstance(element, hv.Overlay) else _layer_key(element)
            found = owner._handles.setdefault(pane, {}).setdefault(key, [])
            if not any(h is plot.handles for h in found):
                found.append(plot.handles)
                owner.linked.attach(plot, element)

        return hook

    def _render(self, element, pane: str, **pane_kw):
        """Style an element once, hook every layer and wrap it in a HoloViews pane."""
        hook = self._capture(pane)
        kinds = {
            type(layer).__name__
            for layer in (element if isinstance(element, hv.Overlay) else [element])
        }
        hooks = [getattr(hv.opts, kind)(hooks=[hook]) for kind in kinds]
        if isinstance(element, hv.Overlay):
            hooks.append(hv.opts.Overlay(hooks=[hook]))
        element = element.opts(*hooks)
        pane_kw.setdefault("linked_axes", False)
        return pn.pane.HoloViews(element, **pane_kw)

    def _add(
        self,
        name,
        build,
        parameters,
        pane,
        raster=None,
        title=True,
        active=None,
        group="",
        first=False,
    ):
        """Register a hot-path view and return its first element (already rasterized)."""
        view = _View(name, build, frozenset(parameters), pane, raster, title, active, group, first)
        element = self._element(view, self.selection)
        self._views.append(view)
        return element

    def _marked(self, image: hv.Image, name: str, pane: str, **add) -> hv.Overlay:
        """``image`` with the selected query's row boxed (a hot-path view of its own)."""
        ds = self.trace
        marker = self._add(
            name, lambda sel: views.query_marker(ds, sel), ["query"], pane, title=False, **add
        )
        return (image * marker).relabel(image.label).opts(*views.options())

    def _element(self, view: _View, sel: Selection):
        if view.raster is None:
            return view.build(sel)
        values, label, *value_label = view.build(sel)
        raster, bounds = self.linked.rasterize(view, values)  # the zoomed window, if any
        return _Raster(raster, bounds, view.pane_group, label, "".join(value_label))

    def _on_change(self, *events) -> None:
        changed = {event.name for event in events}
        sel = self.selection
        if "enabled_heads" in changed:
            self._recolor_head_maps()
        if "layer" in changed:
            explorer_model.switch_layer(self)  # every view reads the new layer
        due = [v for v in self._views if v.parameters & changed or "layer" in changed]
        doc = pn.state.curdoc
        if doc is None or doc.session_context is None:
            for view in due:
                self._refresh(view, sel)
            if self._layout is not None:
                # In a notebook, Bokeh models edited in place reach the page only when
                # pushed (a server session syncs them by itself).
                push_notebook(self._layout)
            return
        # Panel sends a change's model updates together when its callback returns: the
        # large matrix and the query markers go now, the other views later, so what the
        # user acts on repaints first. A new image takes the browser ~100 ms to map and
        # paint (software GL); the other views' updates would block that frame, so they
        # wait that long (a moved marker is cheap: 30 ms). Pending views coalesce across
        # fast events (a dragged slider).
        with pn.io.hold(doc):  # one message for all of them, not one per property
            for view in due:
                if view.first:
                    self._refresh(view, sel)
                else:
                    self._pending[id(view)] = view
        if self._pending and not self._scheduled:
            self._scheduled = True
            callback = partial(self._refresh_pending, doc)
            # A timeout, not the next tick: the held priority message is flushed on a
            # next tick too and must go out before the other views are computed.
            delay = SECONDARY_DELAY_MS if changed & IMAGE_PARAMS else QUERY_DELAY_MS
            doc.add_timeout_callback(callback, delay)

    def _refresh_pending(self, doc) -> None:
        self._scheduled = False
        pending, self._pending = list(self._pending.values()), {}
        sel = self.selection
        with set_curdoc(doc), pn.io.hold(doc):
            for view in pending:
                self._refresh(view, sel)

    def _refresh(self, view: _View, sel: Selection) -> None:
        if view.active is not None and not view.active():
            return
        try:
            self._draw(view, self._element(view, sel))
        except Exception as err:  # noqa: BLE001 - any failure goes to the user, not the log only
            self._report(err, f"updating the {view.name}")

    def _draw(self, view: _View, element) -> None:
        """Write an element's data into the Bokeh models already on the page."""
        captured = self._handles.get(view.pane, {})
        layers = list(element) if isinstance(element, hv.Overlay) else [element]
        present = set()
        figures = {}
        for layer in layers:
            key = _layer_key(layer)
            present.add(key)
            if key[1] == "Lanes":
                continue  # the lane shading never changes
            for handles in captured.get(key, []):
                extent = _push(handles, layer)
                figure = handles["plot"]
                if "glyph_renderer" in handles:
                    handles["glyph_renderer"].visible = True
                if extent is not None:
                    lo, hi = figures.get(id(figure), (figure, (np.inf, -np.inf)))[1]
                    figures[id(figure)] = (figure, (min(lo, extent[0]), max(hi, extent[1])))
                else:
                    figures.setdefault(id(figure), (figure, None))
        # Appliance curves switched off are hidden, but only by a redraw of the curves
        # themselves: the query marker shares their pane and must not hide them.
        redrawn_sequence = any(key[1] == "Sequence" for key in present)
        for key, found in captured.items():
            if redrawn_sequence and key[1] == "Sequence" and key not in present:
                for handles in found:
                    handles["glyph_renderer"].visible = False
        for figure, extent in figures.values():
            if view.title:
                figure.title.text = element.label
            if extent is not None and np.isfinite(extent).all():
                pad = 0.06 * (extent[1] - extent[0]) or 1.0
                figure.y_range.start, figure.y_range.end = extent[0] - pad, extent[1] + pad

    def _on_colormap(self, event) -> None:
        palette = process_cmap(event.new, 256)
        for pane in ("matrix", "unmasked"):
            for handles in self._handles.get(pane, {}).get(("Image", "Attention", ""), []):
                handles["color_mapper"].palette = palette

    def _recolor_head_maps(self) -> None:
        for head in range(self.trace.sizes["head"]):
            enabled = head in self.enabled_heads
            palette = views.head_cmap(head, enabled)
            for handles in self._handles.get(f"head {head}", {}).get(("Image", "HeadMap", ""), []):
                handles["color_mapper"].palette = palette
                handles["plot"].title.text = f"head {head}" + ("" if enabled else " (off)")
        for head, toggle in enumerate(getattr(self, "_head_toggles", [])):
            toggle.value = head in self.enabled_heads

    def _on_side_by_side(self, event) -> None:
        if event.new and self._unmasked is not None:
            for view in self._views:
                if view.pane == "unmasked":
                    self._refresh(view, self.selection)

    def _missing(self, err: MissingVariable, width: int, height: int = 80):
        return pn.pane.Alert(
            untrusted.html_text(err.message),
            alert_type="warning",
            width=width,
            min_height=height,
            margin=5,
        )

    def _bars(self, name, build, parameters, width, height):
        """A bar-chart view, or an alert naming the variable it lacks."""
        try:
            element = self._add(name, build, parameters, name)
        except MissingVariable as err:
            return self._missing(err, width)
        element = element.opts(*views.options(width, height))
        small = dict(width=width, height=height, toolbar=None, fontsize={"title": 10})
        element = element.opts(
            hv.opts.Rectangles(**small),
            hv.opts.Curve(**small),
            hv.opts.HeatMap(**small, colorbar=False),
        )
        return self._render(element, name, width=width + 10, height=height + 10, margin=0)

    def _top_view(self):
        ds = self.trace
        if "token" in ds.coords:
            return explorer_model.token_strip(self)
        curves = self._add(
            "sequence view",
            lambda sel: views.sequence_curve(ds, sel, show_appliances=self.show_appliances),
            ["sample", "show_appliances"],
            "sequence",
        )
        # Every appliance curve is drawn once; switching them off hides their renderers.
        curves = views.sequence_curve(ds, self.selection, show_appliances=True)
        marker = self._add(
            "position marker",
            lambda sel: views.position_marker(ds, sel),
            ["sample", "query"],
            "sequence",
            title=False,
            first=True,
        )
        colors = ["black"] + list(views.APPLIANCE_COLORS)
        for i, curve in enumerate(curves):
            curve.opts(
                color=colors[i % len(colors)],
                line_width=1.6 if i == 0 else 1,
                visible=i == 0 or self.show_appliances,
            )
        plot = (curves * marker).relabel(curves.label).opts(*views.options())
        plot = plot.opts(
            hv.opts.Curve(responsive=True, height=210),
            hv.opts.Overlay(responsive=True, height=210, show_legend=True, legend_position="right"),
        )
        tap = hv.streams.Tap(source=plot, transient=True)
        tap.add_subscriber(self._on_top_tap)
        self._top_tap = tap
        return self._render(
            plot, "sequence", sizing_mode="stretch_width", height=220, margin=(0, 5)
        )

    def _on_top_tap(self, x=None, y=None):
        if x is None:
            return
        try:
            self._select_query(views.position_from_x(self.trace, self.selection, x))
        except Exception as err:  # noqa: BLE001
            self._report(err, "selecting the query on the top view")

    def _on_matrix_tap(self, x=None, y=None):
        if y is None:
            return
        try:
            self._select_query(int(np.clip(round(float(y)), 0, self.trace.sizes["query"] - 1)))
        except Exception as err:  # noqa: BLE001
            self._report(err, "selecting the query on the matrix")

    def _select_query(self, query: int) -> None:
        # HoloViews runs stream callbacks outside the Bokeh document lock; model changes
        # there would be refused, so the change is made on the document's next tick.
        doc = pn.state.curdoc
        if doc is None or doc.session_context is None:
            self.query = query
        else:
            doc.add_next_tick_callback(partial(self.param.update, query=query))

    def _projection_column(self):
        ds = self.trace
        width = 330
        items = [pn.pane.Markdown("### Q/K/V projection", margin=(0, 5))]
        items.append(
            self._bars(
                "input vector",
                lambda sel: views.input_vector(ds, sel),
                ["sample", "query"],
                width,
                125,
            )
        )
        heatmaps = []
        for name in ("w_q", "w_k", "w_v"):
            try:
                image = views.weight_heatmap(ds, name)
            except MissingVariable as err:
                heatmaps.append(self._missing(err, 105, 110))
                continue
            image = image.opts(*views.options()).opts(
                width=112,
                height=118,
                colorbar=False,
                xaxis=None,
                yaxis=None,
                toolbar=None,
                fontsize={"title": 9},
            )
            heatmaps.append(self._render(image, name, width=114, height=120, margin=1))
        items.append(pn.Row(*heatmaps, margin=0))
        for name in ("q", "k", "v"):
            items.append(
                self._bars(
                    f"{name.upper()} vector",
                    lambda sel, name=name: views.projection_vector(ds, sel, name),
                    ["sample", "query"],
                    width,
                    112,
                )
            )
        return pn.Column(*items, width=width + 15)

    def _matrix(self, pane: str, mask_override=None, active=None):
        ds = self.trace

        def build(sel):
            if mask_override is not None:
                sel = sel.with_(mask=mask_override)
            return (
                views.attention_values(ds, sel, self.cache),
                views.matrix_title(ds, sel),
                views.STAGE_LABELS[sel.stage],
            )

        parameters = {"sample", "head", "mask", "stage", "enabled_heads"}
        if mask_override is not None:
            parameters.discard("mask")
        image = self._add(
            "attention matrix",
            build,
            parameters,
            pane,
            raster=(MATRIX_SIZE, MATRIX_SIZE),
            active=active,
            group="Attention",
            first=True,
        )
        image = image.element(views.STAGE_LABELS[self.stage])
        plot = self._marked(image, "query marker", pane, active=active, first=True).opts(
            hv.opts.Image(
                frame_width=MATRIX_SIZE,
                frame_height=MATRIX_SIZE,
                cmap=self.colormap,
                tools=["hover", "tap"],
                default_tools=["pan", "wheel_zoom", "box_zoom", "reset", "save"],
                **explorer_model.matrix_ticks(self),
            ),
        )
        tap = hv.streams.Tap(source=plot, transient=True)
        tap.add_subscriber(self._on_matrix_tap)
        self._taps = getattr(self, "_taps", []) + [tap]
        return self._render(plot, pane, margin=0, linked_axes=True)  # zooms with the heads

    def _matrix_column(self):
        try:
            main = self._matrix("matrix")
        except MissingVariable as err:
            return pn.Column(self._missing(err, MATRIX_SIZE))

        def unmasked(side_by_side):
            if not side_by_side:
                return pn.Spacer(width=0)
            if self._unmasked is None:
                self._unmasked = self._matrix(
                    "unmasked", mask_override="none", active=lambda: self.side_by_side
                )
            return pn.Column(pn.pane.Markdown("**without mask**", margin=(0, 5)), self._unmasked)

        return pn.Row(
            pn.Column(pn.pane.Markdown("### Attention matrix", margin=(0, 5)), main),
            pn.panel(pn.bind(unmasked, self.param.side_by_side)),
        )

    def _aggregation_column(self):
        ds = self.trace
        width = 380
        params = ["sample", "head", "query", "mask", "enabled_heads"]
        return pn.Column(
            pn.pane.Markdown("### Value aggregation", margin=(0, 5)),
            self._bars(
                "aggregation weights",
                lambda sel: views.aggregation_weights(ds, sel, self.cache),
                params,
                width,
                180,
            ),
            self._bars(
                "top values", lambda sel: views.top_values(ds, sel, self.cache), params, width, 190
            ),
            self._bars(
                "context vector",
                lambda sel: views.context_vector(ds, sel, self.cache),
                params,
                width,
                140,
            ),
            width=width + 15,
        )

    def _head_comparison(self):
        ds = self.trace
        cells = []
        self._head_toggles = []
        for head in range(ds.sizes["head"]):
            pane = f"head {head}"
            try:
                image = self._add(
                    f"head {head} map",
                    lambda sel, head=head: (
                        views.attention_values(
                            ds, sel.with_(head=head, stage="softmax"), self.cache
                        ),
                        f"head {head}" + ("" if head in self.enabled_heads else " (off)"),
                    ),
                    ["sample", "mask"],
                    pane,
                    raster=(HEAD_MAP_SIZE, HEAD_MAP_SIZE),
                    group="HeadMap",
                ).element("weight")
            except MissingVariable as err:
                cells.append(self._missing(err, HEAD_MAP_SIZE, HEAD_MAP_SIZE))
                continue
            image = self._marked(image, f"head {head} query marker", pane).opts(  # as on the matrix
                hv.opts.Image(
                    frame_width=HEAD_MAP_SIZE,
                    frame_height=HEAD_MAP_SIZE,
                    fontsize={"title": 10},
                    cmap=views.head_cmap(head, head in self.enabled_heads),
                ),
                hv.opts.Overlay(fontsize={"title": 10}),
            )
            toggle = pn.widgets.Toggle(
                label=f"head {head}",
                value=head in self.enabled_heads,
                width=HEAD_MAP_SIZE,
                margin=(0, 5),
                stylesheets=[_toggle_css(views.head_color(head))],
            )
            toggle.param.watch(lambda event, head=head: self._toggle_head(head, event.new), "value")
            self._head_toggles.append(toggle)
            cells.append(
                pn.Column(self._render(image, pane, linked_axes=True, margin=0), toggle, margin=0)
            )
        return pn.Column(
            pn.pane.Markdown(
                "### Head comparison: softmax weights per head (switch a head "
                "off to drop it from the merge)",
                margin=(0, 5),
            ),
            # Wraps onto a second line for models with more heads than fit (MiniLM has 12).
            # A wrapping Row, not pn.FlexBox: nested in another layout (the DataTree
            # explorer, a notebook cell) a FlexBox's figures never report painted, the
            # page never becomes idle, and Panel then drops every later update.
            pn.Row(
                *cells,
                *explorer_model.head_average_cells(self),
                margin=0,
                sizing_mode="stretch_width",
                stylesheets=[":host { flex-wrap: wrap; }"],
            ),
            *self.linked.section(),
        )

    def _toggle_head(self, head: int, on: bool) -> None:
        enabled = set(self.enabled_heads) | {head} if on else set(self.enabled_heads) - {head}
        if sorted(enabled) != sorted(self.enabled_heads):
            self.enabled_heads = sorted(enabled)

    def _merge_row(self):
        ds = self.trace
        params = ["sample", "query", "mask", "enabled_heads"]
        merge = self._bars(
            "head merge", lambda sel: views.head_merge(ds, sel, self.cache), params, 430, 170
        )
        try:
            wo = (
                views.weight_heatmap(ds, "w_o")
                .opts(*views.options())
                .opts(width=190, height=170, colorbar=False, toolbar=None)
            )
            wo = self._render(wo, "w_o", width=200, margin=0)
        except MissingVariable as err:
            wo = self._missing(err, 190)
        output = self._bars(
            "output", lambda sel: views.output_change(ds, sel, self.cache), params, 480, 170
        )
        return pn.Row(
            merge,
            pn.pane.Markdown("## →", margin=(60, 5)),
            wo,
            pn.pane.Markdown("## →", margin=(60, 5)),
            output,
        )

    def _controls(self):
        n_heads = self.trace.sizes["head"]
        head_options = {f"head {h}": h for h in range(n_heads)}
        head_options["mean of heads"] = "mean"
        widgets = dict(
            sample=pn.widgets.IntSlider.from_param(self.param.sample, name="Sample", width=180),
            head=pn.widgets.Select.from_param(
                self.param.head, name="Head", options=head_options, width=140
            ),
            query=pn.widgets.IntSlider.from_param(self.param.query, name="Query", width=260),
            mask=pn.widgets.Select.from_param(self.param.mask, name="Mask", width=120),
            stage=pn.widgets.Select.from_param(
                self.param.stage, name="Stage", options=STAGE_NAMES, width=130
            ),
            colormap=pn.widgets.Select.from_param(self.param.colormap, name="Colormap", width=120),
        )
        player = pn.widgets.Player(
            label="Stage player",
            start=0,
            end=len(STAGES) - 1,
            value=STAGES.index(self.stage),
            interval=1200,
            loop_policy="loop",
            show_loop_controls=False,
            width=200,
            visible_buttons=["previous", "play", "pause", "next"],
        )
        player.param.watch(lambda e: self.param.update(stage=STAGES[e.new]), "value")
        self.param.watch(lambda e: setattr(player, "value", STAGES.index(e.new)), "stage")
        side = pn.widgets.Checkbox.from_param(
            self.param.side_by_side, name="masked and unmasked side by side"
        )
        self._widgets = dict(widgets, player=player, side_by_side=side)
        for widget in widgets.values():
            # Panel waits 50 ms after a widget change for more (Reactive._debounce), a third
            # of the 150 ms budget; these changes are discrete, so they go at once. The
            # explorer coalesces its own deferred updates instead.
            widget._debounce = 0
        return pn.Row(
            *explorer_model.layer_widgets(self),
            *widgets.values(),
            player,
            pn.Column(pn.Spacer(height=18), side),
        )

    def _shape_table(self):
        # The masking step names no mask: the page's Mask selector says which is shown. A
        # table that named it went stale (Bokeh's DataTable kept drawing the first mask
        # after its source changed), and a text pane redrawn in a notebook fetched Panel's
        # stylesheets from its CDN.
        table = views.shape_table(self.trace, mask="selected above")
        return pn.Column(
            pn.pane.Markdown("### Shapes of every step", margin=(0, 5)),
            pn.pane.HoloViews(table.opts(width=1000, height=320), width=1010),
        )

    def _build(self):
        ds = self.trace
        title = (str(ds.attrs.get("source", "")).strip() or "trace").splitlines()[0][:100]
        show = pn.widgets.Checkbox.from_param(
            self.param.show_appliances, name="show appliance truth", visible="appliance_power" in ds
        )
        self._widgets_extra = dict(show_appliances=show)
        return pn.Column(
            pn.pane.Markdown(f"## attnpanel · {untrusted.markup(title)}", margin=(0, 10)),
            self._controls(),
            pn.Row(
                show,
                *explorer_model.toggles(self),
                pn.pane.Markdown(
                    "Click the curve (or a token) or a row of the matrix to pick the query.",
                    margin=(0, 10),
                ),
            ),
            self._top_view(),
            pn.Row(self._projection_column(), self._matrix_column(), self._aggregation_column()),
            *explorer_model.sections(self),
            self._head_comparison(),
            pn.pane.Markdown("### Head merge and output projection", margin=(0, 5)),
            self._merge_row(),
            self._shape_table(),
            sizing_mode="stretch_width",
        )

    def _repr_mimebundle_(self, include=None, exclude=None):
        return untrusted.notebook_bundle(super()._repr_mimebundle_(include, exclude))

    def __panel__(self):
        if self._layout is None:
            self.sync_url()  # first, so that the layout is built on the linked selection
            self._layout = self._build()
        return self._layout

    def drawn(self, pane: str = "matrix", group: str = "Attention") -> np.ndarray:
        """The image a pane's map holds now, as the browser draws it (rows by query).

        Parameters
        ----------
        pane : str
            ``"matrix"``, ``"unmasked"`` or ``"head N"``.
        group : str
            The image's group: ``"Attention"`` or ``"HeadMap"``.

        Returns
        -------
        numpy.ndarray
            A copy of the rasterized values in the page's Bokeh source; masked cells NaN.
        """
        for (kind, image_group, *_), found in self._handles.get(pane, {}).items():
            if kind == "Image" and image_group == group and found:
                return np.array(found[0]["source"].data["image"][0])
        raise KeyError(f"no {group} image has been drawn in pane {pane!r}")

    def sync_url(self) -> None:
        """Mirror sample, head, query, mask and stage in the served page's URL.

        A copied link then reopens the same view; outside a server this does nothing.
        """
        location = pn.state.location
        if location is None:
            return
        location.sync(self, {name: name for name in URL_PARAMS})

    def save(
        self, path, sample: int | None = None, size: int | None = None, overwrite: bool = False
    ):
        """Write a standalone HTML file that works offline: every head, every mask mode.

        Parameters
        ----------
        path : str or Path
            The HTML file to write.
        sample : int, optional
            The sample to export; defaults to the one shown.
        size : int, optional
            Display resolution of the stored maps (default ``attnpanel.export.DISPLAY``).
        overwrite : bool
            Replace an existing HTML page at ``path`` (nothing else is ever replaced).

        Returns
        -------
        Path
        """
        from attnpanel.export import DISPLAY, export_html

        sample = self.sample if sample is None else sample
        title = f"attnpanel · {str(self.trace.attrs.get('source', '')).splitlines()[0][:80]}"
        return export_html(
            self.trace, path, sample=sample, size=size or DISPLAY, title=title, overwrite=overwrite
        )


def _push(handles: dict, element):
    """Write one element's data into its rendered Bokeh models; return its y extent."""
    glyph = handles.get("glyph")
    if isinstance(element, hv.HSpan):
        glyph.bottom, glyph.top = (_ms(v) for v in element.data)
        return None
    if isinstance(element, hv.VLine):
        glyph.location = _ms(element.data)
        return None
    source = handles["source"]
    if isinstance(element, _Raster):
        left, bottom, right, top = element.bounds
        image = element.values
        source.data = dict(
            image=[image], x=[left], y=[bottom], dw=[right - left], dh=[top - bottom]
        )
        mapper = handles.get("color_mapper")
        if mapper is not None:
            mapper.low, mapper.high = views.image_limits(image, element.group)
        colorbar = handles.get("colorbar")
        if colorbar is not None and element.value_label:
            colorbar.title = element.value_label
        return None
    if isinstance(element, hv.HeatMap):
        values = element.dimension_values("value")
        data = {
            "dim": element.dimension_values("dim"),
            "key": element.dimension_values("key"),
            "zvalues": values,
            "value": values,
        }
        old = source.data.get("width")
        data["width"] = old if old is not None and len(old) == len(values) else np.ones(len(values))
        source.data = {k: v for k, v in data.items() if k in source.data}
        # Reversed, as HoloViews lays them out with an inverted axis: most attended on top.
        handles["y_range"].factors = [str(k) for k in dict.fromkeys(data["key"])][::-1]
        limit = float(np.abs(values).max()) or 1.0
        handles["color_mapper"].low, handles["color_mapper"].high = -limit, limit
        return None
    columns = element.data if isinstance(element.data, dict) else {}
    data = {}
    for column in source.data:
        name = RECT_COLUMNS.get(column, column) if isinstance(element, hv.Rectangles) else column
        data[column] = columns[name] if name in columns else element.dimension_values(name)
    source.data = data
    if isinstance(element, hv.Rectangles):
        return float(np.min(data["bottom"])), float(np.max(data["top"]))
    xs = element.dimension_values(0)
    if len(xs) and np.issubdtype(np.asarray(xs).dtype, np.datetime64):
        # A new sample covers other hours: the time axis follows it.
        handles["x_range"].start, handles["x_range"].end = _ms(xs.min()), _ms(xs.max())
    values = element.dimension_values(1)
    return float(np.nanmin(values)), float(np.nanmax(values))


def _toggle_css(color: str) -> str:
    """Stylesheet filling a head's toggle button with the head's colour while it is on."""
    # !important: Panel's own button stylesheets load after this one.
    red, green, blue = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    text = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "white"
    return (
        f":host .bk-btn.bk-active {{ background-color: {color} !important; color: {text} "
        f"!important; border-color: {color} !important; }}"
        f":host .bk-btn {{ border: 2px solid {color} !important; }}"
    )


def notify_errors(err: BaseException) -> None:
    """Panel exception handler: show a failing callback as a notification, log the rest."""
    log.error("callback failed\n%s", "".join(traceback.format_exception(err)))
    if pn.state.notifications is not None:
        pn.state.notifications.error(
            untrusted.html_text(f"{type(err).__name__}: {err}"), duration=8000
        )


def explore(capture: xr.Dataset | xr.DataTree, **params) -> pn.viewable.Viewer:
    """The explorer of a capture: one Dataset, or every group of a DataTree.

    Parameters
    ----------
    capture : xarray.Dataset or xarray.DataTree
        What :func:`attnpanel.capture` or :func:`attnpanel.load` returned.
    **params
        Initial explorer parameters (``sample``, ``head``, ``layer`` ...).

    Returns
    -------
    AttentionExplorer or attnpanel.groups_explorer.GroupsExplorer
    """
    if isinstance(capture, xr.DataTree):
        from attnpanel.groups_explorer import GroupsExplorer

        return GroupsExplorer(capture, **params)
    return AttentionExplorer(capture, **params)

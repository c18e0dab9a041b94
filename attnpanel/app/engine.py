"""The explorer's live-update engine: views drawn once, then redrawn in place.

A section registers each of its views with :meth:`LiveEngine.add`: a function of the
:class:`~attnpanel.readouts.core.Selection` that builds the view's element, the state
parameters it depends on, and the pane it is drawn into. :meth:`LiveEngine.render` draws
the element once, straight into Bokeh models (:func:`attnpanel.render.figures.draw`), and records
the models of every layer under a typed :class:`PlotKey`; when a parameter changes, the
engine rebuilds only the views that depend on it and writes their data into those models.
No figure is rebuilt and HoloViews renders nothing on the served page: a first render costs
~15 ms a plot where HoloViews took 40-70 ms, an update ~1 ms a plot where a ``DynamicMap``
refresh took 25-45 ms (see ``docs/explorer.md``). :meth:`LiveEngine.dynamic_map` gives any
view to a notebook user as a HoloViews ``DynamicMap``.

Maps are :class:`Raster` payloads: the engine regrids them to their plot's pixels for the
visible window (:func:`attnpanel.readouts.raster.window_raster`), so a zoomed map is re-rasterized
from the full array, never magnified.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401 - registers the Bokeh backend and its options
import numpy as np
import panel as pn
from bokeh.events import Tap
from bokeh.models import Range1d
from panel.io.notebook import push_notebook
from panel.io.state import set_curdoc

from attnpanel.app.background import Background
from attnpanel.app.state import SELECTION_PARAMS, ExplorerState
from attnpanel.readouts.core import stages_cached
from attnpanel.readouts.raster import image_limits, scale_title, window_raster
from attnpanel.render import styling
from attnpanel.render.elements import PlotKey, Raster
from attnpanel.render.figures import axis_number, box_handles, draw, table_html
from attnpanel.util import untrusted

log = logging.getLogger(__name__)

LINKED_GROUPS = ("Attention", "HeadMap")  # map groups that zoom together
IMAGE_PARAMS = {"sample", "head", "mask", "stage", "layer"}  # changes that repaint maps
SECONDARY_DELAY_MS = 120
QUERY_DELAY_MS = 30
SLOW_DELAY_MS = 10  # the loading indicator goes out, then the slow maps are computed
# A change whose maps are not cached and whose redraw is expected to take longer than this
# shows the busy indicator first. The expectation is the sample's attention cells (heads x
# query x key) times a cost per cell: first this guess (the demo's 1.8 M cells redraw in
# 0.06-0.10 s uncached on a 2-core machine, so its changes never wait for the indicator),
# then what the engine measured on its own uncached changes.
BUSY_AFTER_S = 0.25
SECONDS_PER_CELL = 5.5e-8
# One indicator for the page, fixed at its top right (visible wherever the page is
# scrolled): a per-plot one (Panel's ``loading``, or a style) makes BokehJS re-render each
# plot, 0.2-0.7 s apiece, longer than the recomputation it announces.
INDICATOR_STYLE = {
    "position": "fixed",
    "top": "8px",
    "right": "16px",
    "z-index": "1000",
    "background": "#fff8d6",
    "border": "1px solid #e0c060",
    "border-radius": "4px",
    "padding": "2px 10px",
    "font-size": "13px",
}
RECT_COLUMNS = {"left": "x0", "right": "x1", "bottom": "y0", "top": "y1"}


@dataclass
class LiveView:
    """One view on the live path: how to build it and where it is drawn."""

    name: str
    build: Callable  # Selection -> element, Raster, or (values, label[, value label]) to regrid
    parameters: frozenset  # the state parameters it depends on
    pane: str  # the rendered plot it draws into
    raster: tuple[int, int] | None = None  # regrid build's (values, label) to (width, height)
    title: bool = True  # whether the element's label is the plot's title
    active: Callable | None = None  # () -> bool; skipped while False (a hidden plot)
    group: str = ""  # group of a regridded map (Attention, HeadMap)
    first: bool = False  # drawn in the same message as the change, before the others
    slow: bool = False  # may take long: a background engine computes it off the event loop
    refine: Callable | None = None  # Selection -> a slower, exact build to draw next, or None

    @property
    def offloadable(self) -> bool:
        """Whether a background engine computes it on its workers (maps and slow views)."""
        return self.raster is not None or self.slow


class LiveEngine:
    """Draws the registered views of one explorer and redraws them when the state changes.

    Parameters
    ----------
    state : attnpanel.app.state.ExplorerState
        The state the views read; the engine watches its selection parameters.
    background : bool
        Compute the maps and the views registered ``slow`` on worker threads
        (:class:`attnpanel.app.background.Background`): a served session's event loop never
        waits for them (the explorer of a virtual trace, whose maps may take minutes).
    """

    def __init__(self, state: ExplorerState, background: bool = False):
        self.state = state
        self.window: tuple | None = None  # ((x0, x1), (y0, y1)) shown by the linked maps
        self.root = None  # the layout pushed to a notebook after an update
        self.box_handles = box_handles()  # shared by every box annotation of the page
        self._views: list[LiveView] = []
        self._handles: dict[str, dict[PlotKey, list[dict]]] = {}
        self._render_callbacks: list[Callable] = []
        self._ranges: dict | None = None  # the linked maps' shared ranges
        self._pending: dict[int, LiveView] = {}
        self._scheduled = False
        self.seconds_per_cell = SECONDS_PER_CELL  # an uncached redraw's cost, learnt
        self._timing: float | None = None  # seconds spent drawing an uncached change
        self._now = False  # draw every change at once (see drawing_now)
        # shown while maps are recomputed from q and k (the explorer lays it out)
        self.indicator = pn.pane.HTML(
            "⏳ recomputing the maps from q and k …",
            visible=False,
            styles=INDICATOR_STYLE,
            margin=0,
        )
        self.background = Background(self.indicator) if background else None
        state.param.watch(self._on_change, [*SELECTION_PARAMS, "show_reference"])

    def on_render(self, callback: Callable) -> None:
        """Call ``callback(figure, element, handles)`` for every layer rendered from now."""
        self._render_callbacks.append(callback)

    def add(
        self,
        name: str,
        build: Callable,
        parameters,
        pane: str,
        *,
        raster: tuple[int, int] | None = None,
        title: bool = True,
        active: Callable | None = None,
        group: str = "",
        first: bool = False,
        follows_layer: bool = True,
        slow: bool = False,
        refine: Callable | None = None,
    ):
        """Register a view and return its first element (a :class:`Raster` for a map).

        Parameters
        ----------
        name : str
            What the view is, in the user's words (error messages name it).
        build : callable
            ``Selection -> element``; for a regridded map, ``Selection -> (values, label)``
            or ``(values, label, colour-bar title)`` with ``values`` rows by ascending y.
        parameters : iterable of str
            The state parameters the view depends on.
        pane : str
            The plot it draws into (several views may share one: an overlay).
        raster : (int, int), optional
            Pixel size the map is regridded to, for the visible window.
        title : bool
            Whether the element's label becomes the plot's title.
        active : callable, optional
            ``() -> bool``: the view is skipped while it is False (a hidden plot).
        group : str
            Group of a regridded map; ``Attention`` and ``HeadMap`` maps zoom together.
        first : bool
            Drawn in the same message as the change, before the other views.
        follows_layer : bool
            Whether it reads the shown layer (most views do: they read ``state.trace``);
            such a view depends on ``layer`` without naming it.
        slow : bool
            Its build may take long (seconds): a background engine computes it off the
            event loop, as it does every map.
        refine : callable, optional
            ``Selection -> build output or None``, asked once the view is drawn: a slower,
            exact version of it (a window's own pixels where the first draw cut a stored
            overview), which a background engine computes on its refinement worker and
            draws in its place unless the view changed meanwhile.
        """
        parameters = set(parameters) | ({"layer"} if follows_layer else set())
        view = LiveView(
            name,
            build,
            frozenset(parameters),
            pane,
            raster,
            title,
            active,
            group,
            first,
            slow,
            refine,
        )
        element = self._element(view, self.state.selection)
        self._views.append(view)
        return element

    def render(
        self,
        element,
        pane: str,
        *,
        on_tap: Callable | None = None,
        linked: bool = False,
        style: dict | None = None,
        **pane_kw,
    ) -> pn.pane.Bokeh:
        """Draw an element into a Bokeh figure whose models the views registered on
        ``pane`` then update in place.

        Parameters
        ----------
        element : holoviews.Element or holoviews.Overlay
            The first element of the pane's views (:meth:`add` returns it).
        pane : str
            The name the views draw into.
        on_tap : callable, optional
            ``on_tap(x=..., y=...)`` with the data coordinates of a click.
        linked : bool
            A map that zooms with the other linked maps (shared ranges).
        style : dict, optional
            How the figure looks (:func:`attnpanel.render.figures.draw`'s keywords).
        **pane_kw
            Options of the ``pn.pane.Bokeh`` that holds it (margin, width ...).
        """
        style = dict(style or {}, box_handles=self.box_handles)
        if linked:
            style.update(self._shared_ranges(element))
        figure, layers = draw(element, **style)
        for key, handles in layers:
            self._record(pane, key, handles, element)
        if on_tap is not None:
            figure.on_event(Tap, lambda event: on_tap(x=event.x, y=event.y))
        pane_kw.setdefault("margin", 0)
        return pn.pane.Bokeh(figure, **pane_kw)

    def _shared_ranges(self, element) -> dict:
        """The key and query ranges every linked map shares (made by the first one)."""
        if self._ranges is None:
            image = next(layer for layer in _layers(element) if isinstance(layer, hv.Image))
            left, bottom, right, top = image.bounds.lbrt()
            self._ranges = dict(x_range=Range1d(left, right), y_range=Range1d(top, bottom))
        return dict(self._ranges)

    def record(self, pane: str, key: PlotKey, handles: dict) -> None:
        """Adopt Bokeh models a section drew itself, so the views registered on ``pane``
        update them.

        ``handles`` holds the models (``plot``, ``source``, ``glyph`` ...) and, where the
        generic :func:`push` does not fit them, ``push``: ``(handles, element) -> None``,
        which writes a new element into them.
        """
        self._handles.setdefault(pane, {}).setdefault(key, []).append(handles)

    def _record(self, pane: str, key: PlotKey, handles: dict, element) -> None:
        self.record(pane, key, handles)
        layer = next((la for la in _layers(element) if PlotKey.of(la) == key), element)
        for callback in self._render_callbacks:
            callback(handles["plot"], layer, handles)

    @property
    def views(self) -> tuple[LiveView, ...]:
        """Every registered view, in registration order."""
        return tuple(self._views)

    def handles(self, pane: str, key: PlotKey) -> list[dict]:
        """The Bokeh models (figure, source, glyph, colour mapper) drawing ``key`` in ``pane``."""
        return list(self._handles.get(pane, {}).get(key, []))

    def plots(self, pane: str) -> dict[PlotKey, list[dict]]:
        """Every layer drawn into ``pane`` so far, by key, with its Bokeh models."""
        return {key: list(found) for key, found in self._handles.get(pane, {}).items()}

    def panes(self) -> list[str]:
        """The panes rendered so far."""
        return list(self._handles)

    def drawn(self, pane: str = "matrix", group: str = "Attention") -> np.ndarray:
        """The image a pane's map holds now, as the browser draws it (rows by query).

        Parameters
        ----------
        pane : str
            ``"matrix"``, ``"unmasked"``, ``"head N"``, ``"head average"``, ``"w_q"`` ...
        group : str
            The image's group: ``"Attention"``, ``"HeadMap"``, ``"Weight"`` ...

        Returns
        -------
        numpy.ndarray
            A copy of the rasterized values in the page's Bokeh source; masked cells NaN.
        """
        found = self.handles(pane, PlotKey("Image", group))
        if not found:
            raise KeyError(f"no {group} image has been drawn in pane {pane!r}")
        return np.array(found[0]["source"].data["image"][0])

    def title(self, pane: str) -> str:
        """The title the plot of ``pane`` shows now."""
        for found in self._handles.get(pane, {}).values():
            if found:
                return found[0]["plot"].title.text
        raise KeyError(f"nothing has been drawn in pane {pane!r}")

    def dynamic_map(self, name: str) -> hv.DynamicMap:
        """A registered view as a HoloViews ``DynamicMap`` following the state.

        For composing with one's own HoloViews objects in a notebook: it redraws through
        HoloViews when a parameter the view depends on changes (``hv.streams.Params`` on
        the state). A map comes at full resolution, rasterized by datashader
        (``holoviews.operation.datashader.rasterize``) for the plot it is shown in.

        Parameters
        ----------
        name : str
            A view's name (``[v.name for v in engine.views]``): ``"attention matrix"``,
            ``"head 3 map"``, ``"context vector"`` ...
        """
        found = [v for v in self._views if v.name == name]
        if not found:
            names = ", ".join(sorted({v.name for v in self._views}))
            raise KeyError(f"no view named {name!r}; the views are: {names}")
        view = found[0]

        def element(**_params):
            built = view.build(self.state.selection)
            if view.raster is None:
                # a payload drawn straight into Bokeh models (a Raster, the mass shares)
                # gives its HoloViews element
                return built if isinstance(built, hv.core.Dimensioned) else built.element()
            values, label, *value_label = built  # at full resolution: rasterize regrids
            rows, cols = values.shape
            raster = Raster(values, (-0.5, -0.5, cols - 0.5, rows - 0.5), view.group, label)
            return raster.element(hv.Dimension("value", label="".join(value_label) or "value"))

        stream = hv.streams.Params(self.state, sorted(view.parameters))
        dmap = hv.DynamicMap(element, streams=[stream])
        if view.raster is not None:
            from holoviews.operation.datashader import rasterize

            dmap = rasterize(dmap, aggregator="mean")
        return dmap.opts(*styling.options())

    def report(self, err: BaseException, where: str) -> None:
        """Show an error as a notification and log it; the session goes on."""
        message = f"{where} failed: {err}"
        log.error("%s\n%s", message, "".join(traceback.format_exception(err)))
        self.state.last_error = message
        if pn.state.notifications is not None:
            pn.state.notifications.error(untrusted.html_text(message), duration=8000)

    def soon(self, callback: Callable, *args, **kwargs) -> None:
        """Run ``callback`` on the document's next tick (now, outside a server).

        A click's state change then goes out after the click's own message is handled.
        """
        doc = pn.state.curdoc
        if doc is None or doc.session_context is None:
            callback(*args, **kwargs)
        else:
            doc.add_next_tick_callback(partial(callback, *args, **kwargs))

    def redraw(self, where: Callable[[LiveView], bool]) -> None:
        """Redraw the views for which ``where(view)`` is true, now."""
        self._refresh_all([view for view in self._views if where(view)], self.state.selection)
        self._push_notebook()

    def _element(self, view: LiveView, sel, built=None):
        if view.raster is None:
            return view.build(sel)
        values, label, *value_label = view.build(sel) if built is None else built
        window = self.window if view.group in LINKED_GROUPS else None
        raster, bounds = window_raster(values, *view.raster, window)
        return Raster(raster, bounds, view.group, label, "".join(value_label))

    @contextlib.contextmanager
    def drawing_now(self):
        """Within it, a change redraws its views before it returns, as outside a server.

        For changes made before a session's page is sent (its URL's selection, on an
        explorer built ahead): the first page must show them, not a later update.
        """
        self._now = True
        try:
            yield
        finally:
            self._now = False

    def _on_change(self, *events) -> None:
        changed = {event.name for event in events}
        due = [v for v in self._views if v.parameters & changed]
        doc = pn.state.curdoc
        if doc is None or doc.session_context is None or self._now:
            sel = self.state.selection
            if changed & IMAGE_PARAMS and not self._cached(sel):
                self._timing = 0.0
            self._refresh_all(due, sel)
            self._learn()
            self._push_notebook()
            return
        # Panel sends a change's model updates together when its callback returns: the
        # large matrix and the query markers go now, the other views later, so what the
        # user acts on repaints first. A new image takes the browser ~100 ms to map and
        # paint (software GL); the other views' updates would block that frame, so they
        # wait that long (a moved marker is cheap: 30 ms). Pending views coalesce across
        # fast events (a dragged slider). A change whose maps must be recomputed and whose
        # redraw is expected to be slow shows the busy indicator first (``_slow``).
        # (A background engine's workers show the indicator themselves, when slow.)
        sel = self.state.selection
        if self.background is None and changed & IMAGE_PARAMS and not self._cached(sel):
            self._timing = 0.0
            if self.expected_seconds() > BUSY_AFTER_S:
                self._slow(doc, due)
                return
        with pn.io.hold(doc):  # one message for all of them, not one per property
            self._refresh_all([view for view in due if view.first], sel)
            for view in due:
                if not view.first:
                    self._pending[id(view)] = view
        if self._pending and not self._scheduled:
            self._scheduled = True
            # A timeout, not the next tick: the held priority message is flushed on a
            # next tick too and must go out before the other views are computed.
            delay = SECONDARY_DELAY_MS if changed & IMAGE_PARAMS else QUERY_DELAY_MS
            doc.add_timeout_callback(partial(self._refresh_pending, doc), delay)
        elif not self._pending:
            self._learn()

    def _cells(self) -> int:
        """The attention cells of one sample of the shown layer (heads x query x key)."""
        sizes = self.state.trace.sizes
        return sizes.get("head", 1) * sizes.get("query", 0) * sizes.get("key", 0)

    def expected_seconds(self) -> float:
        """How long a change whose maps are not cached is expected to take to redraw."""
        return self._cells() * self.seconds_per_cell

    def _learn(self) -> None:
        """Fold the redraw time of the uncached change just drawn into the cost per cell."""
        cells = self._cells()
        if self._timing and cells:
            self.seconds_per_cell = 0.5 * self.seconds_per_cell + 0.5 * self._timing / cells
        self._timing = None

    def _cached(self, sel) -> bool:
        try:
            return stages_cached(self.state.trace, sel, self.state.cache)
        except Exception:  # noqa: BLE001 - the views report their own errors
            return True

    def _slow(self, doc, due: list[LiveView]) -> None:
        """A change whose maps must be recomputed from q and k (a mask or sample not seen
        yet) and whose redraw is expected to take over :data:`BUSY_AFTER_S`: the page's
        busy indicator shows first, then the views are drawn together and it goes."""
        self.indicator.visible = True
        for view in due:
            self._pending[id(view)] = view

        def draw():
            try:
                self._refresh_pending(doc)
            finally:
                with set_curdoc(doc):
                    self.indicator.visible = False

        # a timeout, not the next tick: the indicator's message must go out first
        doc.add_timeout_callback(draw, SLOW_DELAY_MS)

    def _push_notebook(self) -> None:
        doc = pn.state.curdoc
        if (doc is None or doc.session_context is None) and self.root is not None:
            # In a notebook, Bokeh models edited in place reach the page only when pushed
            # (a server session syncs them by itself).
            push_notebook(self.root)

    def _refresh_pending(self, doc) -> None:
        self._scheduled = False
        pending, self._pending = list(self._pending.values()), {}
        sel = self.state.selection
        with set_curdoc(doc), pn.io.hold(doc):
            self._refresh_all(pending, sel)
        self._learn()

    def _refresh_all(self, views: list[LiveView], sel) -> None:
        """Redraw ``views`` for ``sel``: a background engine's maps and slow views on its
        workers (drawn as each is ready), the others now, in order."""
        if self.background is None:
            for view in views:
                self._refresh(view, sel)
            return
        shown = [view for view in views if view.active is None or view.active()]
        jobs = [
            (
                id(view),
                partial(self._element, view, sel),
                partial(self._draw_then_refine, view, sel),
            )
            for view in shown
            if view.offloadable
        ]
        self.background.run(jobs, self._failed)
        for view in shown:
            if not view.offloadable:
                self._refresh(view, sel)

    def _draw_then_refine(self, view: LiveView, sel, element) -> None:
        """Draw a background view, then ask for its refinement (if it has one now)."""
        self._draw(view, element)
        built = None if view.refine is None else view.refine(sel)
        if built is not None:
            job = (id(view), partial(self._element, view, sel, built), partial(self._draw, view))
            self.background.run([job], self._failed, refine=True)

    def _failed(self, key: int, err: BaseException) -> None:
        view = next(view for view in self._views if id(view) == key)
        self.report(err, f"updating the {view.name}")

    def _refresh(self, view: LiveView, sel) -> None:
        if view.active is not None and not view.active():
            return
        start = time.perf_counter()
        try:
            self._draw(view, self._element(view, sel))
        except Exception as err:  # noqa: BLE001 - any failure goes to the user, not the log only
            self.report(err, f"updating the {view.name}")
        if self._timing is not None:
            self._timing += time.perf_counter() - start

    def _draw(self, view: LiveView, element) -> None:
        """Write an element's data into the Bokeh models already on the page."""
        captured = self._handles.get(view.pane, {})
        layers = list(element) if isinstance(element, hv.Overlay) else [element]
        present = set()
        figures = {}
        for layer in layers:
            key = PlotKey.of(layer)
            present.add(key)
            if key.group == "Lanes":
                continue  # the lane shading never changes
            for handles in captured.get(key, []):
                # a section that drew its own models says how they take new data
                extent = handles.get("push", push)(handles, layer)
                figure = handles["plot"]
                if "glyph_renderer" in handles:
                    handles["glyph_renderer"].visible = True
                if extent is not None:
                    lo, hi = figures.get(id(figure), (figure, (np.inf, -np.inf)))[1]
                    figures[id(figure)] = (figure, (min(lo, extent[0]), max(hi, extent[1])))
                else:
                    figures.setdefault(id(figure), (figure, None))
        # Reference curves switched off are hidden, but only by a redraw of the curves
        # themselves: the query marker shares their pane and must not hide them.
        redrawn_sequence = any(key.group == "Sequence" for key in present)
        for key, found in captured.items():
            if redrawn_sequence and key.group == "Sequence" and key not in present:
                for handles in found:
                    handles["glyph_renderer"].visible = False
        for figure, extent in figures.values():
            if view.title:
                figure.title.text = element.label
            # all-equal values (empty mass bars: zeros) keep the axis they were drawn with
            if extent is not None and np.isfinite(extent).all() and extent[1] > extent[0]:
                pad = 0.06 * (extent[1] - extent[0]) or 1.0
                figure.y_range.start, figure.y_range.end = extent[0] - pad, extent[1] + pad


def push(handles: dict, element):
    """Write one element's data into its rendered Bokeh models; return its y extent."""
    if isinstance(element, hv.Table):
        handles["table"].text = table_html(element)
        return None
    glyph = handles.get("glyph")
    if isinstance(element, hv.HSpan):
        glyph.bottom, glyph.top = (axis_number(v) for v in element.data)
        return None
    if isinstance(element, hv.VLine):
        glyph.location = axis_number(element.data)
        return None
    source = handles["source"]
    if isinstance(element, Raster):
        left, bottom, right, top = element.bounds
        image = element.values
        source.data = dict(
            image=[image], x=[left], y=[bottom], dw=[right - left], dh=[top - bottom]
        )
        mapper = handles.get("color_mapper")
        if mapper is not None:
            mapper.low, mapper.high = image_limits(image)
        colorbar = handles.get("colorbar")
        if colorbar is not None and colorbar.title:  # a titled bar states the rule
            label = element.value_label or handles.get("colorbar_label", "")
            colorbar.title = scale_title(label, mapper.low)
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
        mapper = handles["color_mapper"]
        mapper.low, mapper.high = image_limits(np.asarray(values, dtype=float))
        return None
    columns = element.data if isinstance(element.data, dict) else {}
    data = {}
    for column in source.data:
        name = RECT_COLUMNS.get(column, column) if isinstance(element, hv.Rectangles) else column
        data[column] = columns[name] if name in columns else element.dimension_values(name)
    source.data = data
    if isinstance(element, hv.Rectangles):
        if element.group != "Vector":
            return None  # an outline or token boxes: their axis is fixed
        return float(np.min(data["bottom"])), float(np.max(data["top"]))
    xs = element.dimension_values(0)
    if len(xs) and np.issubdtype(np.asarray(xs).dtype, np.datetime64):
        # A new sample covers other hours: the time axis follows it.
        handles["x_range"].start, handles["x_range"].end = (
            axis_number(xs.min()),
            axis_number(xs.max()),
        )
    values = element.dimension_values(1)
    return float(np.nanmin(values)), float(np.nanmax(values))


def _layers(element) -> list:
    return list(element) if isinstance(element, hv.Overlay) else [element]

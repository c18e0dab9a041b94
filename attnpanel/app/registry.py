"""The views of one explorer and the Bokeh models they are drawn into.

A section registers each of its views with :meth:`ViewRegistry.add`: a function of the
:class:`~attnpanel.readouts.core.Selection` that builds the view's element, the state
parameters it depends on, and the pane it is drawn into. :meth:`ViewRegistry.render` draws
the element once, straight into Bokeh models (:func:`attnpanel.render.figures.draw`), and
records the models of every layer under a typed :class:`PlotKey`;
:meth:`ViewRegistry.draw` later writes a view's next element into them
(:func:`attnpanel.render.push.write`). When a view is redrawn is the scheduler's business
(:mod:`attnpanel.app.scheduler`).

Maps are :class:`Raster` payloads: they are regridded to their plot's pixels for the
visible window (:func:`attnpanel.readouts.raster.window_raster`), so a zoomed map is
re-rasterized from the full array, never magnified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401 - registers the Bokeh backend and its options
import numpy as np
import panel as pn
from bokeh.events import Tap
from bokeh.models import Range1d

from attnpanel.app.state import SELECTION_PARAMS, ExplorerState
from attnpanel.readouts.raster import window_raster
from attnpanel.render import styling
from attnpanel.render.elements import PlotKey, Raster
from attnpanel.render.figures import box_handles, draw
from attnpanel.render.push import layers_of, write

LINKED_GROUPS = ("Attention", "HeadMap", "Difference")  # map groups that zoom together


class BrowserDrawn(Protocol):
    """A pane's map that the browser may draw itself from maps it already holds
    (:class:`attnpanel.app.prefetch.MatrixPrefetch`)."""

    def draws(self, sel) -> bool:
        """Whether the browser draws ``sel``'s map itself (the server sends no image)."""

    def follow(self, sel) -> None:
        """The browser draws ``sel``'s map: the server writes only the words around it."""

    def drawn(self, sel) -> None:
        """The server has drawn ``sel``'s map into the pane."""

    def shown(self, sel) -> np.ndarray | None:
        """The image the browser shows for ``sel`` if it draws it itself, else None."""


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
    seconds: float = 0.0  # how long its last update took on the event loop (measured)

    @property
    def offloadable(self) -> bool:
        """Whether a background engine computes it on its workers (maps and slow views)."""
        return self.raster is not None or self.slow

    @property
    def shown(self) -> bool:
        """Whether it is drawn now (a hidden plot's view is skipped)."""
        return self.active is None or self.active()


class ElementsAhead:
    """Views' elements built for a selection the user may go to next, by view, the part of
    the selection it reads, and window (:class:`attnpanel.app.neighbours.NeighbourSamples`
    says which to keep)."""

    def __init__(self):
        self._elements: dict = {}

    def keep(self, key, build: Callable) -> None:
        """Keep ``build()`` under ``key`` (built once)."""
        if key not in self._elements:
            self._elements[key] = build()

    def take(self, key):
        """The element kept under ``key`` (no longer kept), or None."""
        return self._elements.pop(key, None)

    def retain(self, keys) -> None:
        """Drop every element but those kept under ``keys``."""
        self._elements = {key: found for key, found in self._elements.items() if key in keys}


@dataclass(frozen=True)
class Follower:
    """Model changes other than a view's redraw that follow the state (a clock's tick
    labels, a text): made with the views of the change, in the same message."""

    callback: Callable[[], None]
    parameters: frozenset


class ViewRegistry:
    """The registered views of one explorer, and the Bokeh models each pane holds.

    Parameters
    ----------
    state : attnpanel.app.state.ExplorerState
        The state the views read.
    """

    def __init__(self, state: ExplorerState):
        self.state = state
        self.window: tuple | None = None  # ((x0, x1), (y0, y1)) shown by the linked maps
        self.box_handles = box_handles()  # shared by every box annotation of the page
        self._views: list[LiveView] = []
        self._handles: dict[str, dict[PlotKey, list[dict]]] = {}
        self._render_callbacks: list[Callable] = []
        self._ranges: dict | None = None  # the linked maps' shared ranges
        self._clients: dict[str, BrowserDrawn] = {}  # panes whose map the browser may draw
        self._followers: list[Follower] = []
        self.built_ahead = ElementsAhead()  # elements built for another sample (build_ahead)

    def follow(self, callback: Callable[[], None], parameters) -> None:
        """Call ``callback()`` when one of ``parameters`` changes, with the views that
        change redraws and in the same document message (a sample's clock labels go with
        its maps, never ahead of them)."""
        self._followers.append(Follower(callback, frozenset(parameters)))

    def followers(self, changed) -> list[Follower]:
        """The followers of a change of the parameters ``changed``."""
        return [f for f in self._followers if f.parameters & set(changed)]

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
            Group of a regridded map; ``Attention``, ``HeadMap`` and ``Difference`` maps
            zoom together.
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
        element = self.element(view, self.state.selection)
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
            self.record(pane, key, handles)
            layer = next((la for la in layers_of(element) if PlotKey.of(la) == key), element)
            for callback in self._render_callbacks:
                callback(handles["plot"], layer, handles)
        if on_tap is not None:
            figure.on_event(Tap, lambda event: on_tap(x=event.x, y=event.y))
        pane_kw.setdefault("margin", 0)
        return pn.pane.Bokeh(figure, **pane_kw)

    def _shared_ranges(self, element) -> dict:
        """The key and query ranges every linked map shares (made by the first one)."""
        if self._ranges is None:
            image = next(layer for layer in layers_of(element) if isinstance(layer, hv.Image))
            left, bottom, right, top = image.bounds.lbrt()
            self._ranges = dict(x_range=Range1d(left, right), y_range=Range1d(top, bottom))
        return dict(self._ranges)

    def record(self, pane: str, key: PlotKey, handles: dict) -> None:
        """Adopt Bokeh models a section drew itself, so the views registered on ``pane``
        update them.

        ``handles`` holds the models (``plot``, ``source``, ``glyph`` ...) and, where the
        generic :func:`attnpanel.render.push.push` does not fit them, ``push``:
        ``(handles, element) -> None``, which writes a new element into them.
        """
        self._handles.setdefault(pane, {}).setdefault(key, []).append(handles)

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
            Where the browser draws the map itself from its 8-bit copy
            (:meth:`attach`), those levels as it decodes them.
        """
        found = self.handles(pane, PlotKey("Image", group))
        if not found:
            raise KeyError(f"no {group} image has been drawn in pane {pane!r}")
        client = self._clients.get(pane)
        shown = None if client is None else client.shown(self.state.selection)
        return np.array(found[0]["source"].data["image"][0] if shown is None else shown)

    def title(self, pane: str) -> str:
        """The title the plot of ``pane`` shows now."""
        for found in self._handles.get(pane, {}).values():
            if found:
                return found[0]["plot"].title.text
        raise KeyError(f"nothing has been drawn in pane {pane!r}")

    def element(self, view: LiveView, sel, built=None):
        """A view's element for a selection (a map regridded to its pixels and window).

        ``built``: the output of the view's build (or refinement) when already computed.
        """
        if view.raster is None:
            return view.build(sel)
        values, label, *value_label = view.build(sel) if built is None else built
        window = self.window if view.group in LINKED_GROUPS else None
        raster, bounds = window_raster(values, *view.raster, window)
        return Raster(raster, bounds, view.group, label, "".join(value_label))

    def draw(self, view: LiveView, element) -> None:
        """Write a view's element into the Bokeh models already on the page."""
        write(self._handles.get(view.pane, {}), element, view.title)

    def attach(self, pane: str, client: BrowserDrawn) -> None:
        """Let the browser draw the map of ``pane`` itself where ``client`` says it can."""
        self._clients[pane] = client

    def client(self, view: LiveView) -> BrowserDrawn | None:
        """Who says whether the browser draws this view's map itself (a map only)."""
        return self._clients.get(view.pane) if view.raster is not None else None

    def _ahead_key(self, view: LiveView, sel) -> tuple:
        # the part of the selection the view reads: a change of another part keeps it
        read = tuple(getattr(sel, name) for name in SELECTION_PARAMS if name in view.parameters)
        return id(view), read, self.window if view.group in LINKED_GROUPS else None

    def build_ahead(self, view: LiveView, sel) -> None:
        """Build a view's element for ``sel`` now, for :meth:`update` to draw when the
        state comes to ``sel`` (another sample, while the page is idle)."""
        self.built_ahead.keep(self._ahead_key(view, sel), lambda: self.element(view, sel))

    def update(self, view: LiveView, sel) -> None:
        """Redraw a view for ``sel``: its element written into its models, or, for a map
        the browser draws itself, only the words around it."""
        client = self.client(view)
        if client is not None and client.draws(sel):
            client.follow(sel)
            return
        element = self.built_ahead.take(self._ahead_key(view, sel))
        self.draw(view, self.element(view, sel) if element is None else element)
        if client is not None:
            client.drawn(sel)

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

"""The attention explorer: the state, the engine and one small section per part of the page.

``AttentionExplorer(trace)`` *is* the explorer's state (:class:`~attnpanel.app.state.ExplorerState`:
sample, layer, head, query, mask, stage, enabled heads ... as ``param`` parameters), so a
notebook user or a test drives it with ``explorer.param.update(...)``. It composes:

- a :class:`~attnpanel.app.engine.LiveEngine`, which draws every registered view once into
  Bokeh models and then redraws the views a parameter change concerns in place;
- :class:`~attnpanel.app.linked.LinkedMaps`, the linked zoom and box selection of the maps;
- the sections (:mod:`attnpanel.app.sections`), one ``Viewer`` per part of the page, each
  registering its views with the engine next to where it lays them out.

See ``docs/explorer.md`` for the picture and where a new view goes.
"""

from __future__ import annotations

import logging
import traceback

import panel as pn
import xarray as xr

from attnpanel.app.engine import LiveEngine
from attnpanel.app.linked import LinkedMaps
from attnpanel.app.sections import (
    AttentionMatrix,
    Controls,
    GuidedWalk,
    HeadComparison,
    InputSequence,
    LinkedZoom,
    MergeOutput,
    ModelView,
    Positional,
    Projection,
    ShapeTable,
    TopAttended,
    ValueAggregation,
)
from attnpanel.app.state import ExplorerState
from attnpanel.render.styling import WRAP
from attnpanel.util import untrusted

log = logging.getLogger(__name__)

# The state mirrored in the page URL: parameter -> query argument (a link opens the view).
URL_PARAMS = {
    **{name: name for name in ("sample", "head", "query", "mask", "stage", "step")},
    "show_projection": "projection",
    "show_merge": "merge",
}


class AttentionExplorer(ExplorerState, pn.viewable.Viewer):
    """Explore every stage of one multi-head attention layer captured in a trace.

    Parameters
    ----------
    trace : xarray.Dataset
        A trace (see ``attnpanel.trace``); only ``weights`` is required, views that need
        missing variables say so in their place.
    **params
        Initial values of the state's parameters (``sample``, ``head``, ``layer`` ...).
    """

    def __init__(self, trace: xr.Dataset, **params):
        super().__init__(trace, **params)
        self.engine = LiveEngine(self)
        self.linked = LinkedMaps(self.engine)
        parts = dict(state=self, engine=self.engine)
        self.sections = {
            "controls": Controls(**parts),
            "walk": GuidedWalk(**parts),
            "sequence": InputSequence(**parts),
            "projection": Projection(**parts),
            "matrix": AttentionMatrix(**parts),
            "aggregation": ValueAggregation(**parts),
            "top attended": TopAttended(**parts),
            "model view": ModelView(**parts),
            "positional": Positional(**parts),
            "heads": HeadComparison(linked=self.linked, **parts),
            "linked zoom": LinkedZoom(linked=self.linked, **parts),
            "merge": MergeOutput(**parts),
            "shapes": ShapeTable(**parts),
        }
        self._layout = None
        self._url_synced = False

    @property
    def widgets(self) -> dict:
        """The page's controls by the parameter they drive (see ``Controls.widgets``)."""
        return self.sections["controls"].widgets

    def drawn(self, pane: str = "matrix", group: str = "Attention"):
        """The image a pane's map holds now, as the browser draws it (see ``LiveEngine.drawn``)."""
        return self.engine.drawn(pane, group)

    def dynamic_map(self, name: str):
        """A view of the page as a HoloViews ``DynamicMap`` driven by this explorer's state.

        Compose it with your own HoloViews objects in a notebook; it follows
        ``explorer.param.update(...)`` like the page does (see ``LiveEngine.dynamic_map``).

        Parameters
        ----------
        name : str
            The view's name: ``"attention matrix"``, ``"head 0 map"``, ``"aggregation
            weights"``, ``"context vector"``, ``"head merge"``, ``"output"``, ...
            (``[v.name for v in explorer.engine.views]``).

        Returns
        -------
        holoviews.DynamicMap
        """
        self.__panel__()  # the sections register their views when they are laid out
        return self.engine.dynamic_map(name)

    def _build(self):
        s = self.sections
        title = (str(self.trace.attrs.get("source", "")).strip() or "trace").splitlines()[0][:100]
        return pn.Column(
            pn.pane.Markdown(f"## attnpanel · {untrusted.markup(title)}", margin=(0, 10)),
            self.engine.indicator,
            s["controls"],
            s["walk"],
            s["sequence"],
            pn.Row(
                s["projection"],
                s["matrix"],
                s["aggregation"],
                sizing_mode="stretch_width",
                stylesheets=[WRAP],
            ),
            s["top attended"],
            s["model view"],
            s["positional"],
            s["heads"],
            s["linked zoom"],
            s["merge"],
            s["shapes"],
            sizing_mode="stretch_width",
        )

    def _repr_mimebundle_(self, include=None, exclude=None):
        return untrusted.notebook_bundle(super()._repr_mimebundle_(include, exclude))

    @classmethod
    def built(cls, trace: xr.Dataset, **params) -> AttentionExplorer:
        """An explorer whose page is already laid out and drawn (see :meth:`lay_out`).

        ``functools.partial(AttentionExplorer.built, trace)`` is what a server builds ahead
        of its next session (``attnpanel.app.serving.built_ahead``).
        """
        explorer = cls(trace, **params)
        explorer.lay_out()
        return explorer

    def lay_out(self) -> pn.viewable.Viewable:
        """Build the page (every section draws its views) unless it is built; return it.

        It needs no session: a server builds it ahead, and the session that shows it then
        only mirrors its URL (:meth:`sync_url`), which redraws what the URL changed.
        """
        if self._layout is None:
            self._layout = self._build()
            self.engine.root = self._layout
        return self._layout

    def __panel__(self):
        if not self._url_synced:
            self._url_synced = True
            with self.engine.drawing_now():  # the first page shows what the URL says
                self.sync_url()
        return self.lay_out()

    def sync_url(self) -> None:
        """Mirror the selection, the walk's step and the open sections in the page's URL.

        A copied link then reopens the same view; outside a server this does nothing.
        """
        location = pn.state.location
        if location is None:
            return
        location.sync(self, URL_PARAMS)

    def save(
        self, path, sample: int | None = None, size: int | None = None, overwrite: bool = False
    ):
        """Write a standalone HTML file that works offline: every head, every mask mode, the
        input sequence, and the selected query (the one shown now).

        Parameters
        ----------
        path : str or Path
            The HTML file to write.
        sample : int, optional
            The sample to export; defaults to the one shown.
        size : int, optional
            Display resolution of the stored maps (default ``attnpanel.render.export.DISPLAY``).
        overwrite : bool
            Replace an existing HTML page at ``path`` (nothing else is ever replaced).

        Returns
        -------
        Path
        """
        from attnpanel.render.export import DISPLAY, export_html

        sample = self.sample if sample is None else sample
        title = f"attnpanel · {str(self.trace.attrs.get('source', '')).splitlines()[0][:80]}"
        return export_html(
            self.trace,
            path,
            sample=sample,
            size=size or DISPLAY,
            title=title,
            overwrite=overwrite,
            query=self.query,
        )


def notify_errors(err: BaseException) -> None:
    """Panel exception handler: show a failing callback as a notification, log the rest."""
    log.error("callback failed\n%s", "".join(traceback.format_exception(err)))
    if pn.state.notifications is not None:
        pn.state.notifications.error(
            untrusted.html_text(f"{type(err).__name__}: {err}"), duration=8000
        )

"""What every explorer kind is, and what the kinds of one layer share.

hvPlot's explorers share one base and each kind overrides a few hooks; so do these.
:class:`Explorer` is any page of a capture (the dense one, the long one, the one of a
DataTree's groups); :class:`LayerExplorer` is one layer's page: the state
(:class:`~attnpanel.app.state.ExplorerState`), the live-update engine, the linked maps, the
sections, the URL mirror and the page's frame. A kind declares what it adds:

- :meth:`LayerExplorer.make_sections`: its sections, by name;
- :meth:`LayerExplorer.page`: how they are laid out under the title;
- ``URL_PARAMS`` (what a link reopens) and ``BACKGROUND`` (maps computed off the event loop);
- :meth:`Explorer.save`: its offline HTML export.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import panel as pn
import xarray as xr

from attnpanel.app.documents import served_doc
from attnpanel.app.engine import LiveEngine
from attnpanel.app.later import LaterSections
from attnpanel.app.linked import LinkedMaps
from attnpanel.app.state import ExplorerState
from attnpanel.app.url import apply_each, once_loaded
from attnpanel.util import untrusted

TITLE_CHARS = 160  # the page's heading: a trace's source line, at most this long


def page_heading(title: str) -> pn.pane.Markdown:
    """A page's heading: attnpanel and ``title`` (shown as text, never as markup)."""
    return pn.pane.Markdown(f"## attnpanel · {untrusted.markup(title)}", margin=(0, 10))


class Explorer(pn.viewable.Viewer):
    """A page of a capture: shown by Panel (served, in a notebook), saved as offline HTML."""

    URL_PARAMS: ClassVar[dict[str, str]] = {}  # parameter -> query argument of the page URL

    def __new__(cls, *args, **kwargs):
        explorer = super().__new__(cls)
        # what it was made of: ``pn.serve(explorer)`` gives each further page its own
        explorer._made_with = (args, kwargs)
        return explorer

    def another(self) -> Explorer:
        """A new explorer made of what this one was made of (its own state and page)."""
        args, kwargs = self._made_with
        return type(self)(*args, **kwargs)

    def save(self, path, sample: int | None = None, overwrite: bool = False, **options):
        """Write a standalone HTML file that works offline; returns its path."""
        raise NotImplementedError(f"{type(self).__name__} has no offline export")

    def menu_words(self) -> dict[str, dict]:
        """Each menu's labels and the values they stand for, by the parameter it drives
        (a link may give a label): none here."""
        return {}

    def sync_url(self) -> None:
        """Mirror the parameters of ``URL_PARAMS`` in the page's URL (a link reopens the
        view); outside a server this does nothing."""
        location = pn.state.location
        if location is not None:
            # Panel drops every value of a link when one is refused: apply them one by one
            refused = partial(
                apply_each,
                self,
                arguments=self.URL_PARAMS,
                later=once_loaded,
                location=location,
                said=set(),  # the browser hands the link over again as it connects
                words=self.menu_words(),
            )
            location.sync(self, self.URL_PARAMS, on_error=refused)

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = untrusted.notebook_bundle(super()._repr_mimebundle_(include, exclude))
        return with_missing_resources_note(bundle)


# Shown above a notebook's explorer until Panel's JavaScript draws it: where the resources
# never arrive (pn.extension() without inline=True in an offline JupyterLab), the output
# says why instead of staying empty. A script removes it as soon as BokehJS is there.
MISSING_RESOURCES = (
    '<div class="attnpanel-waiting" style="font: 13px sans-serif; color: #555; '
    "padding: 4px 0\">attnpanel: waiting for Panel's JavaScript to draw the explorer. If "
    "nothing appears, the page could not load it: offline, run "
    "<code>pn.extension(inline=True)</code> first, which puts it in the notebook instead "
    "of fetching it from the internet.</div>"
    "<script>(function () { var note = document.currentScript.previousElementSibling;"
    " var poll = setInterval(function () { if (window.Bokeh && window.Bokeh.index"
    " && Object.keys(window.Bokeh.index).length) { note.remove(); clearInterval(poll); }"
    " }, 200); })();</script>"
)


def with_missing_resources_note(bundle):
    """A notebook bundle whose HTML says what is missing when the explorer cannot draw."""
    if not bundle:
        return bundle
    data, metadata = bundle if isinstance(bundle, tuple) else (bundle, None)
    if "text/html" in data:
        data = {**data, "text/html": MISSING_RESOURCES + data["text/html"]}
    return data if metadata is None else (data, metadata)


class LayerExplorer(ExplorerState, Explorer):
    """One attention layer's page: the state, the engine, the linked maps and the sections.

    Parameters
    ----------
    trace : xarray.Dataset
        The trace shown (a multi-layer one gets a layer selector).
    **params
        Initial values of the state's parameters (``sample``, ``head``, ``layer`` ...).
    """

    BACKGROUND: ClassVar[bool] = False  # compute maps on worker threads (LiveEngine)

    def __init__(self, trace: xr.Dataset, **params):
        super().__init__(trace, **params)
        self.engine = LiveEngine(self, background=self.BACKGROUND)
        self.linked = LinkedMaps(self.engine)
        self.sections = self.make_sections(dict(state=self, engine=self.engine))
        self.later = LaterSections()  # what page() puts in place after the first paint
        self._layout = None
        self._url_synced = False
        self._shown_in = None  # the served document whose page this explorer is

    def make_sections(self, parts: dict) -> dict:
        """The kind's sections by name, each built from ``parts`` (the state and engine)."""
        raise NotImplementedError

    def page(self) -> list:
        """The kind's layout under the title and the busy indicator, from its sections
        (those below the fold through ``self.later.hold``: after a served page's first
        paint)."""
        raise NotImplementedError

    def laid_out(self) -> None:
        """Called once when the page has been built (a kind's own wiring; nothing here)."""

    @property
    def widgets(self) -> dict:
        """The page's controls by the parameter they drive (see ``Controls.widgets``)."""
        return self.sections["controls"].widgets

    @property
    def title(self) -> str:
        """The first line of the trace's ``source``, as the page's heading shows it: one
        longer than :data:`TITLE_CHARS` cut after a whole word, with an ellipsis."""
        source = str(self.trace.attrs.get("source", "")).strip() or "trace"
        # a module's repr opens "MultiHeadSelfAttention(": the page says its name
        first = untrusted.short_paths(source.splitlines()[0]).removesuffix("(")
        if len(first) <= TITLE_CHARS:
            return first
        return first[:TITLE_CHARS].rsplit(" ", 1)[0].rstrip(" ,;:") + " …"

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

    @classmethod
    def built(cls, trace: xr.Dataset, **params) -> LayerExplorer:
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
            self._layout = pn.Column(
                self.heading(),
                self.engine.indicator,
                self.engine.scroller,
                *self.page(),
                sizing_mode="stretch_width",
            )
            self.engine.scheduler.root = self._layout
            self.laid_out()
        return self._layout

    def heading(self) -> pn.pane.Markdown:
        """The page's heading: attnpanel and the trace's title."""
        return page_heading(self.title)

    def __panel__(self):
        doc = served_doc()
        if doc is not None and self._shown_in not in (None, doc):
            # one explorer object served to a second page (pn.serve(explorer)): a page's
            # Bokeh models belong to one document, so this page gets an explorer of its own
            return self.another().__panel__()
        if doc is not None:
            self._shown_in = doc
        first = not self._url_synced
        if first:
            self._url_synced = True
            with self.engine.drawing_now():  # the first page shows what the URL says
                self.sync_url()
            once_loaded(self.engine.start_idle)  # maps sent ahead: after the first paint
        layout = self.lay_out()
        if first and (served_doc() is None or pn.state.loaded):
            # a notebook's page, a test's, or one put into a page that has loaded (the
            # loading page's): every section at once (app/later.py says why)
            self.later.fill()
        elif first:  # the sections below the fold: first of the page's idle work
            self.engine.when_idle(self.later.fill_one, first=True)
        return layout

    def menu_words(self) -> dict[str, dict]:
        """Each menu's labels and the values they stand for, by the parameter it drives."""
        controls = self.sections.get("controls")
        found = getattr(controls, "widgets", None) or {}
        return {
            name: dict(widget.options)
            for name, widget in found.items()
            if isinstance(getattr(widget, "options", None), dict)
        }

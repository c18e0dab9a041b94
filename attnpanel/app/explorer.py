"""The attention explorer: the state, the engine and one small section per part of the page.

``AttentionExplorer(trace)`` is a :class:`~attnpanel.app.base.LayerExplorer`: it *is* the
explorer's state (:class:`~attnpanel.app.state.ExplorerState`: sample, layer, head, query,
mask, stage, enabled heads ... as ``param`` parameters), so a notebook user or a test
drives it with ``explorer.param.update(...)``. It composes (through the base):

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

from attnpanel.app.base import LayerExplorer
from attnpanel.app.sections import (
    AttentionMatrix,
    Controls,
    GuidedWalk,
    HeadComparison,
    HeadComposition,
    HeadImportance,
    InputSequence,
    LinkedZoom,
    MergeOutput,
    ModelView,
    PatchingView,
    Positional,
    Projection,
    QueryKeyEmbedding,
    Rollout,
    ShapeTable,
    SurveyView,
    TopAttended,
    ValueAggregation,
    WhyThisCell,
)
from attnpanel.app.url import HeadsOffInUrl, once_loaded
from attnpanel.render.styling import WRAP
from attnpanel.util import untrusted

log = logging.getLogger(__name__)


# the sections under the matrix's row, in order: a served page puts them in place after its
# first paint, which then draws what a 1280 to 1600 px screen shows (docs/explorer.md)
BELOW_THE_FOLD = (
    "top attended",
    "model view",
    "positional",
    "heads",
    "importance",
    "patching",
    "composition",
    "survey",
    "linked zoom",
    "merge",
    "shapes",
)


class AttentionExplorer(LayerExplorer):
    """Explore every stage of one multi-head attention layer captured in a trace.

    Parameters
    ----------
    trace : xarray.Dataset
        A trace (see ``attnpanel.trace``); only ``weights`` is required, views that need
        missing variables say so in their place.
    **params
        Initial values of the state's parameters (``sample``, ``head``, ``layer`` ...).
    """

    # the state mirrored in the page URL: parameter -> query argument (a link opens the view)
    URL_PARAMS = {
        # the layer first: a head, and what the other values mean, are the layer's
        **{name: name for name in ("layer", "sample", "head", "query", "mask", "stage")},
        **{name: name for name in ("step", "colormap")},
        "side_by_side": "beside",
        "show_reference": "reference",
        "show_positional": "positional",
        "show_head_average": "average",
        "show_projection": "projection",
        "show_merge": "merge",
        "show_survey": "survey",
        "show_embedding": "embedding",
        "show_patching": "patching",
        "show_why": "why",
        "why_key": "key",
        "show_composition": "composition",
        "composition": "compose",
        "corruption": "corrupted",
        "corrupt_sample": "other",
        "corrupt_span": "span",
        "patch_what": "patch",
        "maps_ahead": "ahead",
    }

    def sync_url(self) -> None:
        """The URL keeps the selection (:attr:`URL_PARAMS`) and the heads switched off
        (``off=2,5``: :mod:`attnpanel.app.url`)."""
        super().sync_url()
        if pn.state.location is not None:
            HeadsOffInUrl(self, pn.state.location, later=once_loaded).start()

    def laid_out(self) -> None:
        self.sections["matrix"].switch_in_browser(self.widgets, bars="aggregation weights")

    def figure(self, view: str, path, overwrite: bool = False, scale: str = "own"):
        """Write ``view`` (``matrix``, ``heads``, ``model``, ``importance``) as it stands
        now (sample, head, layer, mask, stage) as a figure for a paper: ``.svg``, ``.pdf``
        or ``.png`` (:mod:`attnpanel.render.paper`; ``scale``: the heads' colour scales,
        each head's own or ``"shared"``). Returns the written path."""
        from attnpanel.render import paper

        sel = self.selection
        ranking = None
        if view == "importance" and self.model is not None:
            ranking = self.model.importance(sel.sample)
        element = paper.view_of(view, self.trace, sel, self.layers, ranking, scale)
        return paper.write_figure(element, path, overwrite=overwrite)

    def make_sections(self, parts: dict) -> dict:
        return {
            "controls": Controls(**parts),
            "walk": GuidedWalk(**parts),
            "sequence": InputSequence(**parts),
            "projection": Projection(**parts),
            "matrix": AttentionMatrix(**parts),
            "embedding": QueryKeyEmbedding(**parts),
            "rollout": Rollout(**parts),
            "aggregation": ValueAggregation(**parts),
            "top attended": TopAttended(**parts),
            "model view": ModelView(**parts),
            "positional": Positional(**parts),
            "heads": HeadComparison(linked=self.linked, **parts),
            "importance": HeadImportance(**parts),
            "patching": PatchingView(**parts),
            "why": WhyThisCell(**parts),
            "composition": HeadComposition(**parts),
            "survey": SurveyView(**parts),
            "linked zoom": LinkedZoom(linked=self.linked, **parts),
            "merge": MergeOutput(**parts),
            "shapes": ShapeTable(**parts),
        }

    def page(self) -> list:
        s = self.sections
        return [
            s["controls"],
            s["walk"],
            s["sequence"],
            pn.Row(
                s["projection"],
                s["matrix"],
                s["embedding"],
                s["rollout"],
                s["aggregation"],
                sizing_mode="stretch_width",
                stylesheets=[WRAP],
            ),
            s["why"],  # under the matrix whose clicked cell it explains (hidden until asked)
            # below the fold: in place once the page above is painted (served)
            self.later.notice,
            *(self.later.hold(s[name]) for name in BELOW_THE_FOLD),
        ]

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
            Display resolution of the stored maps (default
            ``attnpanel.render.export_maps.DISPLAY``).
        overwrite : bool
            Replace an existing HTML page at ``path`` (nothing else is ever replaced).

        Returns
        -------
        Path
        """
        from attnpanel.render.export import export_html
        from attnpanel.render.export_maps import DISPLAY

        sample = self.sample if sample is None else sample
        title = untrusted.page_title(self.trace.attrs.get("source", ""))
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

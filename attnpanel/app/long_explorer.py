"""The explorer of a virtual trace: attention at any length (L = 65,536 on one machine).

``explore(trace)`` opens this page for a trace that holds each row's ``lse`` instead of
its maps (:mod:`attnpanel.traces.virtual`). It is the same state (:class:`ExplorerState`), the
same live-update engine and the same linked zoom as the dense explorer, composed of the
sections of :mod:`attnpanel.app.sections.long`: the input sequence over the whole sample, the
selected query's weights over every key, the large map and every head's map. A map's
whole view is its stored overview (:mod:`attnpanel.traces.overviews`, each pixel the maximum of
its cells); zoomed under :data:`attnpanel.readouts.windows.EXACT_CELLS` cells, a window's own
pixels are computed from ``q``, ``k`` and ``lse``.
"""

from __future__ import annotations

from pathlib import Path

import panel as pn
import xarray as xr
from bokeh.models import Range1d

from attnpanel.app.background import served
from attnpanel.app.base import LayerExplorer
from attnpanel.app.sections import LinkedZoom, ShapeTable
from attnpanel.app.sections.long import (
    LongControls,
    LongHeads,
    LongSequence,
    QueryRow,
    WindowedMatrix,
)
from attnpanel.app.sources import VirtualSource
from attnpanel.readouts import windows
from attnpanel.render.styling import WRAP
from attnpanel.traces import virtual
from attnpanel.traces.overviews import Overviews
from attnpanel.util import untrusted


class LongExplorer(LayerExplorer):
    """Explore one attention layer of a virtual trace, at any length.

    Parameters
    ----------
    trace : xarray.Dataset
        A virtual trace (``lse`` instead of ``scores``/``weights``; see
        :func:`attnpanel.traces.virtual.is_virtual`).
    overviews : attnpanel.traces.overviews.Overviews, optional
        Where the maps' overviews are read; by default those stored in ``folder``.
    folder : path, optional
        The overviews' folder (``attnpanel.traces.overviews.folder_for(trace_file)``); None
        keeps the overviews computed by this page in memory.
    **params
        Initial values of the state's parameters (``sample``, ``head``, ``query``, ``mask``).
    """

    URL_PARAMS = {
        # the layer first: a head, and what the other values mean, are the layer's
        **{name: name for name in ("layer", "sample", "head", "query", "mask", "colormap")},
        "maps_ahead": "ahead",
    }
    BACKGROUND = True  # maps never block the server

    def __init__(
        self,
        trace: xr.Dataset,
        overviews: Overviews | None = None,
        folder: str | Path | None = None,
        **params,
    ):
        if not virtual.is_virtual(trace):
            raise ValueError(
                "LongExplorer shows a virtual trace (one holding 'lse'); use "
                "attnpanel.explore for a dense one"
            )
        if params.get("head") == "mean":
            raise ValueError("a virtual trace is shown one head at a time: give a head number")
        self._overviews, self._folder = overviews, folder
        super().__init__(trace, **params)

    def make_sections(self, parts: dict) -> dict:
        self.param.head.objects = list(range(self.n_heads))
        stack = self.trace if self.layers is None else self.layers
        self.source = VirtualSource(self, self._overviews or Overviews(stack, self._folder))
        self.x_range = Range1d(-0.5, self.trace.sizes["query"] - 0.5)  # sequence and row
        reading = dict(source=self.source, **parts)
        return {
            "controls": LongControls(**parts),
            "sequence": LongSequence(x_range=self.x_range, **parts),
            "query row": QueryRow(x_range=self.x_range, **reading),
            "matrix": WindowedMatrix(**reading),
            "heads": LongHeads(linked=self.linked, **reading),
            "linked zoom": LinkedZoom(linked=self.linked, **parts),
            "shapes": ShapeTable(**parts),
        }

    @property
    def overviews(self) -> Overviews:
        """The overviews the maps are drawn from."""
        return self.source.overviews

    def page(self) -> list:
        s = self.sections
        n = self.trace.sizes["query"]
        side = int(windows.EXACT_CELLS**0.5)
        about = pn.pane.Markdown(
            f"A **virtual trace**: {n:,} positions, {self.n_heads} heads; no map is held. "
            "Every map shows each pixel's *maximum* weight (a single sharp key is never "
            "averaged away): the stored overview over the whole map; zoomed in, the window's "
            "own pixels, computed from q, k and each row's log-sum-exp (at once up to "
            f"{side:,} x {side:,} cells; a larger window shows the overview's blocks first, "
            "then its own pixels once computed). A query's row is computed alone.",
            sizing_mode="stretch_width",
            styles={"font-size": "12px"},
            margin=(0, 10),
        )
        return [
            about,
            s["controls"],
            s["sequence"],
            s["query row"],
            pn.Row(s["matrix"], s["heads"], sizing_mode="stretch_width", stylesheets=[WRAP]),
            s["linked zoom"],
            s["shapes"],
        ]

    def laid_out(self) -> None:
        self.sections["matrix"].switch_in_browser(self.widgets)
        if served(pn.state.curdoc):
            pn.state.on_session_destroyed(self._closed)

    def _closed(self, _session_context) -> None:
        self.engine.background.close()

    def save(self, path, sample: int | None = None, overwrite: bool = False):
        """Write a standalone HTML file that works offline: every head's map (its overview,
        each pixel the maximum weight of its cells) under the mask shown, the input
        sequence and the selected query.

        Parameters
        ----------
        path : str or Path
            The HTML file to write.
        sample : int, optional
            The sample to export; defaults to the one shown.
        overwrite : bool
            Replace an existing HTML page at ``path`` (nothing else is ever replaced).

        Returns
        -------
        Path
        """
        from attnpanel.render.export import export_html

        source = str(self.trace.attrs.get("source", "")).strip()
        return export_html(
            self.trace,
            path,
            sample=self.sample if sample is None else sample,
            title=untrusted.page_title(source),
            overwrite=overwrite,
            query=self.query,
            masks=[self.mask],
            overviews=self.overviews,
            layer=None if self.layers is None else self.layer,
        )

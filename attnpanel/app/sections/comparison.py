"""The comparison page's sections: two captures of the same inputs, head by head.

The state (an :class:`~attnpanel.app.state.ExplorerState`) holds capture A and the
selection (sample, layer, head); :class:`ComparedPair` holds capture B beside it and how far
apart every head is (:func:`attnpanel.readouts.compare.ranked_heads`). The sections read B
through the pair, a ``param.ClassSelector`` of each, as the long page's sections read their
maps through a source:

- :class:`CompareControls`: the layer, sample and head selectors;
- :class:`ComparedMaps`: A, B and B - A of the open head, each regridded from the full map
  by datashader for its window (linked zoom: the three share their ranges, and each is
  re-rasterized for the window at full resolution); B - A is centred on 0;
- :class:`HeadRanking`: the heads by divergence, a click on a bar opens its head.
"""

from __future__ import annotations

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr
from bokeh.models import HoverTool

from attnpanel.app.sections.base import Section
from attnpanel.app.sections.controls import (
    ImmediateIntSlider,
    WidgetRow,
    head_selector,
    layer_selector,
)
from attnpanel.app.sections.matrix import matrix_style
from attnpanel.readouts import core
from attnpanel.readouts.core import StageCache
from attnpanel.render import compare_views
from attnpanel.render.elements import PlotKey
from attnpanel.render.styling import WRAP
from attnpanel.util import untrusted

COMPARED_SIZE = 270  # frame of each of the three maps: side by side at 1280 px (412 px each)
RANKED = 24  # heads the ranking chart shows, most different first
RANK_HEIGHT = 17  # pixels per ranked head
RANKING_WIDTH = 560
RANKING_KEY = PlotKey("Rectangles", "Ranking")
RANKING_TIPS = [
    ("head", "@name"),
    ("js (nats)", "@value{0.00000}"),
    ("max |b − a|", "@max_abs{0.0000}"),
]


class ComparedPair(param.Parameterized):
    """Capture B beside the state's capture A, and every head ranked by divergence.

    Parameters
    ----------
    other : xarray.Dataset
        B: a capture of the same inputs as the state's trace (A), by a model of the same
        shape (:func:`attnpanel.readouts.compare.check_comparable`).
    ranking : pandas.DataFrame
        Every head of A and B, most different first
        (:func:`attnpanel.readouts.compare.ranked_heads`).
    labels : (str, str)
        What the page calls A and B (the captures' sources).
    """

    other = param.ClassSelector(class_=xr.Dataset, doc="B, compared with the state's A.")
    ranking = param.DataFrame(doc="Every head, most different first (ranked_heads).")
    labels = param.Tuple(default=("a", "b"), length=2, doc="What the page calls A and B.")

    def __init__(self, **params):
        super().__init__(**params)
        self.cache = StageCache.shared(self.other)  # B's recomputed maps, as A's state keeps

    def b_trace(self, layer: int) -> xr.Dataset:
        """B's Dataset of one layer (by position)."""
        return core.at_layer(self.other, layer)

    def maps(self, a: xr.Dataset, sel: core.Selection, cache: StageCache) -> tuple:
        """``(a, b)``: the ``(query, key)`` softmax weights of the selected sample and head
        in A and in B, each under its own capture's mask (blocked cells NaN), float32."""
        own = sel.with_(stage="softmax", mask=None)
        first = core.attention_values(a, own, cache)
        second = core.attention_values(self.b_trace(sel.layer), own, self.cache)
        return first, second

    def difference(self, a: xr.Dataset, sel: core.Selection, cache: StageCache) -> np.ndarray:
        """``b - a`` of the selected sample and head (as ``compare`` computes it), NaN where
        either capture blocked the cell."""
        first, second = self.maps(a, sel, cache)
        return second - first

    def numbers(self, layer: int, head: int) -> pd.Series:
        """The ranking's row of one head (``rank`` added, from 1)."""
        found = self.ranking[(self.ranking["layer"] == layer) & (self.ranking["head"] == head)]
        row = found.iloc[0].copy()
        row["rank"] = int(found.index[0]) + 1
        return row


class CompareControls(WidgetRow):
    """The layer (for a capture of several), sample and head of the three maps."""

    def make_widgets(self, state) -> dict:
        widgets = layer_selector(state)
        if "layer" in widgets:
            widgets["layer"].width = 320  # room for a module's name
        widgets.update(
            sample=ImmediateIntSlider.from_param(state.param.sample, name="Sample", width=180),
            head=head_selector(state, width=125),
        )
        return widgets


class ComparedMaps(Section):
    """A, B and B - A of the open head, side by side, zooming together."""

    pair = param.ClassSelector(class_=ComparedPair, doc="Capture B and the ranking.")
    title = "A, B and B − A"

    def __init__(self, **params):
        super().__init__(**params)
        self.caption = pn.pane.Markdown("", margin=(0, 10), sizing_mode="stretch_width")
        self.engine.follow(self._caption, ["layer", "head"])
        self._caption()

    def build(self):
        a, b = (untrusted.markup(label) for label in self.pair.labels)
        weights = core.both_weights_words(self.trace, self.pair.other)
        about = pn.pane.Markdown(
            f"**A**: {a} · **B**: {b}, run on the same inputs. Each map is the model's own "
            f"{weights} of the selected sample and head (rows: queries, columns: keys; "
            "masked cells black); **B − A** is centred on 0: red where B attends more, blue "
            "where it attends less. Zoom or pan any map (wheel, box zoom): the three follow, "
            "each re-rasterized from the full map at full resolution.",
            sizing_mode="stretch_width",
            styles={"font-size": "12px"},
            margin=(0, 10),
        )
        maps = [
            self._map("A", "a", "Attention", 0, f"{weights} A"),
            self._map("B", "b", "Attention", 1, f"{weights} B"),
            self._map("B − A", "difference", "Difference", None, "B − A"),
        ]
        return pn.Column(
            self.heading(),
            about,
            self.caption,
            # each map in a column of its own: a pane straight in a stretching row is
            # stretched with it (its frame widened, its colour bar cut off)
            pn.Row(
                *(pn.Column(plot, margin=0) for plot in maps),
                sizing_mode="stretch_width",
                stylesheets=[WRAP],
            ),
            sizing_mode="stretch_width",
            margin=0,
        )

    def _map(self, which: str, pane: str, group: str, side: int | None, value_label: str):
        def build(sel):
            if side is None:
                values = self.pair.difference(self.trace, sel, self.cache)
            else:
                values = self.pair.maps(self.trace, sel, self.cache)[side]
            return values, compare_views.compared_title(which, self.trace, sel), value_label

        raster = self.engine.add(
            f"{pane} map",
            build,
            ["sample", "head"],
            pane,
            raster=(COMPARED_SIZE, COMPARED_SIZE),
            group=group,
            first=True,
        )
        # A and B in the attention matrix's colours; B - A in its group's centred map
        cmap = self.state.colormap if side is not None else None
        style = matrix_style(cmap, title_size="10pt", size=COMPARED_SIZE)
        element = raster.element(hv.Dimension("value", label=value_label))
        # every map of the page shares one pair of ranges: zoom one, the others follow
        return self.engine.render(element, pane, style=style, linked=True, margin=(0, 10, 10, 0))

    def _caption(self, *_events) -> None:
        row = self.pair.numbers(self.state.layer, int(self.state.head))
        name = compare_views.head_name(row["layer_name"], int(row["head"]))
        heads = len(self.pair.ranking)
        if np.isfinite(row["js"]):
            numbers = (
                f"Jensen-Shannon divergence **{row['js']:.4g}** nats (mean over "
                f"{int(row['rows'])} real query rows of every sample), largest |b − a| "
                f"**{row['max_abs']:.4g}**"
            )
        else:
            numbers = "no real query row to compare"
        self.caption.object = (
            f"{untrusted.markup(name)}: rank **{row['rank']}** of {heads} · {numbers}."
        )


class HeadRanking(Section):
    """The heads by divergence, most different first; a click on a bar opens its head."""

    pair = param.ClassSelector(class_=ComparedPair, doc="Capture B and the ranking.")
    title = "Heads ranked by divergence (click a bar to open its head)"

    @property
    def shown(self) -> pd.DataFrame:
        """The heads the chart shows: the :data:`RANKED` most different."""
        return self.pair.ranking.head(RANKED)

    def build(self):
        shown = self.shown
        # the bars never change (the divergence is over every sample); the outline of the
        # open head follows it
        bars = self.engine.add(
            "head ranking",
            lambda sel: compare_views.ranking_view(shown),
            [],
            "ranking",
            title=False,
            follows_layer=False,
        )
        outline = self.engine.add(
            "open head in the ranking",
            lambda sel: compare_views.opened_row(shown, sel.layer, int(sel.head)),
            ["head"],
            "ranking",
            title=False,
        )
        element = hv.Overlay([*bars, outline])
        total = len(self.pair.ranking)
        which = f"the {len(shown)} most different of {total} heads" if total > len(shown) else ""
        height = 70 + RANK_HEIGHT * len(shown)
        style = dict(
            width=RANKING_WIDTH,
            height=height,
            title=which or f"every head ({total})",
            yticks=compare_views.ranking_ticks(shown),
            xlabel=compare_views.JS_LABEL,
            ylabel="",
            xlim=(0.0, compare_views.label_column(shown)),
            ylim=(len(shown) - 0.5, -0.5),  # the most different on top
            toolbar=False,
        )
        pane = self.engine.render(element, "ranking", style=style, on_tap=self.click)
        for handles in self.engine.handles("ranking", RANKING_KEY):
            for hover in handles["plot"].select({"type": HoverTool}):
                hover.tooltips = RANKING_TIPS
        return pn.Column(self.heading(), pane, margin=0)

    def click(self, x=None, y=None) -> None:
        """A click on the chart: open the head of the bar under it."""
        if y is None:
            return
        found = compare_views.ranked_at(self.shown, y)
        if found is None:
            return
        layer, head = found
        change = {"head": head}
        if self.state.layers is not None:
            change["layer"] = layer
        self.engine.soon(self.state.param.update, **change)

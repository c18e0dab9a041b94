"""Head comparison: every head's softmax map side by side, and the linked zoom below.

Each head has a tile (white to the head's colour, grey while the head is off) in one figure
(:class:`attnpanel.render.head_grid.HeadGrid`) and a toggle under it that keeps the head in the
merge or drops it. The tiles show the window of the large matrix (a wheel over the matrix
zooms them too, re-rasterized), and a drag on a tile draws a box whose attention mass the
:class:`LinkedZoom` section compares across heads.
"""

from __future__ import annotations

from functools import partial

import panel as pn
import param

from attnpanel.app import linked
from attnpanel.app.linked import LinkedMaps
from attnpanel.app.sections.base import Section
from attnpanel.readouts import core
from attnpanel.readouts.core import MissingVariable
from attnpanel.readouts.roles import trace_roles
from attnpanel.render import model_views, styling, views
from attnpanel.render.elements import HEAD_MAP_KEY, PlotKey
from attnpanel.render.head_grid import GAP_PX, HeadGrid
from attnpanel.render.palette import head_color
from attnpanel.render.styling import WRAP
from attnpanel.render.titles import fit_title
from attnpanel.util.kept import Kept

HEAD_MAP_SIZE = 140
GRID_PANE = "head maps"  # the one figure holding every head's tile
QUERY_BAND_KEY = PlotKey("HSpan", "Marker")
SHARES_KEY = PlotKey("MassShares", "MassShare")
HEAD_AVERAGE_COLORS = styling.head_cmap(0, enabled=False)  # white to grey
# the tiles name each head's role where one sample's maps of the layer hold at most this
# many cells (16 heads x 1,024^2: a few tens of ms), not on a longer trace's event loop
ROLE_CELLS = 16 * 1024 * 1024


class HeadComparison(Section):
    """Every head's softmax map in one figure, a toggle per head, and the head average."""

    title = "Head comparison: {weights} per head (switch a head off to drop it from the merge)"
    linked = param.ClassSelector(class_=LinkedMaps, doc="The linked maps' window and box.")

    def __init__(self, **params):
        super().__init__(**params)
        self.grid: HeadGrid | None = None
        self.toggles: pn.widgets.CheckButtonGroup | None = None
        self.average = HeadAverage(state=self.state, engine=self.engine)
        self.state.param.watch(self._recolor, "enabled_heads")
        self.engine.follow(self.name_tiles, ["sample", "layer"])
        self._names = Kept(3)  # the shown sample's tile names and its neighbours'
        self.engine.ahead(lambda sel: [partial(self.tile_names, sel)])

    def build(self):
        try:
            grid = self._grid()
        except MissingVariable as err:
            return pn.Column(self.heading(), self.missing(err, HEAD_MAP_SIZE, HEAD_MAP_SIZE))
        return pn.Column(
            self.heading(),
            pn.Row(
                pn.Column(
                    pn.pane.Bokeh(grid.figure),
                    self.make_toggles(),
                    margin=0,
                    sizing_mode="stretch_width",
                    max_width=grid.figure.max_width + 10,
                ),
                self.average,
                margin=0,
                sizing_mode="stretch_width",
                stylesheets=[WRAP],  # the average goes under the tiles when they fill a line
            ),
            self.make_summary(),
            sizing_mode="stretch_width",
        )

    def _grid(self) -> HeadGrid:
        """The tiles, each a view of the engine redrawn for the sample, mask and window."""
        state = self.state
        rasters = [
            self.engine.add(
                f"head {head} map",
                partial(self.head_values, head),
                ["sample", "mask"],
                f"head {head}",
                raster=(HEAD_MAP_SIZE, HEAD_MAP_SIZE),
                group="HeadMap",
                title=False,
                refine=partial(self.head_refined, head),
            )
            for head in range(state.n_heads)
        ]
        enabled = set(state.enabled_heads)
        grid = HeadGrid(
            state.n_heads,
            HEAD_MAP_SIZE,
            [styling.head_cmap(h, h in enabled) for h in range(state.n_heads)],
            rasters[0].bounds,
            self.linked.select_overlay(),
        )
        for head, raster in enumerate(rasters):
            grid.push_tile(grid.tiles[head], raster)
            self.engine.record(f"head {head}", HEAD_MAP_KEY, grid.tiles[head])
        marker = self.engine.add(
            "head maps query marker",
            lambda sel: views.query_marker(self.trace, sel),
            ["query"],
            GRID_PANE,
            title=False,
            first=True,
        )
        band = {"plot": grid.figure, "source": grid.query_band, "push": grid.push_query}
        grid.push_query(band, marker)
        self.engine.record(GRID_PANE, QUERY_BAND_KEY, band)
        grid.on_select(self.linked.select)
        shares = self.engine.add(
            "mass share",
            self.mass_shares,
            ["sample", "mask", "enabled_heads"],
            GRID_PANE,
            slow=True,  # a box on a long trace reads every cell in it
        )
        strip = {"plot": grid.figure, "source": grid.shares, "push": grid.push_shares}
        grid.push_shares(strip, shares)
        grid.figure.title.text = fit_title(grid.figure, shares.label)
        self.engine.record(GRID_PANE, SHARES_KEY, strip)
        self.linked.on_box(self._on_box)
        grid.mark_box(self.linked.box)
        self.grid = grid
        self.engine.soon(self.name_tiles)  # after the first paint: the roles read every cell
        return grid

    def _on_box(self) -> None:
        if self.grid is not None:
            self.grid.mark_box(self.linked.box)
            self.engine.redraw(lambda view: view.name == "mass share")

    # Hooks a kind of page overrides (the long page: LongHeads): where the shares, the tiles,
    # their exact versions, the toggles and the summary come from.
    def mass_shares(self, sel) -> linked.MassShares:
        """Each head's share of attention mass in the linked box."""
        return linked.mass_shares(self.trace, sel, self.cache, self.linked.box)

    def tile_names(self, sel) -> list[str]:
        """The words under each tile: the head and its role on the shown sample
        (:func:`attnpanel.readouts.roles.trace_roles`), where the trace holds weights."""
        n_heads = self.state.n_heads
        sizes = self.trace.sizes
        if n_heads * sizes["query"] * sizes["key"] > ROLE_CELLS:
            return [f"head {h}" for h in range(n_heads)]  # too long to read on a click

        def compute():
            found = trace_roles(self.trace, sel.sample)
            if found is None:
                return [f"head {h}" for h in range(n_heads)]
            roles = found["role"].values[0]
            return [f"head {h} · {roles[h]}" for h in range(n_heads)]

        return self._names.get((sel.layer, sel.sample), compute)

    def name_tiles(self) -> None:
        """Write the tiles' names for the shown layer and sample."""
        if self.grid is not None:
            try:
                self.grid.set_names(self.tile_names(self.state.selection))
            except Exception as err:  # noqa: BLE001 - shown to the user; the page goes on
                self.engine.report(err, "naming the heads' roles")

    def head_values(self, head: int, sel):
        """A head's tile: its map (or a map source) and its title."""
        return (
            core.attention_values(self.trace, sel.with_(head=head, stage="softmax"), self.cache),
            f"head {head}",
        )

    def head_refined(self, head: int, sel):
        """A slower, exact version of a head's tile to draw next, or None (here: never; a
        page whose tiles may first be cut from a coarser overview says otherwise)."""
        return None

    def make_toggles(self) -> pn.widgets.CheckButtonGroup:
        """One button per head under its tile, in the head's colour while it is on."""
        n_heads = self.state.n_heads
        columns = self.grid.columns
        width = columns * HEAD_MAP_SIZE + (columns - 1) * GAP_PX
        self.toggles = pn.widgets.CheckButtonGroup(
            options={f"head {h}": h for h in range(n_heads)},
            value=list(self.state.enabled_heads),
            max_width=width,
            sizing_mode="stretch_width",  # under the tiles, however wide they are drawn
            margin=(4, 5),
            stylesheets=[toggles_css(n_heads, columns)],
        )
        self.toggles.param.watch(self._on_toggles, "value")
        return self.toggles

    def _on_toggles(self, event) -> None:
        self.state.enabled_heads = sorted(event.new)

    def make_summary(self):
        """Per head: mean attention distance, most-attended lag, entropy (a table)."""
        try:
            table = self.engine.add(
                "head summary",
                lambda sel: views.head_summary_view(self.trace, sel, self.cache),
                ["sample", "mask"],
                "head summary",
                title=False,
            )
        except MissingVariable as err:
            return self.missing(err, 600)
        height = 30 + 25 * self.state.n_heads
        width = 110 * len(table.dimensions())
        return pn.Column(
            pn.pane.Markdown(
                "**Where each head looks** in the sample and mask shown: mean attention "
                "distance, the most common lag (key − query) of each query's top key and the "
                "share of queries there, entropy relative to uniform",
                margin=(5, 5, 0, 5),
            ),
            self.engine.render(
                table, "head summary", style=dict(width=width, height=height), margin=5
            ),
            margin=0,
        )

    def _recolor(self, *_events) -> None:
        enabled = set(self.state.enabled_heads)
        if self.grid is not None:
            for head in range(self.state.n_heads):
                self.grid.set_palette(head, styling.head_cmap(head, head in enabled))
        if self.toggles is not None and set(self.toggles.value) != enabled:
            self.toggles.value = sorted(enabled)


class HeadAverage(Section):
    """The head-average map beside the head maps, shown while ``show_head_average`` is on."""

    shown_by = "show_head_average"

    def build(self):
        size = HEAD_MAP_SIZE
        state = self.state
        try:
            raster = self.engine.add(
                "head average map",
                lambda sel: (
                    model_views.head_average_values(self.trace, sel, self.cache),
                    "head average",
                ),
                ["sample", "mask"],
                "head average",
                raster=(size, size),
                group="HeadMap",
                active=lambda: state.show_head_average,
            )
        except (MissingVariable, ValueError) as err:
            return self.missing(MissingVariable("weights", str(err)), size, size)
        note = pn.pane.Markdown(
            "mean of all heads: what `nn.MultiheadAttention` returns",
            width=size,
            margin=(0, 5),
            styles={"font-size": "11px"},
        )
        image = raster.element("weight")
        return pn.Column(
            self.engine.render(
                image, "head average", style=small_map(HEAD_AVERAGE_COLORS), linked=True
            ),
            note,
            margin=(0, 0, 0, 15),
        )

    def reshown(self) -> None:
        # skipped while hidden (``active``)
        self.engine.redraw(lambda view: view.name == "head average map")


class LinkedZoom(Section):
    """How to zoom every map and compare the heads in a box, and the button that clears it.

    The shares themselves are drawn under the head tiles (:class:`HeadComparison`).
    """

    linked = param.ClassSelector(class_=LinkedMaps, doc="The linked maps' zoom and box.")

    def build(self):
        clear = pn.widgets.Button(label="Clear box", width=100, margin=(5, 5))
        clear.on_click(self.linked.clear)
        note = pn.pane.Markdown(
            "**Zoom and compare heads.** Wheel over the matrix: zoom it and every head's tile "
            "(re-rasterized at full resolution). Drag on a head's tile (or use the matrix's "
            "box select): under each tile, the share of that head's attention, from the "
            f"box's queries, that goes to the box's keys ({linked.SHARE_LABEL}).",
            sizing_mode="stretch_width",
            max_width=700,
            styles={"font-size": "12px"},
            margin=(5, 5),
        )
        return pn.Row(note, clear, margin=(0, 0), sizing_mode="stretch_width")


def small_map(cmap) -> dict:
    """How a small map looks: no axes, a wheel that zooms every linked map."""
    return dict(
        frame_width=HEAD_MAP_SIZE,
        frame_height=HEAD_MAP_SIZE,
        cmap=cmap,
        xaxis=False,
        yaxis=False,
        tools=("wheel_zoom",),
    )


def toggles_css(n_heads: int, columns: int) -> str:
    """The head toggles: one button per tile, ``columns`` to a line like the tiles, each
    filled with its head's colour while the head is on."""
    # !important: Panel's own button stylesheets load after this one.
    rules = [
        f":host .bk-btn-group {{ display: flex; flex-wrap: wrap; gap: {GAP_PX}px; }}",
        f":host .bk-btn-group > .bk-btn {{ flex: 0 0 calc((100% - {(columns - 1) * GAP_PX}px)"
        f" / {columns}); min-width: 0; border-radius: 4px !important; margin: 0 !important; }}",
    ]
    for head in range(n_heads):
        color = head_color(head)
        red, green, blue = (int(color[i : i + 2], 16) for i in (1, 3, 5))
        text = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "white"
        nth = f":host .bk-btn-group > .bk-btn:nth-child({head + 1})"
        rules.append(f"{nth} {{ border: 2px solid {color} !important; }}")
        rules.append(
            f"{nth}.bk-active {{ background-color: {color} !important; color: {text} !important; }}"
        )
    return "\n".join(rules)

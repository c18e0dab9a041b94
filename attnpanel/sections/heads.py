"""Head comparison: every head's softmax map side by side, and the linked zoom below.

Each head has a small map (white to the head's colour, grey while the head is off) and a
toggle that keeps it in the merge or drops it. The maps share their ranges with the large
matrix: a wheel zooms all of them, and a drag on a head map draws a box whose attention
mass the :class:`LinkedZoom` section compares across heads.
"""

from __future__ import annotations

import panel as pn
import param

from attnpanel import linked, model_views, views
from attnpanel.engine import PlotKey
from attnpanel.linked import LinkedMaps
from attnpanel.palette import head_color
from attnpanel.readouts import MissingVariable
from attnpanel.sections.base import Section
from attnpanel.styling import WRAP

HEAD_MAP_SIZE = 140
HEAD_MAP_KEY = PlotKey("Image", "HeadMap")
HEAD_AVERAGE_COLORS = views.head_cmap(0, enabled=False)  # white to grey


class HeadComparison(Section):
    """A small softmax map and an on/off toggle per head, and the head average."""

    title = (
        "Head comparison: softmax weights per head (switch a head off to drop it from the merge)"
    )

    def __init__(self, **params):
        super().__init__(**params)
        self.toggles: list[pn.widgets.Toggle] = []  # one per head, in head order
        self.average = HeadAverage(state=self.state, engine=self.engine)
        self.state.param.watch(self._recolor, "enabled_heads")

    def build(self):
        cells = [self._head_cell(head) for head in range(self.state.n_heads)]
        return pn.Column(
            self.heading(),
            # Wraps onto a second line for models with more heads than fit (MiniLM has 12).
            # A wrapping Row, not pn.FlexBox: nested in another layout (the DataTree
            # explorer, a notebook cell) a FlexBox's figures never report painted, the
            # page never becomes idle, and Panel then drops every later update.
            pn.Row(
                *cells,
                self.average,
                margin=0,
                sizing_mode="stretch_width",
                stylesheets=[WRAP],
            ),
            self._summary(),
            sizing_mode="stretch_width",
        )

    def _summary(self):
        """Per head: mean attention distance, most-attended lag, entropy (a table)."""
        try:
            table = self.engine.add(
                "head summary",
                lambda sel: views.head_summary(self.trace, sel, self.cache),
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

    def _title(self, head: int) -> str:
        return f"head {head}" + ("" if head in self.state.enabled_heads else " (off)")

    def _head_cell(self, head: int):
        pane = f"head {head}"
        try:
            raster = self.engine.add(
                f"head {head} map",
                lambda sel: (
                    views.attention_values(
                        self.trace, sel.with_(head=head, stage="softmax"), self.cache
                    ),
                    self._title(head),
                ),
                ["sample", "mask"],
                pane,
                raster=(HEAD_MAP_SIZE, HEAD_MAP_SIZE),
                group="HeadMap",
            )
        except MissingVariable as err:
            return self.missing(err, HEAD_MAP_SIZE, HEAD_MAP_SIZE)
        enabled = head in self.state.enabled_heads
        image = self.marked(raster.element("weight"), f"head {head} query marker", pane)
        style = small_map(views.head_cmap(head, enabled))
        toggle = pn.widgets.Toggle(
            label=f"head {head}",
            value=enabled,
            width=HEAD_MAP_SIZE,
            margin=(0, 5),
            stylesheets=[toggle_css(head_color(head))],
        )
        toggle.param.watch(lambda event: self.state.toggle_head(head, event.new), "value")
        self.toggles.append(toggle)
        return pn.Column(
            self.engine.render(image, pane, style=style, linked=True), toggle, margin=0
        )

    def _recolor(self, *_events) -> None:
        for head in range(self.state.n_heads):
            enabled = head in self.state.enabled_heads
            palette = views.head_cmap(head, enabled)
            for handles in self.engine.handles(f"head {head}", HEAD_MAP_KEY):
                handles["color_mapper"].palette = palette
                handles["plot"].title.text = self._title(head)
        for head, toggle in enumerate(self.toggles):
            toggle.value = head in self.state.enabled_heads


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
    """The share of each head's attention mass in the box drawn on the maps."""

    linked = param.ClassSelector(class_=LinkedMaps, doc="The linked maps' zoom and box.")

    def __init__(self, **params):
        super().__init__(**params)
        self.linked.on_box(self._on_box)

    def build(self):
        try:
            bars = self.engine.add(
                "mass share",
                lambda sel: linked.mass_bars(self.trace, sel, self.cache, self.linked.box),
                ["sample", "mask", "enabled_heads"],
                linked.MASS_PANE,
            )
        except MissingVariable as err:
            return self.missing(err, 420)
        clear = pn.widgets.Button(label="Clear box", width=100, margin=(10, 5))
        clear.on_click(self.linked.clear)
        note = pn.pane.Markdown(
            "Wheel: zoom every map (re-rasterized at full resolution). Drag on a head map "
            "(or use the matrix's box select): the share of each head's attention, from "
            f"the box's queries, that goes to the box's keys ({linked.SHARE_LABEL}).",
            width=260,
            styles={"font-size": "11px"},
            margin=(20, 5),
        )
        pane = self.engine.render(
            bars, linked.MASS_PANE, style=dict(width=420, height=190, ylim=(0, 1))
        )
        return pn.Row(pane, pn.Column(note, clear), margin=(5, 0))

    def _on_box(self) -> None:
        self.engine.redraw(lambda view: view.pane == linked.MASS_PANE)


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


def toggle_css(color: str) -> str:
    """Stylesheet filling a head's toggle button with the head's colour while it is on."""
    # !important: Panel's own button stylesheets load after this one.
    red, green, blue = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    text = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "white"
    return (
        f":host .bk-btn.bk-active {{ background-color: {color} !important; color: {text} "
        f"!important; border-color: {color} !important; }}"
        f":host .bk-btn {{ border: 2px solid {color} !important; }}"
    )

"""The colours that tell heads apart, shared by the explorer and the offline export.

A module of its own so that the export (which writes Bokeh directly) needs no HoloViews.
"""

from __future__ import annotations

import colorcet

from attnpanel.readouts.core import PREDICTED

HIGHLIGHT = "#39ff14"  # the selected query: its row on every map, its marker on the curve
# the reference series' curves (truth solid, prediction dashed), in order
SERIES_COLORS = ("#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#7f7f7f")
QUERY_COLOR, KEY_COLOR = "#0072b2", "#d55e00"  # a score's two sides: blue and vermillion


def curve_styles(labels) -> list[dict]:
    """The line of each series of the top view, in order: the first (the input signal) black
    and thicker, each reference series its colour, its prediction dashed in the same colour."""
    palette = ("black", *SERIES_COLORS)
    colors: dict[str, str] = {}
    styles = []
    for i, label in enumerate(labels):
        name = label.removesuffix(PREDICTED)
        color = colors.setdefault(name, palette[len(colors) % len(palette)])
        dash = "dashed" if label.endswith(PREDICTED) else "solid"
        styles.append(dict(line_color=color, line_width=1.6 if i == 0 else 1, line_dash=dash))
    return styles


HEAD_COLORS = (
    "#0072b2",
    "#e69f00",
    "#009e73",
    "#cc79a7",
    "#56b4e9",
    "#d55e00",
    "#882255",
    "#f0e442",
)


def legend_swatch(fig, color: str, alpha: float = 1.0, **legend):
    """A quad at NaN coloured ``color``, the glyph a legend item draws: Bokeh draws it from
    the renderer's first row, so a data renderer's own (a weight's alpha, the first sample's
    corner) would show a blank swatch or pull the data ranges; a row of NaN draws nothing
    on the plot and leaves the ranges alone."""
    nan = [float("nan")]
    return fig.quad(
        left=nan,
        right=nan,
        bottom=nan,
        top=nan,
        fill_color=color,
        fill_alpha=alpha,
        line_color=None,
        **legend,
    )


def head_color(head: int) -> str:
    """Head ``head``'s colour: the 8 Okabe-Ito colours, then Glasbey's (distinct up to 256)."""
    if head < len(HEAD_COLORS):
        return HEAD_COLORS[head]
    extra = colorcet.b_glasbey_category10[len(HEAD_COLORS) :]
    return extra[(head - len(HEAD_COLORS)) % len(extra)]

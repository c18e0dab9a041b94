"""How the views look: HoloViews options, head colours and palettes.

The views return plain data elements whose group and label say what they are; this
module styles them once per plot (``.opts(*options())``), never on the update path.
"""

from __future__ import annotations

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401  (registers the backend that .opts below needs)
import numpy as np
from bokeh.models import BasicTickFormatter

from attnpanel.render.palette import HIGHLIGHT, KEY_COLOR, QUERY_COLOR, head_color

# The options below are Bokeh's: they apply when Bokeh is HoloViews' current backend (a
# notebook user's ``.opts(*options())`` without ``hv.extension("bokeh")`` first).
hv.Store.set_current_backend("bokeh")


# The look of each (element kind, group), in Bokeh's property names: the one table both
# drawing paths read, the served page's (attnpanel.render.figures.draw) and a notebook's
# HoloViews elements (options() below translates it).
LOOK = {
    ("Rectangles", "Vector"): dict(line_color=None),
    ("Rectangles", "QueryWeights"): dict(line_color=None, fill_alpha=0.55),
    ("Rectangles", "Tokens"): dict(line_color="#888888"),
    ("Rectangles", "Selected"): dict(fill_alpha=0, line_color=HIGHLIGHT, line_width=4),
    ("VSpans", "Lanes"): dict(fill_color="#000000", fill_alpha=0.06, line_color=None),
    ("VLine", "Marker"): dict(line_color=HIGHLIGHT, line_width=3, line_alpha=0.9),
    ("VSpan", "Marker"): dict(fill_color=HIGHLIGHT, fill_alpha=0.25, line_alpha=0),
    ("HSpan", "Marker"): dict(
        fill_color=HIGHLIGHT, fill_alpha=0.15, line_color=HIGHLIGHT, line_width=1.5
    ),
    ("Curve", "Reference"): dict(line_color="black", line_width=1.2),
    ("Curve", "Sequence"): dict(line_width=1),
    ("Curve", "QueryRow"): dict(line_color="#b2182b", line_width=1),
    ("Scatter", "TopKeys"): dict(fill_color=HIGHLIGHT, line_color="black", size=7, marker="circle"),
    ("Labels", "Tokens"): dict(text_font_size="11pt", text_color="black"),
    ("Labels", "Roles"): dict(text_font_size="7pt", text_color="#b2182b", text_font_style="bold"),
    ("Labels", "Copying"): dict(text_font_size="7pt", text_color="#0072b2"),
    ("Image", "Attention"): dict(cmap="coolwarm", nan_color="black"),
    ("Image", "HeadMap"): dict(nan_color="#222222"),
    ("Image", "Weight"): dict(cmap="RdBu_r", nan_color="white"),
    ("Image", "ModelView"): dict(cmap="Greys", nan_color="white"),
    ("Image", "Pair"): dict(cmap="Greys", nan_color="white"),  # a composed pair's maps
    ("Image", "Positional"): dict(cmap="RdBu_r"),
    ("Image", "Importance"): dict(cmap="Blues", nan_color="white"),
    ("Image", "Rollout"): dict(cmap="Greys", nan_color="white"),
    # b - a of two captures: the weight matrices' diverging map, masked cells black
    ("Image", "Difference"): dict(cmap="RdBu_r", nan_color="black"),
    # a head's patching effect: restores (red) or deepens (blue) the difference, centred on 0
    ("Image", "Patching"): dict(cmap="RdBu_r", nan_color="white"),
    ("Rectangles", "Ranking"): dict(line_color=None),
    ("Labels", "Ranking"): dict(text_font_size="8pt", text_color="#333333"),
    ("Curve", "Prediction"): dict(line_width=1.2),
    # why this cell: the query side blue, the key side vermillion (attnpanel.render.why_views)
    ("Curve", "WhyQuery"): dict(line_color=QUERY_COLOR, line_width=1.4),
    ("Curve", "WhyKey"): dict(line_color=KEY_COLOR, line_width=1.4),
    ("VLine", "QueryMark"): dict(line_color=QUERY_COLOR, line_width=2, line_alpha=0.8),
    ("VLine", "KeyMark"): dict(line_color=KEY_COLOR, line_width=2, line_alpha=0.8),
    ("HeatMap", "Values"): dict(cmap="RdBu_r"),
}


def head_colors(heads: np.ndarray, enabled=None) -> list[str]:
    return [head_color(h) if enabled is None or h in enabled else "#c8c8c8" for h in heads]


def head_cmap(head: int, enabled: bool = True, n: int = 256) -> list[str]:
    """White to the head's colour (grey when off), ``n`` steps: a head's small-map palette."""
    end = head_color(head) if enabled else "#8a8a8a"
    rgb = np.array([int(end[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)
    steps = np.linspace(0.0, 1.0, n)[:, None]
    colors = np.round(255 + steps * (rgb - 255)).astype(int)
    return ["#{:02x}{:02x}{:02x}".format(*c) for c in colors]


def look(kind: str, group: str) -> dict:
    """The look of one (element kind, group) as HoloViews style options (from :data:`LOOK`)."""
    found = dict(LOOK.get((kind, group), {}))
    if "nan_color" in found:
        found["clipping_colors"] = {"NaN": found.pop("nan_color")}
    return found


def options(width: int = 400, height: int = 160) -> list:
    """The styling of every element the views make, to apply once with ``.opts(*options())``.

    The views return plain data elements (group and label name what they are); styling is
    applied once per plot rather than on every update, because ``.opts`` on each new element
    costs milliseconds and grows HoloViews' option tree. Colours and line widths come from
    :data:`LOOK` (as the served page draws them); what is added here is HoloViews' own:
    tools, titles, colour bars and axes.
    """
    # Charts leave the mouse wheel to the page (a wheel over a bar chart zoomed it instead
    # of scrolling); the maps keep it: a wheel zooms every linked map.
    common = dict(title="{label}", toolbar="above", show_grid=True, active_tools=["pan"])
    return [
        hv.opts.Rectangles(
            "Vector",
            color="color",
            tools=["hover"],
            yformatter=BasicTickFormatter(use_scientific=False),  # 0.007, not 7.000e-3
            width=width,
            height=height,
            show_legend=False,
            **common,
        ),
        hv.opts.Curve("Reference", interpolation="steps-mid"),
        hv.opts.Curve("Sequence", tools=["hover"], **common),
        hv.opts.Image(
            "Attention",
            colorbar=True,
            cformatter="%.3g",  # not 4.000e-3
            tools=["hover"],
            # cells are centred on whole positions: the one under the mouse, not 99.192
            hover_tooltips=[("key", "$x{0}"), ("query", "$y{0}"), ("value", "@image{0.0000}")],
            invert_yaxis=True,
            title="{label}",
            toolbar="above",
        ),
        hv.opts.Image(
            "HeadMap",
            invert_yaxis=True,
            xaxis=None,
            yaxis=None,
            toolbar=None,
            title="{label}",
        ),
        hv.opts.Image("Weight", invert_yaxis=True, tools=["hover"], title="{label}"),
        # b - a: centred on 0, as the served page draws it (image_limits(centred=True))
        hv.opts.Image(
            "Difference",
            symmetric=True,
            colorbar=True,
            cformatter="%.3g",
            tools=["hover"],
            invert_yaxis=True,
            title="{label}",
            toolbar="above",
        ),
        hv.opts.HeatMap(
            "Values",
            tools=["hover"],
            colorbar=True,
            invert_yaxis=True,
            title="{label}",
            toolbar="above",
        ),
        hv.opts.Rectangles(
            "Tokens",
            color="color",
            tools=["hover"],
            show_grid=False,
            yaxis=None,
            toolbar=None,
            title="{label}",
        ),
        hv.opts.Image(
            "ModelView",
            invert_yaxis=True,
            colorbar=True,
            tools=["hover", "tap"],
            title="{label}",
            toolbar="above",
        ),
        hv.opts.Image(
            "Positional",
            colorbar=True,
            invert_yaxis=True,
            tools=["hover"],
            title="{label}",
            toolbar="above",
            **look("Image", "Positional"),
        ),
        hv.opts.Table("TopAttended", title="{label}"),
        hv.opts.Overlay(title="{label}", show_legend=False),
        *(getattr(hv.opts, kind)(group, **look(kind, group)) for kind, group in LOOK),
    ]


# A row whose items wrap onto the next line when the page is narrow. ``min-width: 0``: else
# the row is as wide as its items side by side and widens the whole page instead.
WRAP = ":host { flex-wrap: wrap; min-width: 0 !important; }"

# A checkbox whose text toggles it, as a person expects. Bokeh draws the text as a div
# beside the input, not a <label> of it: a click on the text did nothing. Here the input
# (transparent) covers the whole widget and the box is drawn before the text, checked,
# focused and disabled as the input is; nothing is fetched (the tick is an inline SVG).
TICK = (
    "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 12 12'%3E"
    "%3Cpath d='M2.5 6.2 5 8.6 9.6 3.4' fill='none' stroke='white' stroke-width='1.8'/%3E"
    "%3C/svg%3E"
)
CHECKBOX_TEXT = f"""
:host {{ position: relative; cursor: pointer; }}
input[type="checkbox"] {{
  position: absolute; inset: 0; width: 100%; height: 100%; margin: 0;
  opacity: 0; cursor: pointer; z-index: 1;
}}
input[type="checkbox"] + .bk-label {{ top: 0; margin-left: 0; }}
.bk-label::before {{
  content: ""; display: inline-block; box-sizing: border-box; width: 13px; height: 13px;
  margin: 0 5px -2px 0; border: 1px solid #767676; border-radius: 2px; background: #fff;
}}
input:checked + .bk-label::before {{
  background: #0075ff url("{TICK}") center / 11px no-repeat; border-color: #0075ff;
}}
input:focus-visible + .bk-label::before {{ outline: 2px solid #0075ff; outline-offset: 1px; }}
input:disabled {{ cursor: default; }}
input:disabled + .bk-label {{ opacity: 0.5; }}
"""

# Q, K and V each in a hue family of their own: a dark and a light shade, alternating by
# head (the shaded lanes mark the heads too), so the three vectors never read alike.
PROJECTION_FAMILIES = {
    "q": ("#08519c", "#6baed6"),  # blues
    "k": ("#a63603", "#fd8d3c"),  # oranges
    "v": ("#006d2c", "#74c476"),  # greens
}


def family_colors(name: str, heads: np.ndarray) -> list[str]:
    """Colours of the features of ``q``, ``k`` or ``v``: its family, shade by head parity."""
    dark, light = PROJECTION_FAMILIES[name]
    return [dark if int(h) % 2 == 0 else light for h in heads]


WEIGHT_LOW = np.array([255, 255, 255], dtype=float)  # no weight: white
WEIGHT_HIGH = np.array([178, 24, 43], dtype=float)  # the most-attended position: dark red


# A legend entry's swatch for a layer coloured row by row (its first row may be white).
LEGEND_SWATCH = {
    ("Rectangles", "QueryWeights"): "#{:02x}{:02x}{:02x}".format(*WEIGHT_HIGH.astype(int))
}


def shade(weights: np.ndarray) -> list[str]:
    """White to dark red, by each weight relative to the largest (token boxes, curve bands)."""
    weights = np.asarray(weights, dtype=np.float64)
    top = float(np.nanmax(weights)) if weights.size and np.isfinite(weights).any() else 0.0
    level = np.nan_to_num(weights / top) if top > 0 else np.zeros_like(weights)
    rgb = np.round(WEIGHT_LOW + level[:, None] * (WEIGHT_HIGH - WEIGHT_LOW)).astype(int)
    return ["#{:02x}{:02x}{:02x}".format(*c) for c in rgb]

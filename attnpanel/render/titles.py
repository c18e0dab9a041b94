"""A plot's title in lines that fit the plot it titles, at its own font.

The words of a title are chosen by what the plot shows; whether they fit depends on the
plot's width and its title's font. :func:`fit_title` breaks a title between words where
the plot is too narrow for it, for every plot the server titles (its first draw, every
later state, the maps the browser draws from its cache), so that no title is cut at its
canvas's edge (``tests/test_browser_kinds.py`` measures them in Chromium).
"""

from __future__ import annotations

import functools
from pathlib import Path

import matplotlib
from bokeh.models import ColorBar
from PIL import ImageFont

COLORBAR_ROOM = 84  # px right of a map's frame: its colour bar, labels and title
Y_AXIS_ROOM = 50  # px left of a plot's frame sized by its width: its y axis and labels
# The font a title is measured in: DejaVu Sans Bold (matplotlib's own), as wide as or wider
# than what browsers draw Bokeh's bold Helvetica titles in (Chromium here: Liberation Sans,
# "context of query 1: Σ mean-weight · v (all heads)" 304 px at 10 pt, 368 px in DejaVu)
TITLE_FONT = "DejaVuSans-Bold.ttf"
LABEL_FONT = "DejaVuSans.ttf"  # tick labels, measured as the titles are (a little wider)
SHORT_LINE = 6  # characters a title's last line has at least, where words can move to it
CATEGORY_AXIS_ROOM = 30  # px of a categorical y axis beside its widest label: ticks, label


def fit_title(fig, text: str) -> str:
    """``text`` broken between words into lines that fit ``fig``'s title row: its frame's
    width (and its colour bar's room), else its width less its y axis, measured at its
    title's font (a title Bokeh draws past its canvas is cut: "context of query 0: Σ
    mean-weight · v (all heads)" lost its end in 226 px). A line already broken stays
    broken; a plot whose width the server does not know (stretched) keeps ``text``."""
    room = room_of(fig)
    if not text or room is None:
        return text
    width = _title_measure(fig)
    return "\n".join(_wrapped(line, room, width) for line in text.split("\n"))


def room_of(fig) -> float | None:
    """The px a title line of ``fig`` has: its frame's width (and its colour bar's room),
    else its width less its y axis; None for a plot whose width the server does not know
    (stretched)."""
    if fig.frame_width is not None:
        bar = any(isinstance(m, ColorBar) for m in fig.right)
        return fig.frame_width + (COLORBAR_ROOM if bar else 0)
    if fig.width is not None and fig.sizing_mode in (None, "fixed"):
        return fig.width - _y_axis_room(fig)
    return None


def text_width(fig, line: str) -> float:
    """The px ``line`` takes in ``fig``'s title font, as :func:`fit_title` measures it."""
    return _title_measure(fig)(line)


def _title_measure(fig):
    """A function of a text: its width in px in ``fig``'s title font."""
    return _measure(_font_px(fig.title.text_font_size))


def _y_axis_room(fig) -> float:
    """The px a plot's y axis takes left of its frame: a categorical axis as wide as its
    widest factor (the top keys' "attention (12): w 0.331") and its label, else
    :data:`Y_AXIS_ROOM`."""
    factors = getattr(fig.y_range, "factors", None)
    if not factors or not fig.yaxis:
        return Y_AXIS_ROOM
    width = _measure(_font_px(fig.yaxis[0].major_label_text_font_size), LABEL_FONT)
    return max(map(width, map(str, factors))) + CATEGORY_AXIS_ROOM


def _wrapped(line: str, room: float, width) -> str:
    """``line`` broken between words where it would pass ``room`` px (a word longer than
    the room keeps a line of its own)."""
    lines: list[str] = []
    for word in line.split(" "):
        if lines and width(f"{lines[-1]} {word}") <= room:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    while len(lines) > 1 and len(lines[-1]) < SHORT_LINE:
        # a short last line ("Σ w ·" over "v" read as a cut title): a word goes down to it
        head, _, last = lines[-2].rpartition(" ")
        if not head or width(f"{last} {lines[-1]}") > room:
            break
        lines[-2:] = [head, f"{last} {lines[-1]}"]
    return "\n".join(lines)


@functools.lru_cache(maxsize=8)
def _measure(px: float, font: str = TITLE_FONT):
    """A function of a text: its width in px at ``px`` in ``font`` (a matplotlib font)."""
    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / font
    font = ImageFont.truetype(str(path), size=px)
    return font.getlength


def _font_px(size) -> float:
    """A Bokeh font size (``"10pt"``, ``"13px"``, a value spec) in px."""
    size = getattr(size, "value", size)
    if isinstance(size, dict):
        size = size.get("value", "13px")
    text = str(size)
    number = float("".join(c for c in text if c.isdigit() or c == ".") or 13)
    return number * 4 / 3 if text.endswith("pt") else number

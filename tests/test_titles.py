"""Titles broken to fit their plot (attnpanel.render.titles), measured in their font."""

from __future__ import annotations

from bokeh.models import FactorRange
from bokeh.plotting import figure

from attnpanel.render.titles import fit_title, room_of, text_width


def chart(width=300, factors=None):
    fig = figure(width=width, height=200)
    fig.title.text_font_size = "10pt"
    if factors is not None:
        fig.y_range = FactorRange(factors=factors)
    return fig


def test_a_long_title_is_broken_between_words_into_lines_that_fit():
    fig = chart()
    title = "context of query 300, head 4: Σ mean-weight · v (all heads) of sample 12"
    lines = fit_title(fig, title).split("\n")
    assert len(lines) > 1 and " ".join(lines) == title
    assert all(text_width(fig, line) <= room_of(fig) for line in lines)
    assert fit_title(fig, "short") == "short"
    assert fit_title(fig, "kept\nbroken") == "kept\nbroken"


def test_a_short_last_line_takes_words_from_the_line_above():
    """ "context of query 0, head 0: Σ w ·" over a lone "v" read as a cut title."""
    fig = chart(width=300)  # the value aggregation's
    title = "context of query 0, head 0: Σ w · v"
    lines = fit_title(fig, title).split("\n")
    assert " ".join(lines) == title and len(lines) == 2
    assert lines == ["context of query 0, head 0:", "Σ w · v"], lines


def test_a_categorical_axis_leaves_the_title_the_room_its_labels_do_not_take():
    """The top keys' labels ("attention (12): w 0.331") take the room left of the frame:
    the title wraps where, beside short labels, it fits."""
    title = "value vectors, top 5 keys"
    narrow = chart(factors=["a: w 0.1", "b: w 0.2"])
    wide = chart(factors=["attention (12): w 0.331", "because (7): w 0.068"])
    assert room_of(wide) < room_of(narrow)
    assert fit_title(narrow, title) == title
    assert fit_title(wide, title) != title

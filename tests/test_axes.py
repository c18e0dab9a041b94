"""A chart's axes follow what it draws: on its first draw and on every later state, by one
rule (attnpanel.render.axes), as ranges the browser cannot keep from a state before."""

from __future__ import annotations

import holoviews as hv
import numpy as np
import pytest
import xarray as xr
from bokeh.models import DataRange1d, Range1d

from attnpanel.render.axes import STEADY_CHARS, axis_number, chart_extent, fit_axis
from attnpanel.render.elements import PlotKey
from attnpanel.render.figures import draw
from attnpanel.render.push import write
from attnpanel.render.tables import shown_html, table_html, table_model, write_table
from attnpanel.render.views import lanes, vector_bars


def bars(values) -> hv.Overlay:
    values = np.asarray(values, dtype=np.float32)
    return hv.Overlay([vector_bars(values, ["#b2182b"] * len(values), "key", "weight")])


def drawn_of(element):
    return drawn_of_with(element)


def drawn_of_with(element, **options):
    figure, layers = draw(element, **options)
    found: dict = {}
    for key, handles in layers:
        found.setdefault(key, []).append(handles)
    return figure, found


def test_the_value_axis_follows_each_new_state_with_its_reset():
    """Query 0 under a causal mask has one weight of 1: after weights of 0.004 the axis
    must reach 1 (BokehJS kept a DataRange1d's first start and end for ever: the bar of 1
    was drawn far above a frame that ended at 0.006)."""
    figure, found = drawn_of(bars(np.full(480, 1 / 480)))
    assert isinstance(figure.y_range, Range1d)  # not a DataRange1d the browser would freeze
    assert figure.y_range.end == pytest.approx(1 / 480 * 1.06)
    write(found, bars(np.r_[1.0, np.zeros(479)]))
    rng = figure.y_range
    assert (rng.start, rng.end) == pytest.approx((0.0, 1.06))  # weights: never below 0
    assert (rng.reset_start, rng.reset_end) == (rng.start, rng.end)  # reset: this state's
    write(found, bars([-2.0, 1.0, 0.5]))  # negative bars: their bottoms count
    assert (figure.y_range.start, figure.y_range.end) == pytest.approx((-2.18, 1.18))


def test_a_curves_clock_axis_is_its_own_hours():
    def curve(hour):
        times = np.datetime64("2025-06-03T00:00") + np.arange(5) * np.timedelta64(1, "h")
        times = times + np.timedelta64(hour, "h")
        marker = hv.VLine(times[0], group="Marker")  # at one time: never the axis
        return hv.Overlay([hv.Curve((times, np.arange(5.0)), "time", "signal"), marker])

    figure, found = drawn_of(curve(0))
    assert figure.x_range.start == axis_number(np.datetime64("2025-06-03T00:00"))
    write(found, curve(14))
    assert figure.x_range.start == axis_number(np.datetime64("2025-06-03T14:00"))
    assert figure.x_range.end == axis_number(np.datetime64("2025-06-03T18:00"))
    assert figure.x_range.reset_end == figure.x_range.end


def test_views_sharing_a_figure_fit_it_together():
    """The weights' band and the curves are two views of one figure, written one after the
    other: the clock axis holds both (the band's cells reach half a step beyond the curve),
    whichever was written last; a hidden curve no longer counts."""
    start = np.datetime64("2025-06-03T14:00")
    times = start + np.arange(4) * np.timedelta64(1, "m")
    half = np.timedelta64(30, "s")
    band = hv.Rectangles(
        (times - half, np.zeros(4), times + half, np.ones(4)), group="QueryWeights"
    )
    curve = hv.Curve((times, [0.0, 5.0, 1.0, 2.0]), "time", "signal", group="Sequence")
    high = hv.Curve((times, [0.0, 50.0, 1.0, 2.0]), "time", "signal", group="Extra")
    figure, found = drawn_of(hv.Overlay([band, curve, high]))
    assert figure.x_range.start == axis_number(times[0] - half)
    later = np.timedelta64(2, "h")
    write(
        found,
        band.clone(data=(times - half + later, np.zeros(4), times + half + later, np.ones(4))),
    )
    write(found, curve.clone(data=(times + later, [0.0, 5.0, 1.0, 2.0])))
    write(found, high.clone(data=(times + later, [0.0, 50.0, 1.0, 2.0])))
    assert figure.x_range.start == axis_number(times[0] - half + later)
    assert figure.x_range.end == axis_number(times[-1] + half + later)
    assert figure.y_range.end == pytest.approx(53.0)
    found[PlotKey.of(high)][0]["glyph_renderer"].visible = False
    write(found, curve.clone(data=(times + later, [0.0, 5.0, 1.0, 2.0])))
    assert figure.y_range.end == pytest.approx(5.3)


def test_given_limits_shared_ranges_and_maps_stay_as_drawn():
    """``ylim`` (the token strip's), a range shared with other plots and a map's axes (a
    dense survey: the density image under its points) are fixed on the first draw and on
    every later state alike."""

    def curve(top):
        return hv.Curve(([0.0, 1.0, 2.0], [0.0, top, 1.0]), "x", "y", group="Extra")

    figure, found = drawn_of_with(curve(1.0), ylim=(0.0, 1.0))
    write(found, curve(10.0))
    assert (figure.y_range.start, figure.y_range.end) == (0.0, 1.0)
    shared = Range1d(-5, 5)
    figure, found = drawn_of_with(curve(1.0), y_range=shared)
    write(found, curve(10.0))
    assert figure.y_range is shared and (shared.start, shared.end) == (-5, 5)
    density = hv.Image(np.ones((4, 4)), bounds=(0, 0, 8, 4), group="Density")
    points = hv.Scatter(([1.0, 7.0], [0.5, 3.5]), "head", "value", group="Survey")
    figure, found = drawn_of_with(hv.Overlay([density, points]))
    before = (figure.y_range.start, figure.y_range.end)
    write(found, hv.Overlay([points.clone(data=([1.0, 7.0], [0.5, 30.0]))]))
    assert (figure.y_range.start, figure.y_range.end) == before


def test_a_density_under_a_charts_points_is_no_map():
    """A survey past 4,000 points draws their density under its boxes and points (the
    image not first): its value axis runs upwards and follows the points, and a new
    sample's density is written in place (a push raised KeyError: no 'image' dimension)."""
    from attnpanel.render.survey_views import distribution

    rng = np.random.default_rng(0)
    values = xr.DataArray(rng.random((600, 8)), dims=("sample", "head"), name="entropy")
    figure, found = drawn_of(distribution(values, sample=3))
    y = figure.y_range
    assert y.start < y.end  # upwards, not a map's query-0-on-top
    assert y.start == 0.0 and y.end > 1.0  # from 0 (none is negative), the top padded
    write(found, distribution(values * 5, sample=4))
    assert figure.y_range.end > 5.0
    (density,) = [h for key, hs in found.items() if key.group == "Density" for h in hs]
    assert np.nanmax(density["source"].data["image"][0]) > 0


def test_a_flat_positive_curve_gets_an_axis_from_zero_and_no_quantity_a_negative_one():
    """A LayerNorm's output norm is one value up to float noise: its axis was 1e-6 high
    (the query's weights band, from 0, off the chart); a non-negative quantity's axis
    never runs below 0."""
    figure = figure_with_range()
    fit_axis(figure, "y", (5.656850, 5.656856))
    assert (figure.y_range.start, figure.y_range.end) == pytest.approx((0.0, 5.656856 * 1.06))
    fit_axis(figure, "y", (0.01, 0.51))  # the padding would run below 0: it stops there
    assert figure.y_range.start == 0.0 and figure.y_range.end == pytest.approx(0.54)
    fit_axis(figure, "y", (0.2, 0.7))  # the padding stays above 0: kept
    assert (figure.y_range.start, figure.y_range.end) == pytest.approx((0.17, 0.73))
    fit_axis(figure, "y", (-0.5, 0.5))
    assert (figure.y_range.start, figure.y_range.end) == pytest.approx((-0.56, 0.56))
    fit_axis(figure, "y", (-2.0, -2.0))  # one negative value: 1 either side
    assert (figure.y_range.start, figure.y_range.end) == pytest.approx((-3.0, -1.0))


def figure_with_range():
    from bokeh.plotting import figure

    return figure(y_range=Range1d(0, 1))


def test_lanes_markers_and_maps_never_rescale_an_axis():
    assert chart_extent(lanes(8, 12)) is None
    assert chart_extent(hv.VLine(3.0)) is None
    assert chart_extent(hv.Labels(([0.5, 1.5], [0.5, 0.5], ["prev", "sink"]))) is None
    assert chart_extent(hv.Image(np.ones((3, 3)))) is None
    figure, found = drawn_of(
        hv.Overlay([vector_bars(np.ones(96), ["k"] * 96, "f", "q"), lanes(8, 12)])
    )
    assert (figure.y_range.start, figure.y_range.end) == pytest.approx((0.0, 1.06))
    # a chart whose layers never rescale it keeps Bokeh's own range of data that stay put
    outline, _ = draw(hv.Rectangles([(0, 0, 1, 1)], group="Outline"))
    assert isinstance(outline.y_range, DataRange1d)
    assert PlotKey.of(lanes(8, 12)).group == "Lanes"


def test_the_widest_column_of_a_table_wraps_its_long_cells_only():
    """The shape table's "masked" row (a sentence) cut the table at the frame's edge."""
    sentence = "blocked cells filled with -10000 by the model (its own mask: diagonal)"
    shape = "(batch=32, head=8, query=480, key=480) (from q, k)"
    html = table_html(
        hv.Table(
            {"step": ["masked"], "operation": [sentence], "shape": [shape]},
            kdims=["step"],
            vdims=["operation", "shape"],
        )
    )
    assert f'<td class="prose">{sentence}</td>' in html
    assert f"<td>{shape}</td>" in html  # a shape stays on one line


def test_a_bar_charts_value_axis_keeps_one_width_whatever_its_scale():
    """Its labels are Bokeh's plain decimals, right-aligned in a fixed-width font to one
    number of characters: a new scale never changes the axis's width (BokehJS would lay
    the whole page out again, in the frame that repaints the map; the browser test counts
    those layouts)."""
    figure, _ = drawn_of(vector_bars(np.linspace(0, 0.3, 12), ["k"] * 12, "key", "weight"))
    formatter = figure.yaxis[0].formatter
    assert formatter.args["chars"] == STEADY_CHARS >= len("0.0005")
    assert formatter.args["plain"].use_scientific is False  # 0.007, not 7.000e-3
    assert "padStart(chars)" in formatter.code
    assert figure.yaxis[0].major_label_text_font == "monospace"
    assert figure.xaxis[0].major_label_text_font != "monospace"  # the keys keep the page's


def test_a_tables_model_holds_its_html_escaped_once_more_and_runs_nothing():
    """Panel's HTML model decodes its text once: the table's own escaping must survive it
    (a cell's markup stays text), and neither scripts nor maths run."""
    hostile = '<img src=x onerror="alert(1)"> $x$'
    element = hv.Table({"name": [hostile], "value": [0.5]}, kdims=["name"], vdims=["value"])
    model = table_model(element, 300, 100)
    assert shown_html(model) == table_html(element)
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt; $x$" in shown_html(model)
    assert "<img" not in shown_html(model)
    assert model.run_scripts is False and model.disable_math is True
    write_table(model, hv.Table({"name": ["b"], "value": [1.0]}, kdims=["name"], vdims=["value"]))
    assert "<td>b</td><td>1.0</td>" in shown_html(model)

"""The page's survey section against the demo model itself: what it draws is each
sample's statistic of the model's own weights (SDPA written out), computed the long way."""

from __future__ import annotations

import numpy as np
import panel as pn
import pytest
import torch
from bokeh.document import Document
from bokeh.models import HoverTool
from test_gradients import ExplicitSDPA

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.sections.survey import NEEDS_SURVEY
from attnpanel.nilm.demo import demo_model_run
from attnpanel.render import survey_views
from attnpanel.render.figures import draw

WINDOWS = 4


@pytest.fixture(scope="module")
def run():
    return demo_model_run(n_windows=WINDOWS)


@pytest.fixture(scope="module")
def page(run):
    explorer = AttentionExplorer(attnpanel.demo(n_windows=WINDOWS), model=run)
    explorer.__panel__().get_root(Document())
    explorer.param.update(show_survey=True)
    return explorer


@pytest.fixture(scope="module")
def own(run):
    """The demo model's own weights of its three layers, ``(B, H, L, L)`` float64."""
    explicit = ExplicitSDPA()
    with torch.no_grad(), explicit:
        run.model(*run.inputs)
    return [w.double().numpy() for w in explicit.weights]


def drawn_points(explorer, group: str = "Samples") -> tuple[np.ndarray, np.ndarray]:
    found = explorer.engine.plots("survey")
    key = next(k for k in found if k.group == group)
    data = found[key][0]["source"].data
    return np.asarray(data["head"]), np.asarray(data["value"])


def by_head(xs, ys, heads: int) -> np.ndarray:
    """The drawn points back as ``(sample, head)`` (each head's column, samples in order)."""
    columns = [ys[np.round(xs).astype(int) == h] for h in range(heads)]
    return np.stack(columns, axis=1)


def test_the_survey_draws_each_samples_statistic_of_the_models_own_weights(page, own):
    section = page.sections["survey"]
    assert section.layer == "encoder.2.attention"  # the trace's own layer
    weights = own[2]
    entropy = -(weights * np.log(np.where(weights > 0, weights, 1.0))).sum(-1).mean(-1)
    xs, ys = drawn_points(page)
    np.testing.assert_allclose(by_head(xs, ys, 8), entropy, rtol=1e-5)
    length = weights.shape[-1]
    steps = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
    section.statistic = "distance"
    xs, ys = drawn_points(page)
    np.testing.assert_allclose(by_head(xs, ys, 8), (weights * steps).sum(-1).mean(-1), rtol=1e-5)
    assert page.engine.title("survey") == "encoder.2.attention: distance (steps)"
    axes = {h["yaxis"].axis_label for f in page.engine.plots("survey").values() for h in f}
    assert axes == {"distance (steps)"}  # the value axis follows the statistic
    figure = next(iter(page.engine.plots("survey").values()))[0]["plot"]
    (hover,) = [t for t in figure.tools if isinstance(t, HoverTool)]
    assert hover.tooltips[-1][0] == "distance (steps)"  # and so does the hover
    section.layer = "encoder.0.attention"
    section.statistic = "sink"
    xs, ys = drawn_points(page)
    np.testing.assert_allclose(by_head(xs, ys, 8), own[0][..., 0].mean(-1), rtol=1e-5, atol=1e-9)
    section.param.update(layer="encoder.2.attention", statistic="entropy")


def test_the_shown_sample_is_marked_and_a_click_on_a_point_opens_its_sample(page):
    section = page.sections["survey"]
    page.param.update(sample=1)
    xs, ys = drawn_points(page, "Shown")
    values = section.values().values
    np.testing.assert_allclose(ys, values[1])
    found = page.engine.plots("survey")
    data = {k.group: found[k][0]["source"].data for k in found}
    assert list(data["Shown"]["sample"]) == [1] * 8  # the hover names each point's sample
    samples, heads = np.asarray(data["Samples"]["sample"]), np.asarray(data["Samples"]["head"])
    np.testing.assert_allclose(
        np.asarray(data["Samples"]["value"]), values[samples, np.round(heads).astype(int)]
    )
    figure = found[next(iter(found))][0]["plot"]
    (hover,) = [t for t in figure.tools if isinstance(t, HoverTool)]
    assert [name for name, _ in hover.tooltips] == ["sample", "head", "entropy (nats)"]
    assert np.allclose(xs, np.arange(8) + survey_views.jitter(WINDOWS)[1])
    head = 5
    x = head + survey_views.jitter(WINDOWS)[3]
    with page.engine.drawing_now():
        section.click(x=x + 0.01, y=float(values[3, head]))
    assert page.sample == 3
    xs, ys = drawn_points(page, "Shown")
    np.testing.assert_allclose(ys, values[3])
    section.click(x=9.4, y=0.0)  # beside every head's column: nothing
    assert page.sample == 3


def test_a_survey_from_a_store_and_a_sample_the_trace_does_not_hold(tmp_path, run):
    store = tmp_path / "survey.zarr"
    inputs = run.inputs
    attnpanel.survey(run.model, [inputs, inputs], store=store, progress=False)  # 8 samples
    explorer = attnpanel.explore(attnpanel.demo(n_windows=WINDOWS), survey=str(store))
    explorer.__panel__().get_root(Document())
    explorer.param.update(show_survey=True)
    section = explorer.sections["survey"]
    assert explorer.survey.sizes["sample"] == 2 * WINDOWS
    values = section.values().values
    head = 2
    with explorer.engine.drawing_now():
        section.click(x=head + survey_views.jitter(8)[6], y=float(values[6, head]))
    assert explorer.sample == 0
    assert "sample 6 of the survey is not in this trace (4 samples)" in section.status.object


def test_a_stored_survey_opens_on_entropy_whatever_order_its_files_are_listed_in(
    tmp_path, run, monkeypatch
):
    """The store's arrays come in its own order, not the file system's; the token scores a
    power trace cannot have (NaN by construction) are not offered, and the page says so."""
    import zarr

    store = tmp_path / "survey.zarr"
    attnpanel.survey(run.model, [run.inputs], store=store, progress=False)
    listed = zarr.Group.arrays

    def backwards(group):
        return reversed(list(listed(group)))

    monkeypatch.setattr(zarr.Group, "arrays", backwards)
    explorer = attnpanel.explore(attnpanel.demo(n_windows=WINDOWS), survey=str(store))
    explorer.__panel__().get_root(Document())
    explorer.param.update(show_survey=True)
    section = explorer.sections["survey"]
    names = list(explorer.survey.data_vars)
    assert names[:3] == ["entropy", "distance", "sink"]
    assert section.statistic == "entropy"
    offered = section.param.statistic.objects
    assert "induction" not in offered and "duplicate_token" not in offered
    assert {"previous_token", "offset", "offset_weight"} <= set(offered)
    for name in offered:  # every statistic offered has a number for every head
        assert np.isfinite(explorer.survey[name].values).all(), name
    shown = " ".join(str(p.object) for p in section.__panel__().select(pn.pane.Markdown))
    assert "inputs carried no token ids" in shown
    assert survey_views.label("induction") == "induction score"


def test_many_samples_are_drawn_as_their_density():
    import xarray as xr

    values = xr.DataArray(
        np.random.default_rng(0).normal(size=(800, 8)), dims=("sample", "head"), name="entropy"
    )
    element = survey_views.distribution(values, sample=3)
    groups = [layer.group for layer in element]
    assert groups == ["Whiskers", "Boxes", "Medians", "Density", "Samples", "Shown"]
    density = element.get(3)
    assert np.nansum(density.dimension_values(2)) == pytest.approx(800 * 8)
    q25, q75 = np.percentile(values.values, [25, 75], axis=0)
    boxes = element.get(1)
    np.testing.assert_allclose(boxes.dimension_values(1), q25)
    np.testing.assert_allclose(boxes.dimension_values(3), q75)
    ends = element.get(4).dimension_values(1)  # each head's extremes
    np.testing.assert_allclose(ends, np.concatenate([values.min("sample"), values.max("sample")]))
    picked = element.get(4).dimension_values("sample")  # and their samples
    expected = np.concatenate([values.argmin("sample").values, values.argmax("sample").values])
    np.testing.assert_array_equal(picked, expected)
    figure, _ = draw(element, tools=("hover",))  # the hover is the points', not the density's
    (hover,) = [t for t in figure.tools if isinstance(t, HoverTool)]
    assert [name for name, _ in hover.tooltips] == ["sample", "head", "entropy (nats)"]
    assert type(hover.renderers[0].glyph).__name__ == "Scatter"


def test_without_a_model_or_a_survey_the_section_says_what_it_needs():
    explorer = AttentionExplorer(attnpanel.demo(n_windows=2))
    explorer.__panel__().get_root(Document())
    explorer.param.update(show_survey=True)
    section = explorer.sections["survey"].__panel__()
    text = " ".join(getattr(o, "object", "") or "" for o in section.objects[0].objects)
    assert NEEDS_SURVEY in text
    assert "survey" not in explorer.engine.panes()

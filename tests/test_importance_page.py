"""The page's "which heads the prediction needs" section, against the demo model itself:
what it draws is the model's prediction re-run with the lane of a head zeroed the long way
(a forward pre-hook on the layer's output projection)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from bokeh.document import Document
from bokeh.models import HoverTool

from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.scroll import MATRIX
from attnpanel.app.sections.importance import NEEDS_MODEL
from attnpanel.app.sections.rollout import ROLLOUT_SIZE as SIZE
from attnpanel.nilm.demo import DEMO_LAYER, demo_model_run, demo_windows
from attnpanel.nilm.nilmformer import time_features
from attnpanel.readouts.core import stages_cached
from attnpanel.render.elements import PlotKey
from attnpanel.render.tables import shown_html

LAYER = f"encoder.{DEMO_LAYER}.attention"


@pytest.fixture(scope="module")
def run():
    return demo_model_run(n_windows=4)


@pytest.fixture(scope="module")
def page(run):
    import attnpanel

    explorer = AttentionExplorer(attnpanel.demo(n_windows=4), model=run)
    explorer.__panel__().get_root(Document())
    return explorer


@contextlib.contextmanager
def lanes_zeroed(model, heads: list[int], n_heads: int = 8):
    """The long way: the out projection's input with the lanes of ``heads`` zeroed."""

    def hook(_module, args):
        merged = args[0].clone()
        width = merged.shape[-1] // n_heads
        for head in heads:
            merged[..., head * width : (head + 1) * width] = 0.0
        return (merged,)

    handle = model.get_submodule(f"{LAYER}.wo").register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def model_prediction(run, sample: int, heads: list[int], windows: int = 4) -> np.ndarray:
    """The demo model's own prediction in W of one held-out window, ``(appliance, position)``."""
    held = demo_windows(windows)
    aggregate = torch.from_numpy(held["aggregate"].values[sample : sample + 1])
    features = time_features(held["time"].values[sample : sample + 1])
    with lanes_zeroed(run.model, heads):
        return run.model.predict(aggregate, features)[0].numpy()


def drawn_curves(page) -> dict[str, np.ndarray]:
    return {
        key.label: np.asarray(found[0]["source"].data["value"])
        for key, found in page.engine.plots("prediction").items()
        if key.group == "Prediction"
    }


def test_the_page_draws_the_models_prediction_with_heads_switched_off(page, run):
    names = list(run.series)
    drawn = drawn_curves(page)
    every = model_prediction(run, 0, [])
    for i, name in enumerate(names):
        np.testing.assert_allclose(drawn[f"{name} (predicted)"], every[i], rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(drawn[f"{name} (heads off)"], every[i], rtol=1e-6, atol=1e-4)
    page.param.update(enabled_heads=[0, 1, 2, 4, 5, 6, 7])  # head 3 off
    without = model_prediction(run, 0, [3])
    drawn = drawn_curves(page)
    assert not np.allclose(without, every)
    for i, name in enumerate(names):
        np.testing.assert_allclose(drawn[f"{name} (heads off)"], without[i], rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(drawn[f"{name} (predicted)"], every[i], rtol=1e-6, atol=1e-4)
    assert "head 3 switched off in this layer" in page.engine.title("prediction")
    page.param.update(enabled_heads=[0, 1, 2, 4, 6, 7])
    assert "heads 3, 5 switched off in this layer" in page.engine.title("prediction")
    page.param.update(enabled_heads=[0, 1, 2, 4, 5, 6, 7])
    table = shown_html(page.engine.plots("metrics")[PlotKey("Table", "Metrics")][0]["table"])
    truth = page.trace["truth"].isel(batch=0).values
    mae = np.abs(without[0] - truth[0]).mean()
    assert f"{mae:.4g}" in table  # the fridge's MAE with head 3 off
    assert page.last_error == ""  # no view failed to update
    page.param.update(sample=2, enabled_heads=list(range(8)))
    np.testing.assert_allclose(
        drawn_curves(page)[f"{names[1]} (predicted)"], model_prediction(run, 2, [])[1], atol=1e-4
    )


def test_the_importance_map_is_each_head_switched_off_alone(page, run):
    page.param.update(sample=1)
    drawn = page.drawn("importance", "Importance")  # rows by layer: the traced one, 2, last
    every = model_prediction(run, 1, [])
    for head in (0, 5):
        without = model_prediction(run, 1, [head])
        change = np.linalg.norm(without - every) / np.linalg.norm(every)
        assert drawn[2, head] == pytest.approx(change, rel=1e-4)
    assert drawn.shape == (3, 8)
    (handles,) = page.engine.handles("importance", PlotKey("Image", "Importance"))
    (hover,) = [t for t in handles["plot"].tools if isinstance(t, HoverTool)]
    named = [name for name, _ in hover.tooltips]
    assert named[:2] == ["head", "layer"] and named[2].startswith("‖Δ output‖")
    # no "click opens a head" over a map of three layers whose first two are not in the
    # trace (a click there says so); the section's words say what a click opens
    title = page.engine.title("importance")
    assert title.startswith("head importance, sample 1") and "click" not in title
    ticker = handles["xaxis"].ticker  # one tick per whole head, none at 0.5, 1.5 ...
    assert list(ticker.ticks) == list(range(8))
    assert [t for _, t in sorted(handles["yaxis"].major_label_overrides.items())] == [
        f"encoder.{i}.attention" for i in range(3)
    ]


def test_a_click_on_the_map_opens_the_head(page):
    page.param.update(head=0)
    section = page.sections["importance"]
    scroller = page.engine.scroller
    asked = scroller.request
    section.click(x=4.2, y=2.1)  # row 2 (drawn at the bottom): the traced layer
    assert page.head == 4
    # and the matrix, 1,800 px above, is brought into view
    assert (scroller.request, scroller.target) == (asked + 1, MATRIX)
    section.click(x=2.0, y=0.0)  # layer 0: not in this trace
    assert page.head == 4
    assert "encoder.0.attention" in section.status.object
    assert scroller.request == asked + 1  # nothing opened: the page stays where it is


def test_without_the_model_the_section_says_what_it_needs():
    import attnpanel

    explorer = AttentionExplorer(attnpanel.demo(n_windows=2))
    explorer.__panel__().get_root(Document())
    section = explorer.sections["importance"].__panel__()
    assert NEEDS_MODEL in section.objects[1].object
    assert "prediction" not in explorer.engine.panes()


def test_the_rollout_map_composes_every_layer_of_the_model(page, run):
    """Beside the ranking: the rollout of the shown sample through the model's three
    layers, from the model's own attention (captured on that sample)."""
    from test_flow import long_rollout

    import attnpanel
    from attnpanel.readouts.raster import window_raster

    page.param.update(sample=3)
    inputs, _ = run.one(3)
    captured = attnpanel.capture(run.model, *inputs)
    own = [torch.from_numpy(captured["weights"].values[i]) for i in range(3)]
    expected = long_rollout(own, 0.5)[0].numpy().astype(np.float32)
    regridded, _ = window_raster(expected, SIZE, SIZE, None)
    np.testing.assert_allclose(page.drawn("rollout", "Rollout"), regridded, atol=1e-5)
    assert page.engine.title("rollout").startswith("rollout through 3 layers")


def test_the_rollout_reads_clock_times_marks_the_query_and_a_click_picks_one(page):
    """Beside the matrix it reads as the matrix does: clock times on its axes and hover,
    the shown query's row marked, a click on a row picking that query."""
    from bokeh.models import CustomJSTickFormatter

    from attnpanel.readouts import core

    page.param.update(sample=2, query=40)
    (image,) = page.engine.handles("rollout", PlotKey("Image", "Rollout"))
    formatter = image["xaxis"].formatter
    assert isinstance(formatter, CustomJSTickFormatter)
    assert formatter.args["labels"] == core.clock_labels(page.trace, 2)
    (hover,) = [t for t in image["plot"].tools if isinstance(t, HoverTool)]
    names = [name for name, _ in hover.tooltips]  # clock times, under the map's own names
    assert names[:2] == ["key", "query"] and names[2].startswith("flow")
    assert hover.tooltips[0][1] == "$x{custom}"
    (marker,) = page.engine.handles("rollout", PlotKey("HSpan", "Marker"))
    assert (marker["glyph"].bottom, marker["glyph"].top) == (39.5, 40.5)
    with page.engine.drawing_now():
        page.sections["rollout"].click(x=10.0, y=120.2)
    assert page.query == 120
    assert (marker["glyph"].bottom, marker["glyph"].top) == (119.5, 120.5)
    assert core.clock_labels(page.trace, 3) != core.clock_labels(page.trace, 2)
    page.param.update(sample=3)
    assert image["xaxis"].formatter.args["labels"] == core.clock_labels(page.trace, 3)


def test_the_gradient_weighted_rollout_weighs_the_models_own_weights(page, run):
    """The buttons beside the rollout: each weight times the gradient of the model's
    output norm, taken by autograd at the weights of SDPA written out, composed by
    Chefer et al.'s rule."""
    from test_gradients import ExplicitSDPA, long_gradient_rollout

    from attnpanel.interventions.importance import output_tensor
    from attnpanel.readouts.raster import window_raster

    page.param.update(sample=2)
    section = page.sections["rollout"]
    section.weighing = "gradient × weights"
    try:
        inputs, kwargs = run.one(2)
        explicit = ExplicitSDPA()
        with torch.enable_grad(), explicit:
            y = output_tensor(run.model(*inputs, **kwargs))
        torch.linalg.vector_norm(y.double()).backward()
        weights = [w.detach().double().numpy() for w in explicit.weights]
        grads = [w.grad.double().numpy() for w in explicit.weights]
        expected = long_gradient_rollout(weights, grads, 0.5)[0].astype(np.float32)
        regridded, _ = window_raster(expected, SIZE, SIZE, None)
        np.testing.assert_allclose(page.drawn("rollout", "Rollout"), regridded, atol=1e-5)
        assert page.engine.title("rollout").startswith("gradient rollout through 3 layers")
    finally:
        section.weighing = "weights"
    assert page.engine.title("rollout").startswith("rollout through 3 layers")


def test_explore_a_capture_with_its_model_and_inputs():
    """Any model: ``explore(capture, model=..., inputs=...)``. The page switches a head off
    in the shown layer of a stacked capture; its hidden states are drawn as their norm per
    position; the map opens another layer's head; the rollout runs over the capture."""
    import zoo

    import attnpanel

    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    captured = attnpanel.capture(model, *args, **kwargs)
    explorer = attnpanel.explore(captured, model=model, inputs=args, layer=1)
    explorer.__panel__().get_root(Document())
    assert explorer.model.layers == ["transformer.h.0.attn", "transformer.h.1.attn"]
    explorer.param.update(enabled_heads=[0, 1, 3], sample=1)
    drawn = {
        key.label: np.asarray(found[0]["source"].data["value"])
        for key, found in explorer.engine.plots("prediction").items()
        if key.group == "Prediction"
    }
    with torch.no_grad(), attnpanel.ablate(model, {"transformer.h.1.attn": [2]}):
        hidden = model(args[0][1:2])[0]
    np.testing.assert_allclose(drawn["‖output‖ (heads off)"], hidden.norm(dim=-1), rtol=1e-5)
    assert explorer.last_error == ""
    section = explorer.sections["importance"]
    section.click(x=3.0, y=0.0)  # the top row: layer 0
    assert (explorer.layer, explorer.head) == (0, 3)
    assert "prediction" in explorer.engine.panes() and "metrics" not in explorer.engine.panes()
    with pytest.raises(TypeError, match="needs inputs="):
        attnpanel.explore(captured, model=model)
    with pytest.raises(TypeError, match="a torch.nn.Module or a ModelRun"):
        attnpanel.explore(captured, model="gpt", inputs=args)
    with pytest.raises(ValueError, match="does not name its layers"):
        attnpanel.explore(captured.isel(layer=0).drop_vars("layer"), model=model, inputs=args)


def test_a_metrics_change_is_written_to_the_decimals_of_its_metric():
    from attnpanel.render.importance_views import change_text, metric_table

    assert change_text("10.91", "10.92", 0.00792) == "+0.01"
    assert change_text("0.9152", "0.9073", -0.007925) == "-0.0079"
    assert change_text("16", "17.55", 1.55) == "+1.55"  # the finer of the two
    assert change_text("1", "0.9152", -0.0848) == "-0.0848"
    assert change_text("1.234e+04", "1.3e+04", 660.0) == "+660"
    assert change_text("1", "1", 0.0) == "+0"
    assert change_text("5.334", "5.334", 0.00004) == "+4e-05"  # too small for its decimals
    table = metric_table(
        {"MAE kettle (W)": 16.04, "F1 kettle": 0.9152},
        {"MAE kettle (W)": 40.91, "F1 kettle": 0.9073},
        [2],
    )
    assert list(table.dimension_values("change")) == ["+24.87", "-0.0079"]


def test_an_f1_with_nothing_on_is_not_available_with_its_reason_not_zero():
    """An appliance that never runs in the sample (0 W), rightly predicted off: its F1 is
    0 / 0, undefined; the table reads "n/a" with the reason on hover, and no change."""
    from attnpanel.nilm.demo import demo_model_run
    from attnpanel.nilm.training import f1_score
    from attnpanel.render.importance_views import F1_UNDEFINED, metric_table
    from attnpanel.render.tables import table_html

    off = np.zeros(480, dtype=bool)
    assert np.isnan(f1_score(off, off))
    assert f1_score(off, off | (np.arange(480) == 3)) == 0.0  # predicted on once: F1 0
    run = demo_model_run(n_windows=1)
    silent = np.zeros((len(run.series), 480))
    metrics = run.metrics(silent, silent)
    assert all(np.isnan(v) for k, v in metrics.items() if k.startswith("F1"))
    assert all(v == 0.0 for k, v in metrics.items() if k.startswith("MAE"))
    table = metric_table(metrics, metrics, [2])
    html = table_html(table)
    name = next(k for k in metrics if k.startswith("F1"))
    assert f'<td>{name}</td><td title="{F1_UNDEFINED}">n/a</td>' in html
    assert "<td>0</td>" not in html.split(name)[1].split("</tr>")[0]


def test_the_power_axis_names_what_it_draws(page):
    """The aggregate alone: "aggregate power (W)"; with each appliance's true and predicted
    power on the same axis: "power (W)" (it said "aggregate power" for every curve)."""
    from attnpanel.readouts import core

    sel = page.selection
    assert core.sequence_series(page.trace, sel, show_reference=False).ylabel == "aggregate power"
    assert core.sequence_series(page.trace, sel, show_reference=True).ylabel == "power"
    page.param.update(show_reference=True)
    axis = page.engine.plots("sequence")
    labels = {h["yaxis"].axis_label for f in axis.values() for h in f if h.get("yaxis")}
    assert labels == {"power (W)"}


def test_the_samples_beside_the_shown_one_are_ready_before_a_step_to_them(page, run):
    """While the page is idle the next and the previous sample's model runs (importance,
    the rollout's capture) and maps are computed: a step to either runs the model no more
    and recomputes no map, and draws what the model computes."""
    page.param.update(sample=2)
    page.engine.finish_idle()  # what a served page does while idle
    for sample in (3, 1):
        assert stages_cached(page.trace, page.selection.with_(sample=sample), page.cache)
    forwards = []
    hook = run.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        page.param.update(sample=3)
    finally:
        hook.remove()
    assert forwards == []
    drawn = page.drawn("importance", "Importance")
    every = model_prediction(run, 3, [])
    change = np.linalg.norm(model_prediction(run, 3, [4]) - every) / np.linalg.norm(every)
    assert drawn[2, 4] == pytest.approx(change, rel=1e-4)

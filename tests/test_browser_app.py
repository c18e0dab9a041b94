"""The served explorer (``panel serve apps/main.py``) in real headless Chromium.

One server and one page are shared by the module; each test acts through the page the
way a person would (clicks, widget changes) and checks the pixels Bokeh painted.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from served_app import PAGE_TEXT_JS, opened, page_widths, shot, thread_stacks

from attnpanel.app.sections.rollout import ROLLOUT_SIZE as SIZE
from attnpanel.readouts import core

MATRIX = "sample "  # the matrix title starts "sample N, head ..." (the top view "sample N:")


def matrix_js() -> str:
    return "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"


@pytest.fixture(scope="module")
def app(browser, demo_url):
    # every section open: the projection and the merge are drawn on demand
    with opened(browser, demo_url + "?projection=true&merge=true") as served:
        yield served


def set_widget(page, title: str, value) -> None:
    page.evaluate("([t, v]) => { attn.widget(t).value = v; }", [title, value])


def matrix_hash(page) -> int:
    return page.evaluate(f"attn.hash({matrix_js()})")


def wait_matrix_change(page, before: int) -> None:
    page.evaluate(f"(b) => attn.until_changed({matrix_js()}, b)", before)


def test_the_servers_threads_can_be_read_when_a_test_fails(app, demo_server):
    """What conftest's report of a failed test adds: every thread's stack of the server
    (its event loop's at least), read from its log on SIGUSR1; the server goes on."""
    page, _ = app
    stacks = thread_stacks(demo_server.proc, demo_server.log)
    assert "most recent call first" in stacks and "run_forever" in stacks, stacks[:500]
    assert demo_server.proc.poll() is None
    assert page.evaluate("() => Bokeh.documents.length") == 1


def test_page_loads_without_console_errors(app, artifacts):
    page, console = app
    errors = [m for m in console if m[0] in ("error", "pageerror")]
    shot(page, artifacts, "loaded")
    assert errors == []
    # each title's words, whichever lines the server broke it into
    titles = page.evaluate("attn.plots().map((v) => v.model.title.text.replace(/\\s+/g, ' '))")
    for expected in (
        "sample 0: aggregate power",
        "input x[",
        "Wq",
        "Wk",
        "Wv",
        "Q[",
        "K[",
        "V[",
        "weights of query",
        "value vectors, top 5 keys",
        "context of query",
        "head merge",
        "Wo",
        "output Wo",
    ):
        assert any(t.startswith(expected) for t in titles), (expected, titles)
    tiles = page.evaluate(
        "attn.plot('head maps').model.renderers.map((r) => r.name)"
        ".filter((n) => n && n.startsWith('head'))"
    )
    assert tiles == [f"head {h}" for h in range(8)]  # one figure, a tile per head
    labels = page.evaluate(
        "attn.views().filter((v) => v.model && 'title' in v.model && "
        "typeof v.model.title === 'string').map((v) => v.model.title)"
    )
    for label in ("Sample", "Head", "Query", "Mask", "Stage"):
        assert label in labels
        assert page.get_by_text(re.compile(rf"^{label}\b")).first.is_visible()


def test_maps_and_short_charts_paint_on_a_2d_canvas(app, artifacts):
    """No WebGL context for a map or a chart of a few hundred points: each costs a read-back
    per paint in software GL (WebGL is for curves of over 5,000 points)."""
    page, _ = app
    backends = page.evaluate(
        """attn.plots().flatMap((pv) => [...pv.renderer_views.values()]
             .filter((rv) => rv.model.glyph && rv.model.glyph.type === 'Image')
             .map(() => pv.model.output_backend))"""
    )
    shot(page, artifacts, "canvas")
    assert len(backends) >= 13  # matrix, Wq, Wk, Wv, Wo, 8 head tiles
    assert set(backends) == {"canvas"}
    charts = page.evaluate(
        "attn.plots().filter((pv) => pv.model.title.text.startsWith('weights of query'))"
        ".map((pv) => pv.model.output_backend)"
    )
    assert charts == ["canvas"]


def test_click_top_curve_moves_row_and_aggregation(app, artifacts):
    page, _ = app
    before_row = page.evaluate("attn.widget('Query').value")
    bars_before = page.evaluate("attn.hash(attn.plot('weights of query'))")
    matrix_before = matrix_hash(page)
    point = page.evaluate("attn.frame_point(attn.plot('sample 0: aggregate'), 0.6, 0.5)")
    page.mouse.click(point["x"], point["y"])
    wait_matrix_change(page, matrix_before)
    page.evaluate("(b) => attn.until_changed(attn.plot('weights of query'), b)", bars_before)
    row = page.evaluate("attn.widget('Query').value")
    assert row != before_row
    assert abs(row - 0.6 * 479) < 10
    marker = page.evaluate(
        f"(() => {{ const pv = {matrix_js()}; return [...pv.renderer_views.values()]"
        ".filter((rv) => rv.model.type === 'BoxAnnotation' && rv.model.visible "
        "&& Number.isFinite(rv.model.bottom))"
        ".map((rv) => rv.model.bottom) })()"
    )
    assert marker == [pytest.approx(row - 0.5)]
    title = page.evaluate("attn.plot('weights of query').model.title.text")
    assert title.startswith(f"weights of query {row} ")
    # the power curve itself stays drawn when the query marker moves
    visible = page.evaluate(
        "[...attn.plot('sample 0: aggregate').renderer_views.values()]"
        ".filter((rv) => rv.model.type === 'GlyphRenderer' && rv.model.glyph.type === 'Line')"
        ".map((rv) => rv.model.visible)"
    )
    assert visible and visible[0] is True, visible
    shot(page, artifacts, "clicked_curve")


@pytest.mark.parametrize(
    ("title", "value"),
    [
        ("Head", "head 3"),
        ("Mask", "causal"),
        ("Stage", "raw scores"),
        ("Head", "mean of heads"),
        ("Sample", 5),
    ],
)
def test_controls_change_matrix_pixels(app, artifacts, title, value):
    page, _ = app
    before = matrix_hash(page)
    set_widget(page, title, value)
    wait_matrix_change(page, before)
    assert matrix_hash(page) != before
    shot(page, artifacts, f"control_{title.lower()}_{str(value).replace(' ', '_')}")


def test_diagonal_mask_draws_diagonal_black(app, artifacts):
    page, _ = app
    set_widget(page, "Head", "head 0")
    set_widget(page, "Stage", "softmax")
    before = matrix_hash(page)
    set_widget(page, "Mask", "diagonal")
    page.wait_for_function(
        f"{matrix_js()}.model.title.text.endsWith('softmax weights (mask diagonal)')"
    )
    try:
        wait_matrix_change(page, before)
    except Exception:  # noqa: BLE001 - already diagonal and drawn: nothing to wait for
        pass
    page.wait_for_timeout(500)
    cells = page.evaluate(
        f"""(() => {{ const pv = {matrix_js()};
             const out = [];
             for (let i = 20; i < 470; i += 37) {{
               out.push([attn.rgba_at(pv, i, i), attn.rgba_at(pv, i + 3, i)]);
             }}
             return out; }})()"""
    )
    shot(page, artifacts, "diagonal_black")
    for diagonal, beside in cells:
        assert max(diagonal[:3]) < 30, cells
        assert max(beside[:3]) > 60, cells


def test_switching_a_head_off_changes_output(app, artifacts):
    page, _ = app
    before = page.evaluate("attn.hash(attn.plot('output Wo'))")
    assert "changed 0.0%" in page.evaluate("attn.plot('output Wo').model.title.text")
    page.get_by_role("button", name="head 2", exact=True).click()
    # the server's new output and its title come in one message; the pixels alone may
    # change before it (a repaint of a page laid out again): the title is waited for
    page.wait_for_function("!attn.plot('output Wo').model.title.text.includes('changed 0.0%')")
    page.evaluate("(b) => attn.until_changed(attn.plot('output Wo'), b)", before)
    tile_palette = (
        "(h) => attn.plot('head maps').model.renderers.find((r) => r.name === `head ${h}`)"
        ".glyph.color_mapper.palette.at(-1)"
    )
    assert page.evaluate(tile_palette, 2) == "#8a8a8a"  # head 2's tile turns grey
    assert page.evaluate(tile_palette, 3) != "#8a8a8a"
    pressed = page.get_by_role("button", name="head 2", exact=True)
    assert "bk-active" not in pressed.get_attribute("class")
    shot(page, artifacts, "head_off")
    page.get_by_role("button", name="head 2", exact=True).click()
    page.wait_for_function("attn.plot('output Wo').model.title.text.includes('changed 0.0%')")


PREDICTION_JS = """(label) => {
  const pv = attn.plot("the model's prediction");
  const legend = [...pv.model.center, ...pv.model.right].find((m) => m.type === "Legend");
  const item = legend.items.find((i) => (i.label && i.label.value) === label);
  return Array.from(item.renderers[0].data_source.data.value);
}"""


def test_switching_a_head_off_re_runs_the_model(app, artifacts):
    """The prediction drawn with a head off is the demo model's own, run again with that
    head's lane zeroed before its output projection (a hook, the long way)."""
    from test_importance_page import model_prediction

    from attnpanel.nilm.demo import demo_model_run

    page, console = app
    sample = page.evaluate("attn.widget('Sample').value")
    run = demo_model_run()
    plot = 'attn.plot("the model\'s prediction")'
    page.get_by_role("button", name="head 5", exact=True).scroll_into_view_if_needed()
    before = page.evaluate(f"attn.hash({plot})")
    page.get_by_role("button", name="head 5", exact=True).click()
    page.evaluate(f"(b) => attn.until_changed({plot}, b)", before)
    page.wait_for_function(f"{plot}.model.title.text.includes('head 5 switched off')")
    every = model_prediction(run, sample, [], windows=32)
    without = model_prediction(run, sample, [5], windows=32)
    for i, name in enumerate(run.series):
        drawn = page.evaluate(PREDICTION_JS, f"{name} (heads off)")
        np.testing.assert_allclose(drawn, without[i], rtol=1e-5, atol=1e-3)
        drawn = page.evaluate(PREDICTION_JS, f"{name} (predicted)")
        np.testing.assert_allclose(drawn, every[i], rtol=1e-5, atol=1e-3)
    table = page.evaluate("attn.table('every head').textContent")
    assert "heads off" in table and "F1 kettle" in table
    page.get_by_text("Which heads the prediction needs").scroll_into_view_if_needed()
    shot(page, artifacts, "head_off_prediction")
    page.get_by_role("button", name="head 5", exact=True).click()
    page.wait_for_function(f"{plot}.model.title.text.includes('every head on')")
    # the ranking: each head of each layer switched off alone, the model's own change
    drawn = np.array(
        page.evaluate(
            "() => { const pv = attn.plot('head importance');"
            " const r = pv.model.renderers.find((r) => r.glyph.type === 'Image');"
            " return Array.from(r.data_source.data.image[0]); }"
        )
    ).reshape(3, 8)  # rows by layer, drawn top down: the traced layer (2) last
    every = model_prediction(run, sample, [], windows=32)
    for head in (1, 6):
        without = model_prediction(run, sample, [head], windows=32)
        change = np.linalg.norm(without - every) / np.linalg.norm(every)
        assert drawn[2, head] == pytest.approx(change, rel=1e-4)
    # a click on a cell of the traced layer (the bottom row) opens that head
    page.evaluate("attn.plot('head importance').el.scrollIntoView({block: 'center'})")
    point = page.evaluate("attn.frame_point(attn.plot('head importance'), 6.5 / 8, 5 / 6)")
    page.mouse.click(point["x"], point["y"])
    page.wait_for_function(
        """() => { const w = attn.widget('Head');
                   const o = w.options.find((o) => (Array.isArray(o) ? o[0] : o) === w.value);
                   return (Array.isArray(o) ? o[1] : o) === 'head 6'; }"""
    )
    set_widget(page, "Head", "head 0")
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


ROLLOUT_JS = """() => { const pv = attn.plots().find((v) => / rollout through|^rollout through/
                                                      .test(v.model.title.text));
  const r = pv.model.renderers.find((r) => r.glyph.type === 'Image');
  return [pv.model.title.text.replace(/\\s+/g, ' '), Array.from(r.data_source.data.image[0])]; }"""


def test_the_rollout_sits_beside_the_matrix_and_weighs_by_gradient(app, artifacts):
    """The rollout map is in the matrix's row at 1600 px, draws the rollout of the demo
    model's own attention on the shown sample, and the button gives Chefer et al.'s
    gradient-weighted one, from the model's own weights and their autograd gradient."""
    import torch
    from test_gradients import ExplicitSDPA, long_gradient_rollout

    import attnpanel
    from attnpanel.interventions.importance import output_tensor
    from attnpanel.nilm.demo import demo_model_run
    from attnpanel.readouts.raster import window_raster

    page, console = app
    page.set_viewport_size({"width": 1600, "height": 1300})
    sample = page.evaluate("attn.widget('Sample').value")
    boxes = page.evaluate(
        f"[{matrix_js()}, attn.plot('rollout through')]"
        ".map((v) => v.el.getBoundingClientRect().top)"
    )
    assert abs(boxes[0] - boxes[1]) < 120  # one row: the map beside the matrix
    run = demo_model_run()
    inputs, kwargs = run.one(sample)
    explicit = ExplicitSDPA()
    with torch.enable_grad(), explicit:
        y = output_tensor(run.model(*inputs, **kwargs))
    torch.linalg.vector_norm(y.double()).backward()
    weights = [w.detach().double().numpy() for w in explicit.weights]
    grads = [w.grad.double().numpy() for w in explicit.weights]
    title, drawn = page.evaluate(ROLLOUT_JS)
    assert title.startswith("rollout through 3 layers")
    own = attnpanel.rollout(attnpanel.capture(run.model, *inputs, **kwargs))
    plain, _ = window_raster(own.values[0].astype(np.float32), SIZE, SIZE, None)
    np.testing.assert_allclose(np.reshape(drawn, plain.shape), plain, atol=1e-5)
    page.get_by_role("button", name="gradient × weights").click()
    page.wait_for_function(f"() => ({ROLLOUT_JS})()[0].startsWith('gradient rollout')")
    title, drawn = page.evaluate(ROLLOUT_JS)
    expected = long_gradient_rollout(weights, grads, 0.5)[0].astype(np.float32)
    regridded, _ = window_raster(expected, SIZE, SIZE, None)
    np.testing.assert_allclose(np.reshape(drawn, regridded.shape), regridded, atol=1e-5)
    page.evaluate("attn.plot('gradient rollout').el.scrollIntoView({block: 'center'})")
    shot(page, artifacts, "rollout_gradient_1600")
    page.set_viewport_size({"width": 1280, "height": 1300})
    page.wait_for_timeout(300)
    shot(page, artifacts, "rollout_gradient_1280")
    page.get_by_role("button", name="weights", exact=True).click()
    page.wait_for_function(f"() => ({ROLLOUT_JS})()[0].startsWith('rollout through')")
    page.set_viewport_size({"width": 1600, "height": 1300})
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


# the survey's plot (its title's words, whichever line they are on)
SURVEY_TITLE = "v.model.title.text.replace(/\\s+/g, ' ').endsWith(': entropy (nats)')"
# What the page shows of the survey's checkbox and section, and of its connection.
SURVEY_STATE_JS = (
    """() => {
  const box = attn.views().find((v) => v.model && v.model.label === 'every sample (survey)');
  const text = ("""
    + PAGE_TEXT_JS
    + """)();
  return {checkbox: box ? box.model.active : 'none', idle: Bokeh.documents[0].is_idle,
          heading: text.includes('Every head over every sample'),
          plots: attn.plots().map((v) => v.model.title.text.slice(0, 40)).length,
          titles: attn.plots().map((v) => v.model.title.text.slice(0, 40)).slice(-4)};
}"""
)
SURVEY_JS = """(group) => {
  const words = (v) => v.model.title.text.replace(/\\s+/g, ' ');
  const pv = attn.plots().find((v) => words(v).includes(': entropy (nats)') ||
                                      words(v).includes(': distance'));
  const r = pv.model.renderers.find((r) => r.glyph.type === 'Scatter' &&
                                           r.data_source.data.value.length === group);
  return [pv.model.title.text.replace(/\\s+/g, ' '), Array.from(r.data_source.data.head),
          Array.from(r.data_source.data.value)];
}"""


def test_the_survey_shows_every_sample_of_the_models_own_statistics(app, artifacts):
    """Ticked in the controls: each head's entropy over the 32 windows, as the demo model's
    own survey computes it; a click on a point opens that window."""
    from served_app import click_checkbox

    from attnpanel.nilm.demo import demo_model_run
    from attnpanel.render.survey_views import jitter

    page, console = app
    page.set_viewport_size({"width": 1600, "height": 1300})
    click_checkbox(page, "every sample (survey)")
    try:
        # the survey of 32 windows is computed once per server process after its first page
        # (well under a second): two minutes is a hang, not a slow machine
        page.wait_for_function(f"() => attn.plots().some((v) => {SURVEY_TITLE})", timeout=120_000)
    except Exception as err:  # what the page shows: in two workers it never showed the survey
        shot(page, artifacts, "survey_never_shown")
        raise AssertionError(f"no survey on the page: {page.evaluate(SURVEY_STATE_JS)}") from err
    title, heads, values = page.evaluate(SURVEY_JS, 32 * 8)
    assert title == "encoder.2.attention: entropy (nats)"
    own = demo_model_run().survey()["entropy"].sel(layer="encoder.2.attention").values
    drawn = np.stack([np.asarray(values)[np.round(heads).astype(int) == h] for h in range(8)], 1)
    np.testing.assert_allclose(drawn, own, rtol=1e-5)
    page.evaluate(
        f"attn.plots().find((v) => {SURVEY_TITLE}).el.scrollIntoView({{block: 'center'}})"
    )
    shot(page, artifacts, "survey_1600")
    page.set_viewport_size({"width": 1280, "height": 1300})
    page.wait_for_timeout(500)
    shot(page, artifacts, "survey_1280")
    page.set_viewport_size({"width": 1600, "height": 1300})
    page.wait_for_timeout(500)
    # a click on window 9's point of head 4 opens window 9
    target = 9
    point = page.evaluate(
        "([x, y]) => { const pv = attn.plots().find((v) =>"
        " v.model.title.text.replace(/\\s+/g, ' ').endsWith(': entropy (nats)'));"
        " const f = pv.frame; const b = pv.el.getBoundingClientRect();"
        " return {x: b.left + f.x_scale.compute(x), y: b.top + f.y_scale.compute(y)}; }",
        [4 + float(jitter(32)[target]), float(own[target, 4])],
    )
    page.mouse.click(point["x"], point["y"])
    page.wait_for_function(f"() => attn.widget('Sample').value === {target}")
    page.wait_for_function(  # the shown window's points move to it
        f"() => Math.abs(({SURVEY_JS})(8)[2][4] - {float(own[target, 4])}) < 1e-4"
    )
    title, heads, values = page.evaluate(SURVEY_JS, 8)
    np.testing.assert_allclose(values, own[target], rtol=1e-5)
    click_checkbox(page, "every sample (survey)")
    set_widget(page, "Sample", 0)
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


SUMMARY_JS = """() => {
  return [...attn.table("entropy").querySelectorAll("tbody tr")].map(
    (row) => [...row.querySelectorAll("td")].map((c) => c.textContent.trim()));
}"""


def test_head_summary_table_redraws_with_the_mask(app, artifacts):
    """The per-head table shows the statistics of the shown sample and mask, and new ones
    after a mask switch (a table that kept drawing its first data once misled here)."""
    import attnpanel
    from attnpanel.readouts.core import head_patterns

    trace = attnpanel.demo()

    def expected(mask):
        sample = page.evaluate("attn.widget('Sample').value")  # as earlier tests left it
        sel = core.Selection(sample=sample, mask=mask, stage="softmax")
        weights = core.stage_heads(trace, sel)
        return [f"{d:.1f}" for d in np.round(head_patterns(np.nan_to_num(weights))["distance"], 1)]

    page, console = app

    def shown(mask) -> list:
        """Set the mask; wait until the table shows its statistics (the whole change is
        then on the page: the table comes after the matrix); the table's rows."""
        set_widget(page, "Mask", mask)
        page.wait_for_function(
            f"(want) => JSON.stringify(({SUMMARY_JS})().map((row) => row[1]))"
            " === JSON.stringify(want)",
            arg=expected(mask),
        )
        return page.evaluate(SUMMARY_JS)

    before = shown("diagonal")
    assert [row[0] for row in before] == [f"head {h}" for h in range(8)]
    after = shown("causal")
    assert [row[1] for row in after] != [row[1] for row in before]
    shot(page, artifacts, "head_summary")
    shown("diagonal")  # as the page was, the change done before the next test
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_the_page_fits_1280_and_1600_pixels_with_side_by_side(app):
    """No horizontal scroll at either width, with the unmasked matrix shown too (the page
    once grew to 2088 px with it); the unmasked matrix shows the selected head."""
    page, console = app
    assert page_widths(page) == {1280: 1280, 1600: 1600}
    set_widget(page, "Head", "mean of heads")
    page.evaluate(
        "attn.views().find((v) => v.model && v.model.label === "
        "'masked and unmasked side by side').model.active = true"
    )
    page.wait_for_function(
        "() => attn.plots().filter((v) => /^sample \\d+, mean of heads/.test(v.model.title.text))"
        ".length === 2"
    )
    assert page_widths(page) == {1280: 1280, 1600: 1600}
    # the two maps level, frame beside frame (the unmasked one sat 7 px lower)
    tops = page.evaluate(
        "attn.plots().filter((v) => /^sample \\d+, mean of heads/.test(v.model.title.text))"
        ".map((v) => v.el.getBoundingClientRect().top + v.frame.bbox.top)"
    )
    assert len(tops) == 2 and abs(tops[0] - tops[1]) < 0.5, tops
    page.evaluate(
        "attn.views().find((v) => v.model && v.model.label === "
        "'masked and unmasked side by side').model.active = false"
    )
    set_widget(page, "Head", "head 0")
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_weight_matrices_have_colour_bars_axes_and_a_scale_centred_on_zero(app, artifacts):
    """Wq, Wk, Wv and Wo are drawn with axes (in, out), a colour bar and a colour scale
    centred on 0 (the one colour rule for signed values)."""
    page, _ = app
    found = page.evaluate(
        """['Wq', 'Wk', 'Wv', 'Wo'].map((t) => {
             const pv = attn.plot(t); const m = pv.model;
             const parts = [...m.left, ...m.below, ...m.right, ...m.above];
             const bar = parts.find((a) => a.type === 'ColorBar');
             return {title: m.title.text, bar: bar !== undefined,
                     low: bar ? bar.color_mapper.low : null,
                     high: bar ? bar.color_mapper.high : null,
                     axes: parts.filter((a) => a.type.endsWith('Axis')).map((a) => a.axis_label),
                     painted: pv.canvas_view.bbox.width > 0};
           })"""
    )
    shot(page, artifacts, "weight_matrices")
    for w in found:
        assert w["bar"] and w["painted"], w
        assert w["low"] == -w["high"] and w["high"] > 0, w
        assert len(w["axes"]) == 2, w
    assert sorted(found[-1]["axes"]) == ["in", "out"]  # Wo's; the small three have a caption
    text = page.evaluate(PAGE_TEXT_JS)
    assert "rows: out, columns: in; colours ±p99.5 of |value| (centred on 0)" in text


def test_the_matrix_row_keeps_its_layout_through_every_stage_and_mask(app):
    """At 1280 and 1600 px the matrix takes the same room whatever its colour bar's labels
    (-12.5 or 0.0005): the row never re-wraps, and the page below never jumps, as the
    stage player steps through the stages."""
    page, console = app
    found = {}
    for width in (1280, 1600):
        page.set_viewport_size({"width": width, "height": 1300})
        for mask in ("diagonal", "causal"):
            set_widget(page, "Mask", mask)
            for stage in ("raw scores", "scaled", "masked", "softmax", "value-weighted"):
                before = matrix_hash(page)
                set_widget(page, "Stage", stage)
                if (mask, stage) != ("diagonal", "raw scores"):
                    wait_matrix_change(page, before)
                page.wait_for_timeout(150)  # the layout settles after the paint
                found[width, mask, stage] = tuple(
                    page.evaluate(
                        f"""() => {{
                      const m = {matrix_js()}.el.getBoundingClientRect();
                      const a = attn.plot('weights of query').el.getBoundingClientRect();
                      return [Math.round(m.width), Math.round(a.top - m.top),
                              document.documentElement.scrollHeight];
                    }}"""
                    )
                )
        layouts = {v for (w, _, _), v in found.items() if w == width}
        assert len(layouts) == 1, {k: v for k, v in found.items() if k[0] == width}
    set_widget(page, "Mask", "diagonal")
    set_widget(page, "Stage", "softmax")
    page.set_viewport_size({"width": 1600, "height": 1300})
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_the_section_checkboxes_wrap_tightly_beside_the_player(app):
    """One line at 1600 px; at 1280 px the last ones wrap onto a second line right under
    the first (each once kept a 28 px top margin there: a 50 px gap)."""
    page, console = app
    js = """() => attn.views().filter((v) => v.model && v.model.type === 'Checkbox' &&
                                            v.el.getBoundingClientRect().width > 0)
                  .map((v) => Math.round(v.el.getBoundingClientRect().top))"""
    lines = {}
    for width in (1600, 1280):
        page.set_viewport_size({"width": width, "height": 1300})
        page.wait_for_timeout(500)
        lines[width] = sorted(set(page.evaluate(js)))
    assert len(lines[1600]) == 1, lines
    assert len(lines[1280]) == 2 and lines[1280][1] - lines[1280][0] < 35, lines
    page.set_viewport_size({"width": 1600, "height": 1300})
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


# Records, from now, the server's document patches that are a change's own (not the maps
# sent ahead, ColumnsStreamed; not the URL; not the busy indicator showing or going): per
# patch, the models' types, attributes and titles it changed.
PATCHES_JS = """
() => {
  const doc = Bokeh.documents[0], apply = doc.apply_json_patch;
  window.attn_patches = [];
  doc.apply_json_patch = function (patch, buffers) {
    const out = apply.call(this, patch, buffers);
    const own = [];
    for (const e of patch.events || []) {
      const m = e.model && doc.get_model_by_id(e.model.id);
      if (!m || e.kind === "ColumnsStreamed" || String(m.type).includes("Location")) continue;
      if (m.type === "panel.models.markup.HTML" && e.attr === "visible") continue;
      if ("value" in m.properties && m.title === "Sample") continue;  // its own echo
      // a source: the titles of the plots drawing it (what a failure names)
      const owners = m.type === "ColumnDataSource" ? attn.plots().filter((v) =>
        v.model.renderers.some((r) => r.data_source === m)).map((v) => v.model.title.text) : [];
      own.push({ type: String(m.type), attr: e.attr || "", text: m.text || owners.join(" | ") });
    }
    if (own.length) window.attn_patches.push(own);
    return out;
  };
}
"""
SAMPLE_TITLES_JS = """
(n) => attn.plots().filter((v) => v.el.offsetParent !== null)  // shown
  .map((v) => v.model.title ? v.model.title.text : "")
  .filter((t) => /sample \\d+/.test(t))
  .every((t) => new RegExp(`sample ${n}\\\\b`).test(t))
"""


def test_a_sample_change_reaches_every_view_in_one_message(app):
    """Another sample is one document patch: every title naming the sample, the clock tick
    labels and the maps together, never the new sample's ticks under the old one's title
    (which the page showed, its views sent in three messages)."""
    page, _ = app
    now = page.evaluate("attn.widget('Sample').value")
    target = (now + 1) % 32
    page.evaluate(PATCHES_JS)
    set_widget(page, "Sample", target)
    page.wait_for_function(SAMPLE_TITLES_JS, arg=target, timeout=60_000)
    page.wait_for_function("() => Bokeh.documents[0].is_idle")
    patches = page.evaluate("window.attn_patches")
    # a redraw of the state before, still on its way when the sample changed (titles of
    # another sample, no clock of its own) is not part of the change; one that brings this
    # sample's clock under another sample's title is the defect this test is for
    while patches and not any(e["type"] == "CustomJSTickFormatter" for e in patches[0]):
        if any(e["type"] == "Title" and f"sample {target}," in e["text"] for e in patches[0]):
            break
        patches.pop(0)
    titled = [p for p in patches if any(e["type"] == "Title" for e in p)]
    assert len(titled) == 1, [[(e["type"], e["attr"]) for e in p][:6] for p in patches]
    (whole,) = titled
    changed = {(e["type"], e["attr"]) for e in whole}
    assert ("CustomJSTickFormatter", "args") in changed  # the new sample's clock
    titles = [e["text"] for e in whole if e["type"] == "Title"]
    assert any(t.startswith(f"sample {target}, head") for t in titles)
    assert any(t.startswith(f"sample {target}: ") for t in titles)  # the top view
    # nothing of the change came in another message (the sections' views included)
    assert patches == [whole], [[(e["type"], e["attr"], e["text"]) for e in p] for p in patches[1:]]


# The text of the hover tooltips shown now.
TIPS_JS = """
() => { const out = []; const walk = (n) => { if (!n) return;
  if (n.nodeType === 1 && /tooltip/i.test(n.className || "") && n.offsetParent !== null
      && n.innerText.trim()) out.push(n.innerText);
  if (n.shadowRoot) walk(n.shadowRoot); for (const c of n.childNodes || []) walk(c); };
  walk(document.body); return out.join("\\n"); }
"""


def hover_text(page, plot_js: str, x: float, y: float) -> str:
    """The tooltip over the data point ``(x, y)`` of a plot (its words, as a person reads)."""
    point = page.evaluate(
        f"""([x, y]) => {{ const pv = ({plot_js}); pv.el.scrollIntoView({{block: "center"}});
            const r = pv.el.getBoundingClientRect();
            return {{x: r.left + pv.frame.x_scale.compute(x),
                     y: r.top + pv.frame.y_scale.compute(y)}}; }}""",
        [x, y],
    )
    return hover_point(page, point)


def hover_point(page, point: dict) -> str:
    """The tooltip with the mouse at a page point."""
    page.mouse.move(point["x"], point["y"])
    try:
        page.wait_for_function(f"() => ({TIPS_JS})().length > 0", timeout=5000)
        return page.evaluate(TIPS_JS)
    finally:
        page.mouse.move(0, 0)


def test_a_blocked_cell_hovers_in_words_and_a_note_says_what_black_is(app):
    """BokehJS prints "NaN" for a NaN value before any formatter sees it: the diagonal
    hovered "softmax weights: NaN". A blocked cell now reads what it is, in the matrix
    (server's image and browser's copy) and in the head tiles; the note names black."""
    page, _ = app
    set_widget(page, "Mask", "diagonal")
    set_widget(page, "Stage", "softmax")
    page.wait_for_function(f"() => ({matrix_js()}).model.title.text.includes('(mask diagonal)')")
    for head in ("head 2", "head 3"):  # the second is drawn from the browser's copy or not
        set_widget(page, "Head", head)
        page.wait_for_function(f"() => ({matrix_js()}).model.title.text.includes('{head},')")
        blocked = hover_text(page, matrix_js(), 240.5, 240.5)
        assert "softmax weights:\tblocked by the mask: weight 0 after the softmax" in blocked
        assert "NaN" not in blocked
        shown = hover_text(page, matrix_js(), 100.5, 300.5)  # a cell the mask lets through
        assert re.search(r"softmax weights:\s+\d\.\d{4}", shown), shown
    # a head's tile, regridded to its pixels: a cell mostly blocked reads so too
    page.evaluate("attn.plot('head maps').el.scrollIntoView({block: 'center'})")
    for fraction in (0.3, 0.5, 0.7):
        tile = hover_point(page, page.evaluate(f"attn.tile_point(0, {fraction}, {fraction})"))
        assert "weight:" in tile and "NaN" not in tile
    page.evaluate("window.scrollTo(0, 0)")
    text = page.evaluate(PAGE_TEXT_JS)
    assert "black: cells the diagonal mask blocks (the model fills their scores with" in text

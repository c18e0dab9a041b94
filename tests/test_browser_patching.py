"""The page's "what changes the prediction" section in real headless Chromium, against the
demo model patched by a hook: a URL opens it on a window without the kettle; the map the
page paints is each head's lane, before its output projection, taken from the clean run
the long way; a click on a head draws its patched prediction and opens it in the matrix."""

from __future__ import annotations

import urllib.parse

import numpy as np
import pytest
import torch
from served_app import opened, shot
from test_patching_page import kettle_window

from attnpanel.nilm.demo import demo_model_run, demo_windows, without_appliance
from attnpanel.nilm.nilmformer import time_features
from attnpanel.readouts.core import MAP_TITLE_LINE

WINDOWS = 32  # the served demo's
MAP_JS = """() => { const pv = attn.plot("output patched into");
  const r = pv.model.renderers.find((r) => r.glyph.type === 'Image');
  return [pv.model.title.text, Array.from(r.data_source.data.image[0])]; }"""
CURVE_JS = """(label) => {
  const pv = attn.plot("prediction on sample");
  const legend = [...pv.model.center, ...pv.model.right].find((m) => m.type === "Legend");
  const item = legend.items.find((i) => (i.label && i.label.value) === label);
  return Array.from(item.renderers[0].data_source.data.value);
}"""


@pytest.fixture(scope="module")
def app(browser, demo_url):
    query = urllib.parse.urlencode(
        {"patching": "true", "corrupted": "without the kettle", "sample": kettle_window(WINDOWS)}
    )
    with opened(browser, f"{demo_url}?{query}") as served:
        yield served


def hooked(run, sample: int, layer: str, head: int | None):
    """The long way, on the window without the kettle: the kettle's predicted power (raw
    output, summed) with ``head``'s lane before ``layer``'s output projection from the
    clean window (None: no lane replaced), and the clean and corrupted scores."""
    held = demo_windows(WINDOWS)
    features = time_features(held["time"].values[sample : sample + 1])
    clean = torch.from_numpy(held["aggregate"].values[sample : sample + 1])
    corrupted = torch.from_numpy(without_appliance(held.isel(window=[sample]), "kettle"))
    kettle = list(run.series).index("kettle")
    module = run.model.get_submodule(f"{layer}.wo")
    taken = []
    handle = module.register_forward_pre_hook(lambda _m, args: taken.append(args[0].clone()))
    with torch.no_grad():
        high = float(run.model(clean, features)[:, kettle].double().sum())
    handle.remove()

    def lane(_m, args):
        merged = args[0].clone()
        width = merged.shape[-1] // 8
        lane = slice(head * width, (head + 1) * width)
        merged[..., lane] = taken[0][..., lane]
        return (merged,)

    handle = module.register_forward_pre_hook(lane) if head is not None else None
    with torch.no_grad():
        output = run.model(corrupted, features)
        prediction = run.model.predict(corrupted, features)[0].numpy()
    if handle is not None:
        handle.remove()
    return float(output[:, kettle].double().sum()), high, prediction


def test_the_painted_map_is_each_head_patched_by_a_hook(app, artifacts):
    page, console = app
    sample = kettle_window(WINDOWS)
    page.wait_for_function(
        "() => attn.plots().some((v) => v.model.title.text.startsWith(`output patched into`))",
        timeout=120_000,
    )
    title, image = page.evaluate(MAP_JS)
    assert " ".join(title.split()) == f"output patched into sample {sample} without the kettle"
    assert max(len(line) for line in title.splitlines()) <= MAP_TITLE_LINE  # wrapped, not cut
    drawn = np.array(image, dtype=float).reshape(3, 8)  # rows by layer, as the page paints them
    run = demo_model_run()
    low, high, _ = hooked(run, sample, "encoder.0.attention", None)
    for layer, head in (("encoder.2.attention", 6), ("encoder.1.attention", 2)):
        patched, _, _ = hooked(run, sample, layer, head)
        row = int(layer.split(".")[1])
        assert drawn[row, head] == pytest.approx((patched - low) / (high - low), rel=1e-3, abs=1e-5)
    page.evaluate("attn.plot(`output patched into`).el.scrollIntoView({block: 'center'})")
    for width in (1280, 1600):
        page.set_viewport_size({"width": width, "height": 1300})
        page.evaluate("attn.plot(`output patched into`).el.scrollIntoView({block: 'center'})")
        page.wait_for_timeout(500)
        shot(page, artifacts, f"patching_{width}")
        view = artifacts / f"browser_patching_section_{width}.png"
        page.screenshot(path=str(view))  # the viewport: the section as a person sees it
        assert view.stat().st_size > 10_000
    assert [e for e in console if e[0] in ("error", "pageerror")] == []


def test_a_click_draws_the_head_patched_and_opens_it(app, artifacts):
    page, console = app
    sample = kettle_window(WINDOWS)
    page.set_viewport_size({"width": 1600, "height": 1300})
    page.evaluate("attn.plot(`output patched into`).el.scrollIntoView({block: 'center'})")
    point = page.evaluate("attn.frame_point(attn.plot(`output patched into`), 5.5 / 8, 2.5 / 3)")
    page.mouse.click(point["x"], point["y"])  # the bottom row: the traced layer, head 5
    page.wait_for_function(
        "() => attn.plot(`prediction on sample`).model.title.text"
        ".includes('encoder.2.attention head 5 patched in')",
        timeout=60_000,
    )
    page.wait_for_function(
        """() => { const w = attn.widget('Head');
                   const o = w.options.find((o) => (Array.isArray(o) ? o[0] : o) === w.value);
                   return (Array.isArray(o) ? o[1] : o) === 'head 5'; }"""
    )
    _, _, expected = hooked(demo_model_run(), sample, "encoder.2.attention", 5)
    for i, name in enumerate(demo_model_run().series):
        drawn = page.evaluate(CURVE_JS, f"{name} (head patched)")
        np.testing.assert_allclose(drawn, expected[i], rtol=1e-5, atol=1e-3)
    shot(page, artifacts, "patching_clicked")
    assert [e for e in console if e[0] in ("error", "pageerror")] == []

"""``attnpanel serve --model FILE.py:FUNCTION --checkpoint ... --recording UKDALE``: the
page of the reference NILMFormer on a house in UK-DALE's layout, in Chromium. The matrix
paints the model's own attention (read by a hook on its softmax) over 481 positions, its
axes and hover read the house's clock and name the statistics token, the top view says the
window's date, and the metrics table compares the model's own numbers."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from recordings import house_power, write_ukdale
from reference_nilmformer import small_nilmformer, trained
from served_app import ROOT, free_port, opened, serving, shot

from attnpanel import series
from attnpanel.app.sections.matrix import MATRIX_SIZE
from attnpanel.readouts.raster import window_raster

pytestmark = pytest.mark.slow
MATRIX = "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"
IMAGE_JS = (
    f"(() => {{ const r = {MATRIX}.model.renderers.find((r) => r.data_source"
    " && r.data_source.data.image); return Array.from(r.data_source.data.image[0]); })()"
)
LABELS_JS = f"(() => {{ const p = {MATRIX}.model; return [p.below[0].formatter.args.labels,"
LABELS_JS += " p.left[0].formatter.args.labels]; })()"


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_recording")
    write_ukdale(root / "ukdale", {"1": house_power(hours=16)})
    model = trained(small_nilmformer, root / "trainer.pt")
    return root, model


@pytest.fixture(scope="module")
def page(browser, recording):
    root, _ = recording
    port = free_port()
    cmd = [
        sys.executable, "-m", "attnpanel", "serve",
        "--model", "tests/reference_nilmformer.py:small_nilmformer",
        "--checkpoint", str(root / "trainer.pt"), "--recording", str(root / "ukdale"),
        "--target", "kettle", "--scale", "6000", "--clip", "6000",
        "--threshold", "kettle=2000", "--windows", "2", "--port", str(port),
    ]  # fmt: skip
    with serving(cmd, port, f"http://localhost:{port}/attnpanel", timeout=240) as (url, _):
        with opened(browser, url) as served:
            yield served


def own_weights(model, windows, layer: int) -> np.ndarray:
    """The softmax weights the model's own attention module computed (a hook on the
    dropout it applies them through, the identity in eval mode)."""
    seen = []
    module = model.EncoderBlock[layer].attention_layer.attn_dropout
    handle = module.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    recipe = series.make_recipe("nilmformer", scale=6000.0, clip=6000.0, targets=["kettle"])
    try:
        args, kwargs = recipe.inputs(windows)
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        handle.remove()
    return seen[0].numpy()


def test_the_matrix_is_the_models_own_attention_with_times_and_the_token_named(
    page, recording, artifacts
):
    tab, console = page
    root, model = recording
    windows = series.windows_of(series.read_recordings(root / "ukdale"), 480, freq="1min")
    own = own_weights(model, windows.isel(window=[0]), layer=0)
    assert own.shape == (1, 4, 481, 481)
    title = tab.evaluate(f"{MATRIX}.model.title.text")
    words = " ".join(title.split())  # (broken into lines where the plot is narrow)
    assert words.startswith("sample 0, head 0, layer EncoderBlock.0.attention_layer:")
    drawn = np.asarray(tab.evaluate(IMAGE_JS), dtype=np.float32)
    # the page draws a blocked cell (the diagonal: weight 0) as no value, then fits the 481
    # cells to its 480 pixels
    blocked = np.eye(481, dtype=bool)
    expected, _ = window_raster(np.where(blocked, np.nan, own[0, 0]), MATRIX_SIZE, MATRIX_SIZE)
    assert (own[0, 0][blocked] == 0).all()
    np.testing.assert_allclose(drawn.reshape(expected.shape), expected, rtol=1e-6, atol=1e-9)
    keys, queries = tab.evaluate(LABELS_JS)
    assert len(keys) == len(queries) == 481
    assert keys[0] == "00:00" and keys[479] == "07:59" and keys[480] == "statistics"
    hover = tab.evaluate(
        f"{MATRIX}.model.toolbar.tools.filter((t) => t.type === 'HoverTool')"
        ".map((t) => t.tooltips[0][1])"
    )
    assert hover and all(tip == "$x{custom}" for tip in hover)  # the key read as its label
    top = tab.evaluate("attn.plot('sample').model.title.text")
    assert top == "sample 0: aggregate power, Mon 3 Mar 2014 (click to pick the query)"
    shot(tab, artifacts, "recording_1600")
    tab.set_viewport_size({"width": 1280, "height": 1000})
    tab.wait_for_timeout(500)
    shot(tab, artifacts, "recording_1280")
    assert [text for kind, text in console if kind in ("pageerror", "error")] == []


def test_the_metrics_table_is_the_models_own_on_the_window(page, recording):
    tab, _ = page
    root, model = recording
    windows = series.windows_of(series.read_recordings(root / "ukdale"), 480, freq="1min")
    recipe = series.make_recipe("nilmformer", scale=6000.0, clip=6000.0, targets=["kettle"])
    run = series.RecordingModel(model, recipe, windows.isel(window=[0]), {"kettle": 2000.0})
    expected = series.nilm(run.truth()[0, 0], run.predictions()[0, 0], 2000.0)
    tab.evaluate("attn.table('MAE kettle').scrollIntoView({block: 'center'})")
    cells = tab.evaluate(
        "Array.from(attn.table('MAE kettle').querySelectorAll('tr'))"
        ".map((r) => Array.from(r.querySelectorAll('td')).map((c) => c.textContent))"
    )
    rows = {row[0]: row[1] for row in cells if row}
    assert float(rows["MAE kettle (W)"]) == pytest.approx(expected["MAE"], rel=1e-3)
    assert ROOT.exists()

"""An Energformer-like NILM model's linear attention served in Chromium: the matrix paints
the model's implicit weights (the long way, from its own modules), the words name no
softmax, and every title, axis and table fits at 1280 and 1600 px."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from linear_app import energformer
from served_app import PAGE_TEXT_JS, ROOT, WORDS_JS, opened, serve, shot
from test_linear_attention import long_way

from attnpanel.app.sections.matrix import MATRIX_SIZE
from attnpanel.readouts.raster import window_raster

pytestmark = pytest.mark.slow
MATRIX = "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"
IMAGE_JS = (
    f"(() => {{ const r = {MATRIX}.model.renderers.find((r) => r.data_source"
    " && r.data_source.data.image); return Array.from(r.data_source.data.image[0]); })()"
)


def test_a_linear_attention_is_painted_as_its_implicit_weights(browser, artifacts):
    model, power = energformer()
    seen = {}
    layer = model.encoder[0].attention
    hook = layer.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        model(power)
    hook.remove()
    phi_q, phi_k = long_way(layer, seen["x"])
    products = (phi_q.double() @ phi_k.double().transpose(-2, -1))[0, 0].numpy()
    own = (products / products.sum(-1, keepdims=True)).astype(np.float32)
    with serve(ROOT / "tests" / "linear_app.py") as (url, _proc):
        with opened(browser, f"{url}?why=true&composition=true&survey=true") as (page, console):
            title = " ".join(page.evaluate(f"{MATRIX}.model.title.text").split())
            assert title.startswith("sample 0, head 0, layer encoder.0.attention")
            assert "weights φ(q)·φ(k) / row sum" in title and "softmax" not in title
            drawn = np.asarray(page.evaluate(IMAGE_JS), dtype=np.float32)
            expected, _ = window_raster(own, MATRIX_SIZE, MATRIX_SIZE)
            np.testing.assert_allclose(drawn.reshape(expected.shape), expected, atol=1e-6)
            stages = page.evaluate("attn.widget('Stage').options")
            labels = [o[1] if isinstance(o, list) else o for o in stages]
            assert "weights (row sum)" in labels and "softmax" not in labels
            for width in (1280, 1600):
                page.set_viewport_size({"width": width, "height": 1300})
                page.wait_for_timeout(800)
                problems = page.evaluate(WORDS_JS)
                assert problems == [], "\n".join(problems)
                page.screenshot(path=str(artifacts / f"browser_linear_{width}.png"), full_page=True)
            shot(page, artifacts, "linear")
            text = " ".join(page.evaluate(PAGE_TEXT_JS).split())
            assert "weights φ(q)·φ(k) / row sum per head" in text  # the head comparison
            for untrue in ("softmax weights", "softmax over key"):
                assert untrue not in text
            assert [t for kind, t in console if kind in ("pageerror", "error")] == []

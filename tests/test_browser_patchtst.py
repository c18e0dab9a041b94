"""PatchTST (built from its Hugging Face config, offline) served in Chromium: its positions
are a CLS token and spans of 16 steps every 8, laid out from the config with no layout
given. The matrix paints the model's own attention (``output_attentions``), its axes name
each span by its interval and the token by its name, and a span picked as the query is drawn
as its interval on the top view (nothing for the token, which has no time)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from patchtst_app import STAMPS, patchtst
from served_app import ROOT, opened, serve

from attnpanel.app.sections.matrix import MATRIX_SIZE
from attnpanel.readouts.raster import window_raster

pytestmark = pytest.mark.slow
MATRIX = "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"
IMAGE_JS = (
    f"(() => {{ const r = {MATRIX}.model.renderers.find((r) => r.data_source"
    " && r.data_source.data.image); return Array.from(r.data_source.data.image[0]); })()"
)
SPAN_JS = (
    "(() => attn.plot('sample 0: input').model.center.filter((m) => m.type === "
    "'BoxAnnotation' && m.visible).map((m) => [m.left, m.right]))()"
)


def ms(text: str) -> float:
    return pd.Timestamp(text).value / 1e6


def test_patches_are_spans_and_the_cls_token_is_named(browser, artifacts):
    model, values = patchtst()
    with torch.no_grad():
        own = model(past_values=values, output_attentions=True).attentions[0].numpy()
    with serve(ROOT / "tests" / "patchtst_app.py") as (url, _proc):
        with opened(browser, url) as (page, console):
            title = page.evaluate(f"{MATRIX}.model.title.text")
            assert title.startswith("sample 0, head 0, layer encoder.layers.0.self_attn:")
            drawn = np.asarray(page.evaluate(IMAGE_JS), dtype=np.float32)
            expected, _ = window_raster(own[0, 0], MATRIX_SIZE, MATRIX_SIZE)
            np.testing.assert_allclose(drawn.reshape(expected.shape), expected, rtol=1e-6)
            labels = page.evaluate(f"{MATRIX}.model.below[0].formatter.args.labels")
            assert labels[:2] == ["cls", "00:06–00:21"] and labels[-1] == "00:54–01:09"
            assert len(labels) == own.shape[-1] == 8
            assert page.evaluate(SPAN_JS) == []  # query 0 is the CLS token: no time, no span
            page.evaluate("attn.widget('Query').value = 1")
            page.wait_for_function(f"() => {SPAN_JS}.length === 1", timeout=30_000)
            [(left, right)] = page.evaluate(SPAN_JS)
            assert (left, right) == (ms(str(STAMPS[6])), ms(str(STAMPS[21])))
            page.screenshot(path=str(artifacts / "browser_patchtst.png"), full_page=True)
            assert [t for kind, t in console if kind in ("pageerror", "error")] == []

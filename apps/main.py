"""Serve the attention explorer on the demo trace: ``panel serve apps/main.py``.

Demonstrates every stage of NILMFormer's multi-head self-attention on 32 held-out 8-hour
windows of household power, one layer of the trained demo model.
Highlights: the full 480 x 480 attention rasterized by datashader, masks recomputed live
from q and k, a stage player, head toggles that switch heads off inside the model and draw
its prediction again.

Panel runs this file once per session; the demo trace is computed once per server
process and shared read-only, and the next session's explorer is built while the server is
idle (``attnpanel.app.serving``). The survey of every head over the 32 windows is computed
once per process in a thread after the first page has loaded.
"""

import threading
from functools import partial

import panel as pn

import attnpanel
from attnpanel.app import serving
from attnpanel.app.explorer import AttentionExplorer, notify_errors
from attnpanel.nilm.demo import demo_model_run

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)
serving.release_on_close()
serving.skip_document_validation()  # the page is validated once, by the tests

trace = serving.shared_trace("demo", attnpanel.demo)
model = pn.state.as_cached("attnpanel:demo model", demo_model_run)  # one per process
explorer = serving.built_ahead("demo", partial(AttentionExplorer.built, trace, model=model))
explorer.servable(title="attnpanel explorer")


def warm_survey() -> threading.Thread:
    """The demo's survey (every head over every sample), computed once per process off the
    event loop after the first page has loaded: ready when a session first shows it."""
    thread = threading.Thread(target=model.survey, name="attnpanel demo survey", daemon=True)
    thread.start()
    return thread


pn.state.onload(lambda: pn.state.as_cached("attnpanel:demo survey", warm_survey))

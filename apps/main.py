"""Serve the attention explorer on the demo trace: ``panel serve apps/main.py --warm``.

Demonstrates every stage of NILMFormer's multi-head self-attention on 32 held-out 8-hour
windows of household power, one layer of the trained demo model.
Highlights: the full 480 x 480 attention rasterized by datashader, masks recomputed live
from q and k, a stage player, head toggles that switch heads off inside the model and draw
its prediction again.

Panel runs this file once per session; the demo trace is computed once per server
process and shared read-only, and the next session's explorer is built while the server is
idle (``attnpanel.app.serving``). The survey of every head over the 32 windows is computed
once per process in a thread after the first page has loaded. With ``--warm``, Panel runs
this file once as the server starts: the demo and the first explorer are built then, and
the first visitor's page opens as a later one does; without it, the first page shows the
demo being built (``serving.LoadingPage``), then the explorer.
"""

import threading
from functools import partial

import panel as pn

import attnpanel
from attnpanel.app import serving
from attnpanel.app.explorer import AttentionExplorer, notify_errors
from attnpanel.nilm.demo import demo_model_run

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)
serving.release_memory()
serving.skip_document_validation()  # the page is validated once, by the tests

TITLE = "attnpanel explorer"
READY = ("attnpanel:demo", "attnpanel:demo model")  # what every session shares, once built


def page(trace, model):
    return serving.built_ahead("demo", partial(AttentionExplorer.built, trace, model=model))


def shared_trace():
    # its maps recomputed per sample when read, bit for bit: 450 MB the server never holds
    return serving.shared_trace("demo", partial(attnpanel.demo, on_demand=True))  # READY[0]


def shared_model():
    return serving.shared(READY[1], demo_model_run)


# with ``--warm`` (the README's command) the demo is built as the server starts, with the
# first explorer (and the next one, built ahead for the first visitor); without it, the
# first page shows the demo being built, step by step, then the explorer
STEPS = [
    ("the trace of 32 held-out windows", READY[0], shared_trace),
    ("the model at hand", READY[1], shared_model),
]
serving.served_when_built(TITLE, "the demo", STEPS, lambda found: page(*found))


def warm_survey() -> threading.Thread:
    """The demo's survey (every head over every sample), computed once per process off the
    event loop after the first page has loaded: ready when a session first shows it."""
    # (bound now: Bokeh clears this module's names once the session's script has run)
    model, trim = shared_model(), serving.trim_memory

    def survey():
        model.survey()
        trim()  # what its worker thread's heap freed goes back

    thread = threading.Thread(target=survey, name="attnpanel demo survey", daemon=True)
    thread.start()
    return thread


def survey_later() -> None:
    if serving.is_shared(READY[1]):  # else the loading page's session warms none
        pn.state.as_cached("attnpanel:demo survey", warm_survey)


pn.state.onload(survey_later)

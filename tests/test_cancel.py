"""Superseded work stops between its steps (attnpanel.util.cancel): the exact pixels of a zoomed
window, computed on a session's worker, stop once the user zooms again; a stored overview,
which other views wait for, never stops; outside a worker's scope nothing changes."""

from __future__ import annotations

import threading
import time

import numpy as np
import panel as pn
import pytest
import torch
from panel.io.state import set_curdoc
from session_doc import SessionDocument

from attnpanel.app.background import Background
from attnpanel.kernels import masks, tiles
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.traces.build import trace
from attnpanel.traces.overviews import Entry, Overviews
from attnpanel.util import cancel


def _qk(length: int = 3000, heads: int = 1, dim: int = 8):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, length, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(1, heads, length, dim, generator=generator, dtype=torch.float64)
    masking = masks.Masking("diagonal")
    return q, k, tiles.log_sum_exp(q, k, masking), masking


def test_check_does_nothing_outside_a_scope_and_while_the_result_is_wanted():
    cancel.check()  # no scope: a script, a notebook
    with cancel.while_wanted(lambda: True):
        cancel.check()
    with cancel.while_wanted(lambda: False), pytest.raises(cancel.Superseded):
        cancel.check()
    cancel.check()  # the scope ended with its block


def test_a_shielded_block_runs_to_its_end_inside_an_unwanted_scope():
    with cancel.while_wanted(lambda: False):
        with cancel.shielded():
            cancel.check()
        with pytest.raises(cancel.Superseded):
            cancel.check()  # the scope holds again after the shield


def test_a_window_pass_stops_when_superseded_and_is_unchanged_while_wanted():
    q, k, lse, masking = _qk()
    window = (slice(100, 2900), slice(20, 2990))  # 60 steps: a pixel row (47 queries) each
    plain = tiles.overview(q, k, lse, masking, pixels=(60, 60), window=window)
    with cancel.while_wanted(lambda: True):
        wanted = tiles.overview(q, k, lse, masking, pixels=(60, 60), window=window)
    for part in ("max", "mean", "blocked"):
        np.testing.assert_array_equal(getattr(wanted, part), getattr(plain, part))
    steps = []

    def still_wanted():  # the user zooms again after the pass's third step
        steps.append(1)
        return len(steps) < 3

    with cancel.while_wanted(still_wanted), pytest.raises(cancel.Superseded):
        tiles.overview(q, k, lse, masking, pixels=(60, 60), window=window)
    assert len(steps) == 3  # it stopped at the first check after the zoom


def test_a_stored_overview_is_computed_to_its_end_even_when_its_caller_is_superseded():
    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(16, 2, "diagonal").eval()
    ds = trace(layer, torch.randn(1, 300, 16), dense=False)
    entry = Entry(sample=0, head=1, mask="causal", pixels=(30, 30))
    with cancel.while_wanted(lambda: False):
        found = Overviews(ds).get(entry)
    expected = Overviews(ds).get(entry)
    np.testing.assert_array_equal(found.max, expected.max)


def test_a_refinement_superseded_while_it_runs_stops_and_only_the_newest_is_drawn():
    doc = SessionDocument()
    background = Background(pn.pane.HTML(visible=False), threads=2)
    started, steps, drawn, failed = threading.Event(), [], [], []

    def first():  # a window's exact pixels: many steps, each a check
        started.set()
        for _ in range(2000):
            cancel.check()
            steps.append(1)
            time.sleep(0.005)
        return "first window"

    try:
        with set_curdoc(doc):
            background.run([("matrix", first, drawn.append)], failed.append, refine=True)
            assert started.wait(10)
            time.sleep(0.05)
            start = time.monotonic()
            # the user zooms again: the same view's next refinement
            background.run([("matrix", lambda: "second window", drawn.append)], failed.append)
        results = []
        while len(results) < 2:  # both hand back: the first with nothing, the second drawn
            callback = doc.loop.get(timeout=10)
            name = getattr(callback, "func", callback).__name__
            if name == "_arrived":
                results.append(callback)
            callback()
        took = time.monotonic() - start
    finally:
        background.close()
    assert drawn == ["second window"]
    assert failed == []
    assert background.in_flight == 0
    # the first stopped at its next check instead of running its 2000 steps (10 s)
    assert len(steps) < 2000
    assert took < 5, took


def test_work_done_ahead_never_shows_the_busy_indicator_and_a_dropped_job_is_not_drawn():
    """A map sent ahead (quiet) is not work the user waits for: the busy indicator stays
    hidden however long it takes. A job dropped while it runs (the browser drew that change
    itself) hands back nothing to draw."""
    doc = SessionDocument()
    indicator = pn.pane.HTML(visible=False)
    background = Background(indicator, threads=2)
    drawn, failed = [], []

    def slow(name: str, release: threading.Event):
        def compute():
            release.wait(10)
            return name

        return compute

    def run_loop(arrivals: int) -> None:
        while arrivals:
            callback = doc.loop.get(timeout=10)
            arrivals -= getattr(callback, "func", callback).__name__ == "_arrived"
            callback()

    try:
        ahead, matrix = threading.Event(), threading.Event()
        with set_curdoc(doc):
            background.run(
                [("ahead", slow("ahead", ahead), drawn.append)], failed.append, quiet=True
            )
        time.sleep(0.4)  # longer than IN_FLIGHT_BUSY_S
        assert background.in_flight == 0 and doc.loop.empty()  # no indicator is due
        ahead.set()
        run_loop(1)
        assert drawn == ["ahead"] and indicator.visible is False
        with set_curdoc(doc):
            background.run([("matrix", slow("matrix", matrix), drawn.append)], failed.append)
            assert background.in_flight == 1
            background.drop("matrix")  # the browser drew the change itself
        matrix.set()
        run_loop(1)
    finally:
        background.close()
    assert drawn == ["ahead"]  # the dropped one is not drawn
    assert failed == []
    assert background.in_flight == 0
    assert indicator.visible is False

"""``pn.serve(explorer)`` (the pattern of ``examples/own_model.py``): one explorer object
served to two pages. Each page gets an explorer of its own; both draw, neither says
``UnsetValueError`` (the second page failed with it before)."""

from __future__ import annotations

import sys
import tempfile

import pytest
from served_app import ROOT, free_port, opened, serving

pytestmark = pytest.mark.slow
MATRIX = "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"


def settled_hash(page, tries: int = 20) -> int:
    """The matrix's pixels once two readings 0.5 s apart agree (a page's idle work done)."""
    found = page.evaluate(f"attn.hash({MATRIX})")
    for _ in range(tries):
        page.wait_for_timeout(500)
        again = page.evaluate(f"attn.hash({MATRIX})")
        if again == found:
            return found
        found = again
    raise AssertionError("the matrix kept changing on its own")


def test_the_own_model_example_serves_two_pages(browser):
    port = free_port()
    folder = tempfile.mkdtemp()
    cmd = [
        sys.executable, str(ROOT / "examples" / "own_model.py"), f"{folder}/own.nc",
        "--serve", "--port", str(port),
    ]  # fmt: skip
    url = f"http://localhost:{port}/"
    with serving(cmd, port, url, timeout=240) as (url, proc):
        with opened(browser, url) as (first, console_first):
            with opened(browser, url) as (second, console_second):
                # both pages drew their matrix (opened waits for every part of the page)
                # two documents of their own (one explorer each), not one document twice
                ids = [
                    page.evaluate("() => Object.keys(Bokeh.index).join(',')")
                    for page in (first, second)
                ]
                assert ids[0] != ids[1]
                # each page answers its own controls: a head chosen on the second page
                # redraws the second page's matrix and leaves the first page's as it was
                before = [settled_hash(page) for page in (first, second)]
                second.evaluate("([t, v]) => { attn.widget(t).value = v; }", ["Head", "head 2"])
                second.evaluate(f"(b) => attn.until_changed({MATRIX}, b)", before[1])
                first.wait_for_timeout(1000)
                assert first.evaluate(f"attn.hash({MATRIX})") == before[0]
        log = (ROOT / "artifacts" / f"serve-{port}.log").read_text()
    assert "UnsetValueError" not in log and "Traceback" not in log, log[-2000:]
    errors = [
        text for kind, text in console_first + console_second if kind in ("pageerror", "error")
    ]
    assert errors == []

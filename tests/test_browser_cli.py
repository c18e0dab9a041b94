"""``attnpanel serve TRACE`` in headless Chromium: one explorer per page (the served
function once both returned the explorer and called ``.servable()``: two headers and 52
figures), and a trace file's strings shown as text (its source attribute is a script).
Chromium missing makes the ``browser`` fixture fail, never skip.
"""

from __future__ import annotations

import sys

import pytest
from hostile import SOURCE, hostile_capture
from served_app import PAGE_TEXT_JS, free_port, opened, serving, shot

import attnpanel


@pytest.fixture(scope="module")
def served(browser, tmp_path_factory):
    path = attnpanel.save(hostile_capture(), tmp_path_factory.mktemp("cli") / "shared.nc")
    port = free_port()
    cmd = [sys.executable, "-m", "attnpanel", "serve", str(path), "--port", str(port)]
    with (
        serving(cmd, port, f"http://localhost:{port}/attnpanel") as (url, _proc),
        opened(browser, url) as page_console,
    ):
        yield page_console


def test_one_explorer_per_page(served, artifacts):
    page, console = served
    shot(page, artifacts, "cli_serve_1600")
    titles = page.evaluate("attn.plots().map((v) => v.model.title.text)")
    matrices = [t for t in titles if t.startswith("sample 0, head 0")]
    assert len(matrices) == 1, titles
    assert len(titles) < 40, f"{len(titles)} figures: the explorer is drawn more than once"
    text = page.evaluate(PAGE_TEXT_JS)
    assert text.count("attnpanel · ") == 1  # one header
    assert SOURCE.splitlines()[0][:60] in text  # the file's source shown as written
    assert [m for m in console if m[0] in ("dialog", "pageerror")] == []

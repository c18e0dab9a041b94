"""Shared fixtures: deterministic torch, param warnings as errors, a real headless Chromium."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import param
import pytest
import torch
from served_app import (
    CHROMIUM,
    HELPERS_JS,
    RENDERED_JS,
    image_js,
    launch_chromium,
    serve,
    shot,
    thread_stacks,
)

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

if "PYTEST_XDIST_WORKER" in os.environ:
    # One core each for the two workers and the servers they start (which inherit the
    # variables): with torch's default of one thread per core, both workers' threads spun
    # on both cores, and the demo server's survey of 32 windows took over 120 s (60 s alone).
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    torch.set_num_threads(1)

param.parameterized.warnings_as_exceptions = True


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into node ids
def pytest_collection_modifyitems(items):
    """Every test that drives Chromium is marked ``browser`` (``-m "not browser"`` skips them).

    With ``-n 2 --dist loadgroup`` (pytest-xdist, the default: pyproject.toml) the tests
    that drive Chromium run in one worker, in their order, with one browser and one demo
    server, beside the others, a module at a time (its fixtures built once). The groups are
    set before xdist reads them into the node ids (``tryfirst``): set after, there were
    none, and the browser tests ran on both workers (two demo servers and two Chromiums on
    two cores; 20.7 min where the groups take 18.5; ``test_suite_groups.py``).
    """
    for item in items:
        browser = "browser" in getattr(item, "fixturenames", ())
        if browser:
            item.add_marker(pytest.mark.browser)
        group = "browser" if browser else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Folder for screenshots and other test outputs (ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium driven by Playwright; fails loudly when it is missing."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium package")
    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


@dataclasses.dataclass
class DemoServer:
    """The README's server of the demo, and what its first visitor's page showed."""

    url: str
    log: Path  # its output (attnpanel's INFO lines included)
    proc: object  # its process (thread_stacks reads what a hung one was doing)
    first: dict  # the first page (``FIRST_LINK``): figures in its first document, its titles,
    # the matrix's values


FIRST_LINK = "?sample=1&head=2"
SERVED: list[DemoServer] = []  # the demo server while it runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test of the served demo reports what every thread of the server was doing
    (a page that waited for the server in vain: which lock or call held it)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and SERVED and "demo_server" in item.fixturenames:
        server = SERVED[-1]
        report.sections.append(("demo server's threads", thread_stacks(server.proc, server.log)))


@pytest.fixture(scope="session")
def demo_server(browser, artifacts) -> DemoServer:
    """``panel serve apps/main.py --warm`` (the README's command), started once for every
    browser test of the demo, its log showing attnpanel's INFO lines; each test module opens
    its own page (its own session, its own explorer state). Its first page is opened here,
    as soon as it listens: what a warm server's first visitor gets."""
    setup = ("--setup", str(Path(__file__).parent / "log_info.py"))
    with serve(extra_args=("--warm", *setup)) as (url, _proc):
        port = url.split(":")[2].split("/")[0]
        page = browser.new_page(viewport={"width": 1600, "height": 1300})
        try:
            page.goto(url + FIRST_LINK, timeout=180_000)
            page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0")
            figures = page.evaluate(
                "[...Bokeh.documents[0].all_models].filter((m) => m.type === 'Figure').length"
            )
            page.evaluate(HELPERS_JS)
            page.wait_for_function(RENDERED_JS, timeout=180_000)
            first = {
                "figures": figures,
                "titles": page.evaluate("attn.plots().map((v) => v.model.title.text)"),
                "image": page.evaluate(image_js("sample 1, head 2")),
            }
            shot(page, artifacts, "warm_first_page")
        finally:
            page.close()
        server = DemoServer(url, ARTIFACTS / f"serve-{port}.log", _proc, first)
        SERVED.append(server)
        yield server
        SERVED.remove(server)


@pytest.fixture(scope="session")
def demo_url(demo_server) -> str:
    return demo_server.url

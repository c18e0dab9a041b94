"""Shared fixtures: deterministic torch, param warnings as errors, a real headless Chromium."""

from __future__ import annotations

from pathlib import Path

import param
import pytest
import torch
from served_app import CHROMIUM, launch_chromium, serve

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

param.parameterized.warnings_as_exceptions = True


def pytest_collection_modifyitems(items):
    """Every test that drives Chromium is marked ``browser`` (``-m "not browser"`` skips them)."""
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


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


@pytest.fixture(scope="session")
def demo_url() -> str:
    """``panel serve apps/main.py``, started once for every browser test of the demo; each
    test module opens its own page (its own session, its own explorer state)."""
    with serve() as (url, _proc):
        yield url

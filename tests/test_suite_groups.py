"""The suite's own layout (tests/conftest.py): under ``--dist loadgroup`` every test runs in
its xdist group, a module's tests together and every browser test in one worker (one demo
server, one Chromium). xdist reads the groups into the node ids before pytest runs them; a
group set after it read them was no group (the browser tests ran on both workers)."""

from __future__ import annotations


def grouped(request) -> bool:
    """Whether this run distributes tests by group (the README's command: ``-n 2``)."""
    return bool(getattr(request.config.option, "loadgroup", False))


def test_a_test_runs_in_its_modules_group(request):
    assert request.node.nodeid.endswith(f"@{__name__}") == grouped(request)


def test_a_browser_test_runs_in_the_browser_group(request, browser):
    assert request.node.nodeid.endswith("@browser") == grouped(request)
    assert request.node.get_closest_marker("browser") is not None

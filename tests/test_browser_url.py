"""Shareable state: the served explorer mirrors its selection in the page URL."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

from served_app import opened


def test_url_reopens_the_same_view_and_follows_changes(browser, artifacts, demo_url):
    query = "?sample=2&head=3&query=120&mask=causal&stage=scaled"
    with opened(browser, demo_url + query) as (page, console):
        title = page.evaluate(
            "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text)).model.title.text"
        )
        assert title.startswith("sample 2, head 3"), title
        assert "causal" in title and "scaled" in title, title
        marker = page.evaluate("attn.plot('sample 2').model.title.text")
        assert marker.startswith("sample 2")
        page.screenshot(path=str(artifacts / "browser_url_state.png"), full_page=True)

        page.evaluate("attn.widget('Query').value = 300")
        page.wait_for_function("() => /query=300/.test(window.location.search)", timeout=30_000)
        state = parse_qs(urlparse(page.url).query)
        assert state["sample"] == ["2"] and state["query"] == ["300"]
        assert state["mask"] == ["causal"] and state["stage"] == ["scaled"]
        assert [m for m in console if m[0] in ("error", "pageerror")] == []
    assert re.match(r"http://127\.0\.0\.1:\d+/main", demo_url)

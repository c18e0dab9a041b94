"""Shareable state: the served explorer mirrors its selection in the page URL."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

from served_app import click_checkbox, opened, page_widths, shot


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


def test_projection_and_merge_open_on_demand(browser, artifacts, demo_url):
    """The default page draws neither the projection nor the merge (a session that never
    opens them does not pay for their plots); their checkboxes draw them, the guided walk's
    steps open them, and the URL keeps them open."""
    titles_js = "attn.plots().map((v) => v.model.title.text)"
    with opened(browser, demo_url) as (page, console):
        titles = page.evaluate(titles_js)
        assert not any(t.startswith(("Wq", "head merge", "output Wo")) for t in titles), titles
        assert page_widths_ok(page)
        click_checkbox(page, "Q/K/V projection")
        page.wait_for_function("() => attn.plots().some((v) => v.model.title.text === 'Wq')")
        page.wait_for_function("() => /projection=true/i.test(window.location.search)")
        shot(page, artifacts, "projection_opened")
        # the walk's step 6 (the head's lane in the merge) opens the merge
        page.get_by_role("button", name="Walk through one query").click()
        for _ in range(5):
            page.get_by_role("button", name="next ▶").click()
            page.wait_for_timeout(150)
        page.wait_for_function(
            "() => attn.plots().some((v) => v.model.title.text.startsWith('head merge'))"
        )
        page.wait_for_function("() => /merge=true/i.test(window.location.search)")
        wq = page.evaluate("attn.plots().find((v) => v.model.title.text === 'Wq').bbox.width")
        assert wq > 50
        assert [m for m in console if m[0] in ("error", "pageerror")] == []


def page_widths_ok(page) -> bool:
    return page_widths(page) == {1280: 1280, 1600: 1600}

"""Shareable state: the served explorer mirrors its selection in the page URL."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import numerics
import numpy as np
from served_app import (
    HELPERS_JS,
    RENDERED_JS,
    click_checkbox,
    image_js,
    opened,
    page_widths,
    serve,
    shot,
)

import attnpanel


def test_url_reopens_the_same_view_and_follows_changes(browser, artifacts, demo_url):
    query = "?sample=2&head=3&query=120&mask=causal&stage=scaled"
    with opened(browser, demo_url + query) as (page, console):
        # every hover over the matrix names its values as the title does, from the first
        # read (the cached levels' hover said "softmax weights" for seconds)
        names = page.evaluate(
            "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text)).model.toolbar"
            ".tools.filter((t) => t.type === 'HoverTool').map((t) => t.tooltips.at(-1)[0])"
        )
        assert names and set(names) == {"scaled scores q·k / √E"}, names
        title = page.evaluate(
            "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text)).model.title.text"
        )
        assert title.startswith("sample 2, head 3"), title
        # scaled scores come before the mask: the title names none, the menu the link's
        assert "scaled" in title and "(before the mask)" in title, title
        assert page.evaluate("attn.widget('Mask').value") == "causal"
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


def test_a_page_built_ahead_shows_its_urls_selection_on_its_first_paint(
    browser, artifacts, demo_server
):
    """The server builds the next session's explorer while it is idle
    (``serving.built_ahead``), on the default selection. The session that takes it must
    show its URL's selection on its first paint, in every view, and its matrix must be the
    model's own weights."""
    url = demo_server.url
    with opened(browser, url):
        pass  # a session: once its page has loaded, the next is built
    taken = demo_server.log.read_text().count("this session takes what was built ahead")
    page = browser.new_page(viewport={"width": 1600, "height": 1300})
    try:
        page.goto(url + "?sample=2&head=3&query=120", timeout=180_000)
        page.wait_for_function("() => window.Bokeh && Object.keys(Bokeh.index).length > 0")
        page.evaluate(HELPERS_JS)
        page.wait_for_function(RENDERED_JS, timeout=180_000)
        # read at once: a view drawn on the built-ahead selection and corrected by a later
        # update would be caught here
        titles = page.evaluate("attn.plots().map((v) => v.model.title.text)")
        image = page.evaluate(image_js("sample 2, head 3"))
        page.screenshot(path=str(artifacts / "browser_url_built_ahead.png"))
    finally:
        page.close()
    log = demo_server.log.read_text()
    assert log.count("this session takes what was built ahead") == taken + 1
    assert any(t.startswith("sample 2: ") for t in titles), titles  # the power curve
    matrix = "sample 2, head 3, layer encoder.2.attention:\nsoftmax"
    assert any(t.startswith(matrix) for t in titles), titles
    assert any(t.startswith("weights of query 120 (head 3)") for t in titles), titles
    assert any(t.startswith("context of query 120, head 3") for t in titles), titles
    weights = attnpanel.demo().weights.isel(batch=2, head=3).values  # what the model computed
    shown = np.array(image["values"], dtype=float).reshape(image["shape"])
    expected = np.where(np.eye(480, dtype=bool), np.nan, weights)  # the diagonal mask: black
    numerics.assert_same_numbers(shown, expected)  # the model's float32 weights, drawn


TOGGLES_JS = """() => attn.views().find((v) => v.model && v.model.labels
    && v.model.type.endsWith('CheckboxButtonGroup') && v.model.labels[0] === 'head 0')
    .model.active"""
OFF_JS = "() => new URLSearchParams(window.location.search).get('off')"


def test_a_link_keeps_the_heads_switched_off(browser, artifacts, demo_url):
    """``?off=2,5`` reopens with heads 2 and 5 off (the toggles, the model's prediction);
    a toggle writes the URL; a link naming a head the layer lacks is refused by name."""
    plot = 'attn.plot("the model\'s prediction")'
    with opened(browser, demo_url + "?sample=1&off=2,5") as (page, console):
        assert page.evaluate(TOGGLES_JS) == [0, 1, 3, 4, 6, 7]
        page.wait_for_function(f"{plot}.model.title.text.includes('heads 2, 5 switched off')")
        page.get_by_role("button", name="head 3", exact=True).click()
        page.wait_for_function(f"() => ({OFF_JS})() === '2,3,5'")
        assert parse_qs(urlparse(page.url).query)["off"] == ["2,3,5"]
        page.get_by_role("button", name="head 3", exact=True).click()
        page.get_by_role("button", name="head 2", exact=True).click()
        page.get_by_role("button", name="head 5", exact=True).click()
        page.wait_for_function(f"() => ({OFF_JS})() === null")  # every head on
        assert parse_qs(urlparse(page.url).query)["sample"] == ["1"]
        shot(page, artifacts, "heads_off_from_the_link")
        assert [m for m in console if m[0] in ("error", "pageerror")] == []
    with opened(browser, demo_url + "?off=9") as (page, _console):
        page.wait_for_function(  # a notification that names the problem
            "() => document.body.innerText.includes("
            "'reading the link failed: off=9: 9 is not a head of this layer (heads 0 to 7)')",
            timeout=30_000,
        )
        assert page.evaluate(TOGGLES_JS) == list(range(8))


RANGE_JS = """() => { const m = attn.plot('sample ').model; const xs = [];
  for (const r of m.renderers) { const d = r.data_source.data;
    for (const k of ['time', 'left', 'right']) { const c = d[k];
      if (r.visible && c && c.length) xs.push(...Array.from(c).filter(Number.isFinite)); } }
  return {title: m.title.text, start: m.x_range.start, end: m.x_range.end,
          lo: Math.min(...xs), hi: Math.max(...xs)}; }"""


def test_a_sample_changed_by_the_keyboard_keeps_no_range_of_the_sample_before(
    browser, artifacts, demo_url
):
    """Sample slider focused, ArrowRight: the power curve's time axis spans the new
    sample's hours (its data and Bokeh's 10 % padding), not the two samples' (a legend
    swatch drawn at the first sample's first time kept 05:11 to 22:47 for 14:00 to 22:00)."""
    with opened(browser, demo_url) as (page, console):
        for sample in (1, 2):
            page.locator(".noUi-handle").first.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function(
                f"() => attn.plot('sample ').model.title.text.startsWith('sample {sample}:')"
            )
            page.wait_for_timeout(500)  # Bokeh's ranges follow on its next render
            found = page.evaluate(RANGE_JS)
            span = found["hi"] - found["lo"]
            assert found["lo"] - 0.06 * span <= found["start"] <= found["lo"], found
            assert found["hi"] <= found["end"] <= found["hi"] + 0.06 * span, found
        legend = page.evaluate(
            "() => attn.plot('sample ').model.center.concat(attn.plot('sample ').model.right)"
            ".find((m) => m.type === 'Legend').items.map((i) => i.label.value)"
        )
        assert "selected query's weights" in legend
        shot(page, artifacts, "sample_by_keyboard")
        assert [m for m in console if m[0] in ("error", "pageerror")] == []


LEGEND_JS = """() => { const m = attn.plot('sample ').model;
  const legend = m.center.concat(m.right).find((x) => x.type === 'Legend');
  return {end: m.y_range.end,
          items: legend.items.filter((i) => i.visible).map((i) => i.label.value)};
}"""
HIDE_FROM_LEGEND_JS = """(label) => { const m = attn.plot('sample ').model;
  const legend = m.center.concat(m.right).find((x) => x.type === 'Legend');
  legend.items.find((i) => i.label.value === label).renderers[0].visible = false; }"""


def test_the_legend_offers_only_curves_of_the_shown_sample_and_refits_the_axis(
    browser, artifacts, demo_url
):
    """Appliance power switched off, another sample: the legend offered the appliances'
    curves still, and showing one drew the first sample's (sample 0's fridge beside sample
    3's power). They now leave the legend with their curves. A curve hidden from the legend
    refits the power axis (shown again, one was drawn beyond an axis fitted without it)."""
    with opened(browser, demo_url) as (page, console):
        assert "fridge" in page.evaluate(LEGEND_JS)["items"]
        click_checkbox(page, "show appliance power")
        page.wait_for_function(f"() => !({LEGEND_JS})().items.includes('fridge')")
        page.evaluate("attn.widget('Sample').value = 3")
        page.wait_for_function("() => attn.plot('sample ').model.title.text.startsWith('sample 3')")
        page.wait_for_timeout(500)
        assert page.evaluate(LEGEND_JS)["items"] == ["selected query's weights", "aggregate power"]
        click_checkbox(page, "show appliance power")
        page.wait_for_function(f"() => ({LEGEND_JS})().items.includes('fridge')")
        page.wait_for_timeout(500)
        before = page.evaluate(LEGEND_JS)["end"]
        page.evaluate(HIDE_FROM_LEGEND_JS, "aggregate power")  # what the legend's click does
        page.wait_for_function(f"(before) => ({LEGEND_JS})().end < 0.95 * before", arg=before)
        shot(page, artifacts, "legend_refits")
        assert [m for m in console if m[0] in ("error", "pageerror")] == []


def test_the_first_page_after_the_server_starts_says_what_it_builds(browser, artifacts):
    """A fresh server's first page shows at once that it builds the demo, step by step
    (it was a blank tab for the 10 to 15 s the demo takes), then the explorer with the
    link's selection; the next page opens directly."""
    with serve() as (url, _proc):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(url + "?sample=2", timeout=180_000)
            words = page.get_by_text("Building the demo: the trace of 32 held-out windows")
            words.first.wait_for(timeout=60_000)
            page.screenshot(path=str(artifacts / "browser_cold_start_building.png"))
            page.wait_for_function("() => window.Bokeh && Object.keys(Bokeh.index).length > 0")
            page.evaluate(HELPERS_JS)
            page.wait_for_function(RENDERED_JS, timeout=180_000)
            titles = page.evaluate("attn.plots().map((v) => v.model.title.text)")
            assert any(t.startswith("sample 2, head 0, layer encoder.2.attention") for t in titles)
        finally:
            page.close()
        # every later page arrives with the explorer in its first document (a page after
        # the first showed the loading page too, ~1.2 s more, until apps/main.py stopped
        # looking for Panel's cache keys, which are tuples, by their names)
        second = browser.new_page(viewport={"width": 1600, "height": 1300})
        try:
            second.goto(url, timeout=180_000)
            second.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0")
            figures = second.evaluate(
                "[...Bokeh.documents[0].all_models].filter((m) => m.type === 'Figure').length"
            )
            assert second.get_by_text("Building the demo").count() == 0
        finally:
            second.close()
        assert figures > 5


# the notifications on the page (Panel's, in their shadow roots)
TOASTS_JS = """() => { const out = []; const walk = (n) => { if (!n) return;
  if (n.className && String(n.className).includes('notyf__toast')) out.push(n.innerText);
  if (n.shadowRoot) walk(n.shadowRoot); for (const c of n.children || []) walk(c); };
  walk(document.body); return out; }"""


def test_a_link_with_a_refused_value_opens_with_the_rest_and_says_so(browser, demo_url):
    """``?sample=2&corrupted=nonsense``: Panel dropped every value of the link (the page
    opened on sample 0) and said nothing. Now the rest holds and the refused one is named
    with its choices, once (the browser handing the link over again as it connected had
    it named twice), and the URL gives what the page shows (it kept the refused value: a
    copied link reopened on the refusal); a valid corrupted input (another sample, sample
    5) is taken."""
    link = "?sample=2&corrupted=nonsense&patching=true"
    with opened(browser, demo_url + link) as (page, console):
        page.wait_for_function(
            "() => document.body.innerText.includes('reading the link failed: "
            "corrupted=nonsense: not one of without the fridge')",
            timeout=30_000,
        )
        title = page.evaluate(
            "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text)).model.title.text"
        )
        assert title.startswith("sample 2, head 0"), title
        assert parse_qs(urlparse(page.url).query)["sample"] == ["2"]
        assert [m for m in console if m[0] == "pageerror"] == []
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:  # read at once: a notification goes after 8 s
        page.goto(demo_url + "?sample=99&head=3", timeout=180_000)
        page.wait_for_function(
            "() => document.body.innerText.includes("
            "'reading the link failed: sample=99: outside 0 to 31')",
            timeout=60_000,
        )
        page.wait_for_function("() => new URLSearchParams(location.search).get('sample') === '0'")
        assert parse_qs(urlparse(page.url).query)["head"] == ["3"]
        page.wait_for_timeout(1500)  # a second notification would have come by now
        assert len([t for t in page.evaluate(TOASTS_JS) if "reading the link" in t]) == 1
    finally:
        page.close()
    link = "?sample=3&corrupted=another+sample&other=5&patching=true"
    with opened(browser, demo_url + link) as (page, _console):
        page.wait_for_function(
            "() => attn.plots().some((v) => v.model.title.text.replace(/\\s+/g, ' ')"
            ".startsWith('output patched into sample 5'))",
            timeout=120_000,
        )
        assert page.evaluate("attn.widget('corrupted input').value") == "another sample"
        assert "reading the link failed" not in page.evaluate("document.body.innerText")


def test_a_server_started_warm_opens_its_first_page_as_any_other(demo_server):
    """``panel serve apps/main.py --warm`` (the README's command) builds the demo and the
    first explorer as the server starts: the first visitor's document arrives with the
    explorer in it (a cold server's arrives with its loading page), showing the link's
    selection and the model's own weights (the page ``demo_server`` opened first)."""
    first = demo_server.first
    assert first["figures"] > 5  # the explorer's plots, in the first document
    assert any(t.startswith("sample 1, head 2, layer encoder.2") for t in first["titles"])
    weights = attnpanel.demo().weights.isel(batch=1, head=2).values
    image = first["image"]
    shown = np.array(image["values"], dtype=float).reshape(image["shape"])
    numerics.assert_same_numbers(shown, np.where(np.eye(480, dtype=bool), np.nan, weights))

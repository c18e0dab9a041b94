"""The explorer served on a real MiniLM trace (``apps/text.py``) in headless Chromium.

A person clicks a token of the sentence and sees its row of the matrix boxed, switches
the layer selector and sees the matrix change, and clicks a map of the model view to open
it. Chromium missing makes the ``browser`` fixture fail, never skip.
"""

from __future__ import annotations

import re

import pytest
from minilm import TOKENS
from served_app import PAGE_TEXT_JS, ROOT, open_app, opened, page_widths, serve, shot

APP = ROOT / "apps" / "text.py"
STRIP = "sample 0: tokens"
GREEN = (57, 255, 20)  # views.HIGHLIGHT


def matrix_js() -> str:
    return "attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"


LOADING = re.compile(r"Building the text model: (MiniLM and its tokenizer|the attention of)")


@pytest.fixture(scope="module")
def first_visit(browser, artifacts):
    """The first page of a server started without ``--warm``: what it showed while the model
    loaded (its words and a screenshot), then the page and its console."""
    seen = {}

    def loading(page):
        words = page.get_by_text(LOADING).first
        words.wait_for(timeout=120_000)
        seen["words"] = words.inner_text()
        page.screenshot(path=str(artifacts / "browser_text_loading.png"))

    with serve(APP) as (url, _proc):
        console: list = []
        page = open_app(browser, url, console, loading=loading)
        try:
            yield page, console, seen
        finally:
            page.close()


@pytest.fixture(scope="module")
def app(first_visit):
    page, console, _seen = first_visit
    return page, console


def test_the_first_visit_shows_the_model_loading_step_by_step(first_visit):
    """The text page's first visit was a blank tab for ~21 s: it now shows what it builds,
    step by step, then the explorer in the same page."""
    page, console, seen = first_visit
    assert LOADING.match(seen["words"]), seen
    assert page.get_by_text("Building the text model").count() == 0  # the explorer replaced it
    assert [m for m in console if m[0] == "pageerror"] == []


def matrix_hash(page) -> int:
    return page.evaluate(f"attn.hash({matrix_js()})")


def renderer_data(page, plot_js: str, glyph: str, line_color: str | None = None) -> list:
    """The data sources of a plot's renderers with a given glyph type (and line colour)."""
    return page.evaluate(
        f"""(() => {{ const pv = {plot_js};
             return [...pv.renderer_views.values()]
               .filter((rv) => rv.model.glyph && rv.model.glyph.type === '{glyph}')
               .filter((rv) => {
            "true" if line_color is None else f"rv.model.glyph.line_color.value === '{line_color}'"
        })
               .map((rv) => {{ const d = rv.model.data_source.data; const out = {{}};
                              for (const k of Object.keys(d)) out[k] = Array.from(d[k]);
                              return out; }}); }})()"""
    )


SHOWN_JS = (
    "(t) => { const w = attn.widget(t); const o = w.options.find((o) => "
    "(Array.isArray(o) ? o[0] : o) === w.value); return Array.isArray(o) ? o[1] : o; }"
)


def shown(page, title: str) -> str:
    """The label a Select widget shows (its value may be an index)."""
    return page.evaluate(SHOWN_JS, title)


def choose_layer(page, prefix: str) -> None:
    """Pick the Layer option whose label starts with ``prefix``, as a user would."""
    page.evaluate(
        "(p) => { const w = attn.widget('Layer'); const o = w.options.find((o) => "
        "(Array.isArray(o) ? o[1] : o).startsWith(p)); w.value = Array.isArray(o) ? o[0] : o; }",
        prefix,
    )


def test_text_page_shows_tokens_layers_and_model_view(app, artifacts):
    page, console = app
    shot(page, artifacts, "text_loaded")
    assert [m for m in console if m[0] in ("error", "pageerror")] == []
    labels = renderer_data(page, f"attn.plot('{STRIP}')", "Text")
    assert labels[0]["token"] == TOKENS
    ticks = page.evaluate(f"[...{matrix_js()}.model.below[0].major_label_overrides.entries()]")
    assert [label for _, label in sorted(ticks)] == TOKENS
    titles = page.evaluate("attn.plots().map((v) => v.model.title.text)")
    assert any(" ".join(t.split()).startswith("model view, sample 0: 6 layers x 12 heads")
               for t in titles)  # fmt: skip
    tiles = page.evaluate(
        "attn.plot('head maps').model.renderers.map((r) => r.name)"
        ".filter((n) => n && n.startsWith('head'))"
    )
    assert tiles == [f"head {h}" for h in range(12)]  # MiniLM's 12 heads, one figure
    assert page.get_by_text("Layer", exact=True).first.is_visible()
    assert shown(page, "Layer") == "0: encoder.layer.0.attention.self"


def test_click_token_highlights_its_row(app, artifacts):
    page, _ = app
    before = matrix_hash(page)
    # "cat" is position 2 of 13 on an axis from -0.5 to 12.5
    point = page.evaluate(f"attn.frame_point(attn.plot('{STRIP}'), {2.5 / 13}, 0.5)")
    page.mouse.click(point["x"], point["y"])
    page.wait_for_function("attn.widget('Query').value === 2")
    page.wait_for_function(f"attn.plot('{STRIP}').model.title.text.includes(\"query 2 'cat'\")")
    outline = renderer_data(page, f"attn.plot('{STRIP}')", "Quad", "#39ff14")
    assert outline[0]["left"] == [pytest.approx(1.5)] and outline[0]["right"] == [
        pytest.approx(2.5)
    ]
    row = page.evaluate(
        f"(() => {{ const pv = {matrix_js()}; return [...pv.renderer_views.values()]"
        ".filter((rv) => rv.model.type === 'BoxAnnotation' && rv.model.visible "
        "&& Number.isFinite(rv.model.bottom))"
        ".map((rv) => [rv.model.bottom, rv.model.top]) })()"
    )
    assert row == [[pytest.approx(1.5), pytest.approx(2.5)]]
    page.wait_for_timeout(300)
    # The green outline is painted on the token's left edge, not on its neighbours' boxes.
    edge = page.evaluate(f"attn.rgba_at(attn.plot('{STRIP}'), 1.5, 0.25)")
    assert abs(edge[0] - GREEN[0]) < 60 and edge[1] > 200 and edge[2] < 90, edge
    away = page.evaluate(f"attn.rgba_at(attn.plot('{STRIP}'), 5.5, 0.25)")
    assert away[1] < 200 or away[0] > 150, away
    # The row box is painted over the matrix (its overlay canvas changes).
    page.evaluate(f"(b) => attn.until_changed({matrix_js()}, b)", before)
    shot(page, artifacts, "text_clicked_token")


def test_layer_selector_switches_the_matrix(app, artifacts):
    page, _ = app
    before = matrix_hash(page)
    choose_layer(page, "3: ")
    page.evaluate(f"(b) => attn.until_changed({matrix_js()}, b)", before)
    shown = ", layer encoder.layer.3.attention.self:\\nsoftmax weights"
    page.wait_for_function(f"{matrix_js()}.model.title.text.includes('{shown}')")
    assert matrix_hash(page) != before
    shot(page, artifacts, "text_layer_3")


def test_model_view_click_opens_the_map(app, artifacts):
    page, _ = app
    before = matrix_hash(page)
    # 12 heads across, 6 layers down: the centre of head 7, layer 5
    page.evaluate("attn.plot('model view').el.scrollIntoView()")
    point = page.evaluate(f"attn.frame_point(attn.plot('model view'), {7.5 / 12}, {5.5 / 6})")
    page.mouse.click(point["x"], point["y"])
    page.wait_for_function(f"({SHOWN_JS})('Layer').startsWith('5: ')")
    page.wait_for_function(f"({SHOWN_JS})('Head') === 'head 7'")
    page.evaluate(f"(b) => attn.until_changed({matrix_js()}, b)", before)
    title = page.evaluate(f"{matrix_js()}.model.title.text")
    assert title.startswith("sample 0, head 7, layer encoder.layer.5.attention.self:"), title
    page.wait_for_function(
        "[...attn.plot('model view').renderer_views.values()].some((rv) => rv.model.glyph && "
        "rv.model.glyph.type === 'Quad' && rv.model.data_source.data.left[0] === 6.5 && "
        "rv.model.data_source.data.bottom[0] === 4.5)",
        timeout=10_000,
    )
    page.wait_for_function("attn.plot('weights of query').model.title.text.endsWith('(head 7)')")
    # the matrix the click opened is brought into view (it changed 1,800 px above, unseen)
    page.wait_for_function(
        f"() => {{ const r = {matrix_js()}.el.getBoundingClientRect();"
        " return r.top >= -1 && r.bottom <= window.innerHeight + 1; }",
        timeout=10_000,
    )
    shot(page, artifacts, "text_model_view_click")
    # the link keeps the layer the click opened (it reopened layer 0, head 7)
    page.wait_for_function("() => /[?&]layer=5(&|$)/.test(location.search)")
    assert "head=7" in page.url


def test_a_link_reopens_the_layer_and_takes_the_menus_own_words(app, browser):
    """A link opens the layer it names, takes a menu's label (``stage=raw scores``: it
    opened softmax and said why in the server log only), and writes back the value."""
    page, _ = app
    base = page.url.split("?", 1)[0]
    link = f"{base}?layer=3&head=8&stage=raw+scores&colormap=fire&beside=true"
    with opened(browser, link) as (other, console):
        assert shown(other, "Layer").startswith("3: ")
        assert shown(other, "Head") == "head 8" and shown(other, "Stage") == "raw scores"
        assert other.evaluate("attn.widget('Colormap').value") == "fire"
        other.wait_for_function("() => /[?&]stage=raw(&|$)/.test(location.search)")
        title = other.evaluate(f"{matrix_js()}.model.title.text")
        assert title.startswith("sample 0, head 8, layer encoder.layer.3."), title
        assert not [m for m in console if m[0] in ("error", "pageerror")]


def test_the_text_page_fits_1280_and_1600_pixels(app):
    """12 heads, 6 layers and the layer selector: no horizontal scroll (once 1401 px)."""
    page, _ = app
    assert page_widths(page) == {1280: 1280, 1600: 1600}


# The labels of a plot's x axis written in place of its numbers (a Map in BokehJS).
X_LABELS_JS = """
(prefix) => { const axis = attn.plot(prefix).model.below[0];
  const found = axis.major_label_overrides;
  return found instanceof Map ? [...found.values()] : Object.values(found ?? {}); }
"""
# Each option of a Select, and whether its text fits the menu (measured in its own font).
MENU_FITS_JS = """
(title) => { const view = attn.views().find((v) => v.model && v.model.title === title);
  const select = view.el.shadowRoot.querySelector("select");
  const style = getComputedStyle(select);
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = `${style.fontSize} ${style.fontFamily}`;
  const room = select.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return [...select.options].map((o) => [o.text, ctx.measureText(o.text).width <= room]); }
"""


def test_the_text_pages_words_fit_and_its_positions_are_tokens(app):
    """The heading names the model's folder, not this machine's path; the Layer menu shows
    each whole layer name (it cut ``3: encoder.layer.3.attention.s``); the rollout and the
    query's weights name their positions by token, as the matrix does (they read 0-12)."""
    page, _ = app
    heading = page.evaluate(PAGE_TEXT_JS).split("Layer")[0]
    assert "attnpanel · BertModel (…/" in heading and "site-packages" not in heading
    fits = page.evaluate(MENU_FITS_JS, "Layer")
    assert len(fits) == 6 and all(fit for _, fit in fits), fits
    for prefix in ("rollout through", "weights of query"):
        labels = page.evaluate(X_LABELS_JS, prefix)
        assert labels[:3] == list(TOKENS[:3]), (prefix, labels)

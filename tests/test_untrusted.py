"""Untrusted text is text: a capture whose source, tokens, layer name and attributes are
scripts (``tests/hostile.py``) is shown as written and runs nothing, in the served app,
the offline export and the command line.

The browser checks run in headless Chromium: every payload calls ``alert``, and a dialog
is recorded (and dismissed), so a failure names the payload that ran.
"""

from __future__ import annotations

import pytest
from hostile import LAYER, NOTE, SOURCE, TOKENS, hostile_capture
from served_app import HELPERS_JS, PAGE_TEXT_JS, ROOT, opened, serve, shot

import attnpanel
from attnpanel.app.base import MISSING_RESOURCES
from attnpanel.app.explore import explore
from attnpanel.app.explorer import notify_errors
from attnpanel.cli import main
from attnpanel.util import untrusted

APP = ROOT / "tests" / "hostile_app.py"


def test_markup_shows_markup_characters_as_written():
    text = untrusted.markup("<img src=x onerror=alert(1)> [a](javascript:x) *b* a&b 'q\"")
    assert "<" not in text and ">" not in text and '"' not in text and "'" not in text
    assert "&lt;img src=x onerror=alert\\(1\\)&gt;" in text
    assert "\\[a\\]\\(javascript:x\\)" in text and "\\*b\\*" in text and "a&amp;b" in text


def test_terminal_shows_control_characters_as_escapes():
    text = untrusted.terminal("ok\x1b]0;pwned\x07 \u202eevil\tend\nnext")
    assert text == "ok\\x1b]0;pwned\\x07 \\u202eevil\tend\nnext"


def test_info_prints_no_control_character_of_a_trace(tmp_path, capsys):
    path = attnpanel.save(hostile_capture(), tmp_path / "hostile.nc")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert untrusted.terminal(NOTE) in out  # shown, as escapes
    assert LAYER in out and TOKENS[0] in out  # a terminal runs no HTML: shown as written


@pytest.fixture(scope="module")
def served(browser):
    with serve(APP) as (url, _proc), opened(browser, url) as page_console:
        yield page_console


def test_served_app_runs_no_script_and_shows_the_text(served, artifacts):
    page, console = served
    page.wait_for_timeout(1500)  # an onerror fires once the broken image has failed
    shot(page, artifacts, "hostile_served_1600")
    text = page.evaluate(PAGE_TEXT_JS)
    assert [m for m in console if m[0] == "dialog"] == []
    assert "<img src=x onerror=alert(1)><script>alert(2)</script>" in text  # the header
    assert "**bold** [a](javascript:alert(3))" in text  # Markdown shown, not rendered
    assert [m for m in console if m[0] == "pageerror"] == []


def test_error_notifications_show_the_message_as_text(monkeypatch):
    """A failing callback's message (which may quote a layer name or a token) is escaped."""
    import panel as pn

    shown = []

    class Notifications:
        def error(self, message, duration):
            shown.append(message)

    monkeypatch.setattr(type(pn.state), "notifications", property(lambda self: Notifications()))
    notify_errors(ValueError(f"no layer named {LAYER!r}"))
    assert shown == [untrusted.html_text(f"ValueError: no layer named {LAYER!r}")]
    assert "<svg" not in shown[0]


def test_export_runs_no_script_and_shows_the_text(browser, tmp_path, artifacts):
    path = explore(hostile_capture()).save(tmp_path / "hostile.html")
    html = path.read_text()
    assert "<img src=x" not in html and "<script>alert" not in html
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        page.goto(path.as_uri())
        page.wait_for_function(
            "() => window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length > 0"
        )
        page.evaluate(HELPERS_JS)
        page.wait_for_timeout(1500)
        text = page.evaluate(PAGE_TEXT_JS)
        page.screenshot(path=str(artifacts / "browser_hostile_export_1280.png"), full_page=True)
    finally:
        page.close()
    assert dialogs == []
    assert SOURCE.splitlines()[0][:80] in text


def test_notebook_output_keeps_its_script_whole():
    """Panel inlines the document's JSON in a <script> of the cell's HTML: a token
    ``</script>`` must not end it (tests/test_notebook.py shows it in JupyterLab)."""
    import panel as pn

    pn.extension()
    data, _metadata = explore(hostile_capture())._repr_mimebundle_()
    html = data["text/html"]
    assert html.startswith(MISSING_RESOURCES)  # a note of our own, then Panel's output
    html = html.removeprefix(MISSING_RESOURCES)
    assert html.lower().count("</script") == 1 and html.endswith("</script>")
    assert "<script>alert(5)<\\/script>" in html  # the token, as a JavaScript string


def test_a_notebook_output_says_what_is_missing_until_the_explorer_draws(browser, tmp_path):
    """Where Panel's JavaScript never arrives (pn.extension() without inline=True in an
    offline JupyterLab) the output says so; where it does, the note goes as soon as BokehJS
    holds a document (tests/test_notebook.py: gone in JupyterLab)."""
    page = browser.new_page()
    try:
        missing = tmp_path / "missing.html"
        missing.write_text(f"<!doctype html><html><body>{MISSING_RESOURCES}</body></html>")
        page.goto(missing.as_uri())
        page.wait_for_timeout(1000)
        note = page.locator(".attnpanel-waiting")
        assert note.count() == 1 and "pn.extension(inline=True)" in note.inner_text()
        arrives = "<script>setTimeout(() => { window.Bokeh = {index: {one: 1}}; }, 300)</script>"
        drawn = tmp_path / "drawn.html"
        drawn.write_text(f"<!doctype html><html><body>{MISSING_RESOURCES}{arrives}</body></html>")
        page.goto(drawn.as_uri())
        page.wait_for_function("() => !document.querySelector('.attnpanel-waiting')", timeout=5000)
    finally:
        page.close()


def test_a_heading_names_the_models_folder_not_the_machines_path():
    from attnpanel.util.untrusted import page_title, short_paths

    long = "BertModel (/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/minilm/model)"
    assert short_paths(long) == "BertModel (…/minilm/model)"
    assert short_paths("a (C:\\Users\\me\\models\\bert\\model)") == "a (…/bert/model)"
    for kept in ("NILMFormer demo (nilmformer.pt)", "x /a/b", "rel/one/two/three"):
        assert short_paths(kept) == kept
    assert page_title(long) == "attnpanel · BertModel (…/minilm/model)"

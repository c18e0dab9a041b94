"""Text that comes from a trace or a model, made safe for where it is shown.

A trace file is something people mail each other: its attributes, tokens, coordinates
and layer names are untrusted input. Wherever such a string reaches markup it is escaped:
:func:`markup` where it stands alone in a Markdown pane (shown exactly as written),
:func:`html_text` where it is quoted in a message of ours that keeps its Markdown (an
alert) or in HTML (a notification); wherever it reaches a terminal
it goes through :func:`terminal`, so that it cannot move the cursor, retitle the window
or hide text. Canvas text (plot titles, axis ticks) and Bokeh's own tooltips and widget
options are drawn as text by Bokeh and need neither.
"""

from __future__ import annotations

import html
import re
import unicodedata

# Markdown punctuation that could start emphasis, a link, a heading, a list or a table.
# The HTML characters are left to html.escape, which runs after this.
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+\-.!|~])")


def markup(value) -> str:
    """``value`` as text for a Markdown or HTML pane: shown as written, never as markup."""
    return html.escape(_MARKDOWN_PUNCTUATION.sub(r"\\\1", str(value)), quote=True)


def html_text(value) -> str:
    """``value`` for a Markdown pane, its HTML escaped but its Markdown kept: for messages
    of our own that may quote a trace's strings (Markdown renders no script, and Panel's
    renderer refuses ``javascript:`` links)."""
    return html.escape(str(value), quote=True)


def terminal(value) -> str:
    """``value`` as text for a terminal: control and format characters shown as escapes."""
    return "".join(
        char
        if char in "\n\t" or unicodedata.category(char)[0] != "C"
        else char.encode("unicode_escape").decode("ascii")
        for char in str(value)
    )


# Sequences that end (or re-enter) an inline <script> element whatever the quoting.
_SCRIPT_END = re.compile(r"</(?=script)", re.IGNORECASE)
_INLINE_SCRIPT = '<script type="application/javascript">'


def notebook_bundle(bundle):
    """A notebook output bundle whose inline script no string of the document can end.

    Panel writes the document's JSON into a ``<script>`` element of the cell's HTML output
    without escaping it, so a token ``</script>`` ends the element early and the rest of
    the JSON, with any ``<img onerror=...>`` in it, is parsed as HTML. Inside JavaScript
    strings ``<\\/`` reads as ``</`` and ``<\\!--`` as ``<!--``: escaping them changes
    nothing the script reads.
    """
    if not bundle:
        return bundle
    data, metadata = bundle if isinstance(bundle, tuple) else (bundle, None)
    html_text = data.get("text/html", "")
    head, found, script = html_text.partition(_INLINE_SCRIPT)
    if found and script.endswith("</script>"):
        body = _SCRIPT_END.sub("<\\/", script[: -len("</script>")]).replace("<!--", "<\\!--")
        data = {**data, "text/html": f"{head}{found}{body}</script>"}
    return data if metadata is None else (data, metadata)


def shortened(text: str, most: int) -> str:
    """``text`` cut to at most ``most`` characters at a word's end, "…" where cut (a
    title is never cut mid-word or after a dangling comma)."""
    if len(text) <= most:
        return text
    cut = text[: most - 1].rsplit(" ", 1)[0].rstrip(" ,;:·")
    return f"{cut}…"


_LONG_PATH = re.compile(r"(?:[A-Za-z]:)?[/\\](?:[^\s()/\\]+[/\\]){2,}([^\s()/\\]+[/\\][^\s()/\\]+)")


def short_paths(text: str) -> str:
    """``text`` with each long file path cut to its last two parts (``…/minilm/model``): a
    heading names the model's folder, not the machine's layout."""
    return _LONG_PATH.sub(lambda found: "…/" + found.group(1).replace("\\", "/"), text)


def page_title(source: str, most: int = 100) -> str:
    """A page's title from a capture's ``source``: its first line, long paths cut, cut at a
    word."""
    first = short_paths(str(source).splitlines()[0]) if str(source).strip() else ""
    return "attnpanel" + (f" · {shortened(first, most)}" if first else "")

"""What the browser tests of the maps sent ahead share: the page's websocket frames, the
maps its cache holds, and what its map shows (which layer, which pixels).

A change the browser draws from its cache must send no image: no frame from the server
names the map's own source, and the browser sends the widget's value, no data.
"""

from __future__ import annotations

import json

from served_app import HELD_JS, opened

DATA_EVENTS = ("ColumnDataChanged", "ColumnsStreamed", "ColumnsPatched")
CACHED_JS = f"() => ({HELD_JS})('__cached')"  # the maps the page holds


def layers_js(matrix_js: str) -> str:
    """A page function giving the map's two image layers as they stand: the server's
    (main) and the browser's (cached levels), which one shows, its title, and a hash of
    what a person sees (the canvas over the page's white: a transparent edge's alpha
    varies with how often it was painted). ``matrix_js``: a function finding the map's
    plot view."""
    return f"""
() => {{
  const pv = ({matrix_js})();
  const images = pv.model.renderers.filter((r) => r.glyph && r.glyph.type === "Image");
  const level = images.find((r) => r.name === "cached levels");
  const main = images.find((r) => r !== level);
  const {{ data }} = attn.pixels(pv);
  let seen = 2166136261 >>> 0;
  for (let i = 0; i < data.length; i += 4) {{
    const alpha = data[i + 3] / 255;
    for (let c = 0; c < 3; c++) {{
      const value = Math.round(data[i + c] * alpha + 255 * (1 - alpha));
      seen = Math.imul(seen ^ value, 16777619) >>> 0;
    }}
  }}
  return {{ main_source: main.data_source.id, main: main.visible, level: level.visible,
           title: pv.model.title.text, hash: attn.hash(pv), seen }};
}}
"""


class Frames:
    """Every websocket frame of a page, both ways (text frames only: a Bokeh message's
    header and content are text, its buffers binary)."""

    def __init__(self):
        self.received: list = []
        self.sent: list = []

    def listen(self, page) -> None:
        def on_socket(ws):
            ws.on("framereceived", lambda f: self.received.append(f))
            ws.on("framesent", lambda f: self.sent.append(f))

        page.on("websocket", on_socket)

    def mark(self) -> tuple[int, int]:
        return len(self.received), len(self.sent)

    def named(self, since: int, model_id: str) -> list:
        """The server's text frames since ``since`` that name the model ``model_id``."""
        name = f'"id":"{model_id}"'
        return [f for f in self.received[since:] if isinstance(f, str) and name in f]

    def events(self, since: int) -> list[dict]:
        """The document events the browser sent since ``since``."""
        return [
            event
            for f in self.sent[since:]
            if isinstance(f, str) and f.startswith('{"events"')
            for event in json.loads(f)["events"]
        ]


def sent_no_data(events: list[dict]) -> bool:
    """Whether the browser's events hold one widget value and no data (Bokeh's own layout
    and ranges aside)."""
    changed = [event.get("attr", event["kind"]) for event in events]
    return changed.count("value") == 1 and not {"data", *DATA_EVENTS} & set(changed)


def idle_cache(page, least: int) -> int:
    """Wait until the page holds at least ``least`` maps and no more arrive for 0.6 s."""
    page.wait_for_function(f"() => ({CACHED_JS})() >= {least}", timeout=60_000)
    count = page.evaluate(CACHED_JS)
    while True:
        page.wait_for_timeout(600)
        now = page.evaluate(CACHED_JS)
        if now == count:
            return count
        count = now


def assert_a_link_draws_the_same(browser, url: str, layers: str, shown: dict, what) -> None:
    """A page opened on ``url`` (the state a change reached) shows the server's own image:
    the same title, and the same pixels as ``shown``, the browser's copy drawn after the
    change (``layers``: a :func:`layers_js` function)."""
    with opened(browser, url) as (page, console):
        exact = page.evaluate(layers)
        assert exact["main"] and not exact["level"], what
        assert exact["title"] == shown["title"], what
        assert exact["seen"] == shown["seen"], what
        assert [m for m in console if m[0] in ("error", "pageerror")] == []


def browser_drew(page, frames: Frames, matrix_js: str, change: tuple, url: tuple) -> dict:
    """Make ``change`` (a widget's title, the value its page model takes); assert the
    browser drew the map from its cache (no frame from the server names the map's source,
    no data sent) and the URL followed (``url``: its argument and value). Returns the map's
    layers as shown (:func:`layers_js`)."""
    layers = layers_js(matrix_js)
    received, sent = frames.mark()
    before = page.evaluate(layers)
    title, value = change
    page.evaluate(f"attn.widget({title!r}).value = {value!r}")
    page.evaluate(f"(h) => attn.until_changed(({matrix_js})(), h)", before["hash"])
    argument, wanted = url
    page.wait_for_function(
        f"() => new URLSearchParams(location.search).get({argument!r}) === {wanted!r}"
    )
    page.wait_for_timeout(500)  # what the server sends for the other views lands
    after = page.evaluate(layers)
    assert after["level"] and not after["main"], (change, after)
    # no image from the server: nothing it sent names the map's source
    assert frames.named(received, after["main_source"]) == [], change
    # the browser sent the change, and no data (Bokeh's own layout and ranges aside)
    events = frames.events(sent)
    assert sent_no_data(events), (change, events)
    return after

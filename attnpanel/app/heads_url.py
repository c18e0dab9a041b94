"""The heads switched off, in the page URL: ``?off=2,5`` (absent while every head is on).

The state's ``enabled_heads`` stays the one truth; this mirrors its complement in the URL
both ways, so a copied link reopens with the same heads off. A link naming a head the layer
does not have (or no head number at all) is refused by name (a notification and the state's
``last_error``) and the heads stay as they were.
"""

from __future__ import annotations

from urllib.parse import urlencode

from attnpanel.app.scheduler import report
from attnpanel.app.state import ExplorerState

KEY = "off"


class HeadsOffInUrl:
    """Mirror ``state.enabled_heads`` as the URL's ``off`` argument (Panel's ``Location``)."""

    def __init__(self, state: ExplorerState, location, later=None):
        # ``later(callback, *args)``: once the page is loaded; a notification sent while it
        # is being built never shows
        self.state, self.location = state, location
        self.later = later or (lambda callback, *args: callback(*args))

    def start(self) -> None:
        """Read the link's ``off`` into the state, then follow the state."""
        given = self.location.query_params.get(KEY)
        if given not in (None, ""):
            self.apply(str(given))
        self.state.param.watch(self.write, "enabled_heads")
        self.write()

    def apply(self, text: str) -> None:
        """Switch off the heads ``text`` names (``"2,5"``)."""
        heads = list(self.state.param.enabled_heads.objects)
        try:
            off = {int(part) for part in text.split(",") if part.strip()}
        except ValueError:
            off = None
        wrong = None if off is None else sorted(off - set(heads))
        if off is None or wrong:
            named = text if off is None else ", ".join(map(str, wrong))
            last = len(heads) - 1
            message = f"off={text}: {named} is not a head of this layer (heads 0 to {last})"
            self.later(report, self.state, ValueError(message), "reading the link")
            return
        self.state.enabled_heads = [h for h in heads if h not in off]

    def write(self, *_events) -> None:
        """The URL's ``off``: the heads not enabled, or no ``off`` at all."""
        heads = self.state.param.enabled_heads.objects
        off = [h for h in heads if h not in set(self.state.enabled_heads)]
        query = {k: v for k, v in self.location.query_params.items() if k != KEY}
        if off:
            query[KEY] = ",".join(map(str, off))
        search = "?" + urlencode(query) if query else ""
        if search != self.location.search:
            self.location.search = search

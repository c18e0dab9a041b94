"""What an explorer drew into its Bokeh models, read through its public engine."""

from __future__ import annotations

from attnpanel.render.tables import shown_html


def handles(explorer, pane: str, kind: str, group: str = "") -> dict:
    """The Bokeh models of the first layer of ``kind`` (and ``group``) drawn in ``pane``."""
    found = explorer.engine.plots(pane)
    key = next(k for k in found if k.kind == kind and (not group or k.group == group))
    return found[key][0]


def shown_matrix(explorer):
    """The attention matrix's image as the page holds it (rows by query)."""
    return explorer.drawn("matrix", "Attention")


def table_rows(explorer, pane: str) -> list[dict]:
    """The rows of the HTML table drawn in ``pane``, as the page shows them (header -> text)."""
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self._cell = [], None

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append([])
            elif tag in ("td", "th"):
                self._cell = ""

        def handle_endtag(self, tag):
            if tag in ("td", "th"):
                self.rows[-1].append(self._cell)
                self._cell = None

        def handle_data(self, data):
            if self._cell is not None:
                self._cell += data

    found = explorer.engine.plots(pane)
    key = next(k for k in found if k.kind == "Table")
    parser = Cells()
    parser.feed(shown_html(found[key][0]["table"]))
    header, *rows = parser.rows
    return [dict(zip(header, row, strict=True)) for row in rows]

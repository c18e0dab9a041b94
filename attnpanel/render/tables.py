"""A view's table on the page: a plain HTML table, its cells escaped, redrawn in place.

A ``DataTable`` (SlickGrid) cost the demo page ~85 ms of the browser's first paint for two
small tables, and ~35 models. Bokeh's ``Div`` re-lays the whole page out on every new
text (its view's ``rerender`` computes the root's layout: ~50 ms on a 2-core machine, for
the head summary after each mask change); Panel's ``HTML`` model writes the new table into
its element and nothing else. Its ``text`` is the HTML escaped once more, as Panel's own
panes send it (the browser decodes it once: a cell's escaped text stays text), with
neither maths nor scripts run.
"""

from __future__ import annotations

from html import escape, unescape

import holoviews as hv
import numpy as np
from bokeh.models import InlineStyleSheet
from panel.models import HTML

TABLE_CSS = """
:host { overflow-y: auto; }
table { border-collapse: collapse; font-size: 13px; }
th { text-align: left; font-weight: 600; border-bottom: 1px solid #bbb; padding: 4px 14px 4px 6px; }
td { padding: 3px 14px 3px 6px; white-space: nowrap; }
td.prose { white-space: normal; min-width: 18em; }
tbody tr:nth-child(odd) { background: #f3f3f3; }
"""


def _cell(value) -> str:
    """A table cell's text: floats with one to three decimals (160.0, 13.6, 0.035)."""
    if isinstance(value, float | np.floating):
        if not np.isfinite(value):
            return "–"
        text = f"{value:.3f}".rstrip("0")
        return text + "0" if text.endswith(".") else text
    return str(value)


NOT_AVAILABLE = "n/a"  # a table cell with no value; its row's WHY column says why
WHY = "why"  # a table column not drawn: the hover (title) of its row's "n/a" cells


PROSE = 48  # a cell of the widest column longer than this wraps (the rest stay on one line)


def _td(value, why: str, wraps: bool = False) -> str:
    if value == NOT_AVAILABLE and why:
        return f'<td title="{escape(why)}">{NOT_AVAILABLE}</td>'
    text = _cell(value)
    if wraps and len(text) > PROSE and " " in text:  # a sentence, within the table's width
        return f'<td class="prose">{escape(text)}</td>'
    return f"<td>{escape(text)}</td>"


def table_html(element: hv.Table) -> str:
    """An ``hv.Table`` as an HTML table; every header and cell escaped (untrusted text); an
    "n/a" cell has its row's :data:`WHY` (a column not drawn) on hover; the long cells of
    the widest column wrap, so that the table keeps to its frame."""
    dims = [d for d in element.dimensions() if d.name != WHY]
    columns = {d.name: element.dimension_values(d) for d in element.dimensions()}
    whys = columns.get(WHY, [""] * len(element))
    widest = max(dims, key=lambda d: max((len(_cell(v)) for v in columns[d.name]), default=0))
    head = "".join(f"<th>{escape(d.pprint_label)}</th>" for d in dims)
    rows = "".join(
        "<tr>" + "".join(_td(columns[d.name][i], str(whys[i]), d is widest) for d in dims) + "</tr>"
        for i in range(len(element))
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def table_model(element: hv.Table, width, height) -> HTML:
    """The page's model of a table (see the module)."""
    model = HTML(
        width=width,
        height=height,
        disable_math=True,
        run_scripts=False,
        stylesheets=[InlineStyleSheet(css=TABLE_CSS)],
    )
    write_table(model, element)
    return model


def write_table(model: HTML, element: hv.Table) -> None:
    """Redraw a table's model with ``element``'s rows."""
    model.text = escape(table_html(element))


def shown_html(model: HTML) -> str:
    """The HTML a table's model shows (what the browser decodes from its ``text``)."""
    return unescape(model.text)

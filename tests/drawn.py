"""What an explorer drew into its Bokeh models, read through its public engine."""

from __future__ import annotations


def handles(explorer, pane: str, kind: str, group: str = "") -> dict:
    """The Bokeh models of the first layer of ``kind`` (and ``group``) drawn in ``pane``."""
    found = explorer.engine.plots(pane)
    key = next(k for k in found if k.kind == kind and (not group or k.group == group))
    return found[key][0]


def shown_matrix(explorer):
    """The attention matrix's image as the page holds it (rows by query)."""
    return explorer.drawn("matrix", "Attention")

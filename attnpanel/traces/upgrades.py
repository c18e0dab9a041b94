"""Traces saved by an older attnpanel, read in today's terms.

Whoever changed a name registers the rule that reads the old one (:func:`register`), as
datashader's backends register themselves: the library's reader applies every rule it
was given (:func:`upgrade`) and knows none of them. The demo registers how its first traces
named their reference series.
"""

from __future__ import annotations

from collections.abc import Callable

import xarray as xr

Upgrade = Callable[[xr.Dataset], xr.Dataset]
_RULES: list[Upgrade] = []


def register(rule: Upgrade) -> Upgrade:
    """Apply ``rule`` to every trace read from now on; return it (a decorator).

    A rule takes a Dataset and returns it in today's names, or unchanged when it does not
    apply.
    """
    if rule not in _RULES:
        _RULES.append(rule)
    return rule


def upgrade(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with every registered rule applied, in the order they were registered."""
    for rule in _RULES:
        ds = rule(ds)
    return ds

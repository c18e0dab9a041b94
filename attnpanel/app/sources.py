"""Where the sections of a virtual trace's page read their numbers: a typed data source.

A dense trace holds its maps; a virtual one computes each from ``q``, ``k`` and its rows'
``lse`` (:mod:`attnpanel.readouts.windows`). :class:`VirtualSource` is that access for one
explorer's selection, shared by the long page's sections (a ``param.ClassSelector`` of
each), so that no section reaches for methods only one explorer kind has.
"""

from __future__ import annotations

from functools import partial

import torch

from attnpanel.app.state import ExplorerState
from attnpanel.readouts import windows
from attnpanel.traces.overviews import Overviews


class VirtualSource:
    """The maps, rows and ``q``/``k`` of a virtual trace for a state's selection.

    Parameters
    ----------
    state : ExplorerState
        The explorer's state: its trace, layers and cache.
    overviews : Overviews
        Where each map's whole view is read (and stored).
    """

    def __init__(self, state: ExplorerState, overviews: Overviews):
        self.state = state
        self.overviews = overviews

    def row_lse(self, sel) -> torch.Tensor:
        """Each row's ``lse`` of the selected sample under the selected mask, ``(1, H, L)``."""
        state = self.state
        return windows.sample_row_lse(state.trace, sel.sample, sel.mask, state.cache, sel.layer)

    def qk(self, sel) -> windows.SampleQK:
        """The selected sample's ``q`` and ``k``, cut from the trace once."""
        return windows.sample_qk(self.state.trace, sel.sample, self.state.cache, sel.layer)

    def virtual_map(self, sel, head: int | None = None) -> windows.VirtualMap:
        """The map of the selection (or of ``head``), for any window."""
        state = self.state
        return windows.VirtualMap(
            state.trace,
            self.overviews,
            sel.sample,
            int(sel.head if head is None else head),
            sel.mask,
            partial(self.row_lse, sel),  # only a window computed from q and k needs it
            None if state.layers is None else sel.layer,
            self.qk(sel),
        )

    def ready(self, sel) -> bool:
        """Whether the selection's map is quick to make: its overview is at hand (one not
        computed yet takes seconds a head at L = 65,536)."""
        return self.overviews.has(self.virtual_map(sel).entry)

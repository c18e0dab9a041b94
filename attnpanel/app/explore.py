"""One entry to the explorer: :func:`explore` picks the kind that fits what it is given.

As hvPlot's ``hvPlotExplorer.from_data`` picks a grid, a dataframe or a geometry explorer,
:func:`explore` picks the dense explorer (:class:`AttentionExplorer`), the explorer of a
virtual trace (:class:`LongExplorer`) or one explorer per group of a DataTree
(:class:`GroupsExplorer`). Adding a kind is a class and one line here.
"""

from __future__ import annotations

from pathlib import Path

import panel as pn
import xarray as xr

from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.groups_explorer import GroupsExplorer
from attnpanel.app.long_explorer import LongExplorer
from attnpanel.traces import io, virtual
from attnpanel.traces.overviews import folder_for


def explore(capture: xr.Dataset | xr.DataTree | str | Path, **params) -> pn.viewable.Viewer:
    """The explorer of a capture: one Dataset, a virtual trace, or every group of a DataTree.

    Parameters
    ----------
    capture : xarray.Dataset, xarray.DataTree, str or pathlib.Path
        What :func:`attnpanel.capture` or :func:`attnpanel.load` returned, or the path of a
        saved trace (``.nc`` or ``.zarr``), read with :func:`attnpanel.load`.
    **params
        Initial explorer parameters (``sample``, ``head``, ``layer`` ...); for a virtual
        trace also ``folder``, where its overviews are stored (for a path, by default the
        folder beside the file).

    Returns
    -------
    AttentionExplorer, LongExplorer or GroupsExplorer

    Examples
    --------
    >>> explorer = attnpanel.explore(attnpanel.capture(model, x))  # doctest: +SKIP
    >>> explorer.servable()  # doctest: +SKIP
    """
    if isinstance(capture, str | Path):
        path = Path(capture)
        capture = io.load(path)
        if isinstance(capture, xr.Dataset) and virtual.is_virtual(capture):
            params.setdefault("folder", folder_for(path))
    if isinstance(capture, xr.DataTree):
        return GroupsExplorer(capture, **params)
    if not isinstance(capture, xr.Dataset):
        raise TypeError(
            "explore() takes a trace (an xarray Dataset or DataTree, as capture() and load() "
            f"return) or the path of a saved one, not {type(capture).__name__}"
        )
    if virtual.is_virtual(capture):
        return LongExplorer(capture, **params)
    return AttentionExplorer(capture, **params)

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
from torch import nn

from attnpanel.app.compare_explorer import CompareExplorer
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.groups_explorer import GroupsExplorer
from attnpanel.app.long_explorer import LongExplorer
from attnpanel.interventions.model_run import ModelRun
from attnpanel.traces import io, virtual
from attnpanel.traces.layers import groups
from attnpanel.traces.overviews import folder_for


def explore(
    capture: xr.Dataset | xr.DataTree | str | Path,
    compare: xr.Dataset | str | Path | None = None,
    **params,
) -> pn.viewable.Viewer:
    """The explorer of a capture: one Dataset, a virtual trace, or every group of a DataTree.

    Parameters
    ----------
    capture : xarray.Dataset, xarray.DataTree, str or pathlib.Path
        What :func:`attnpanel.capture` or :func:`attnpanel.load` returned, or the path of a
        saved trace (``.nc`` or ``.zarr``), read with :func:`attnpanel.load`.
    compare : xarray.Dataset, str or pathlib.Path, optional
        A second capture of the same inputs (two checkpoints of one model ...): the
        comparison page (:class:`CompareExplorer`), A, B and B - A of each head side by
        side and the heads ranked by divergence.
    **params
        Initial explorer parameters (``sample``, ``head``, ``layer`` ...); for a virtual
        trace also ``folder``, where its overviews are stored (for a path, by default the
        folder beside the file). ``model=`` and ``inputs=``: the model the capture was
        taken from and its inputs (a tuple of positional inputs, or a dict of keyword
        inputs), or ``model=ModelRun(...)``: head toggles then switch heads off inside
        the model and the page draws its prediction again.

    Returns
    -------
    AttentionExplorer, LongExplorer, GroupsExplorer or CompareExplorer

    Examples
    --------
    >>> explorer = attnpanel.explore(attnpanel.capture(model, x))  # doctest: +SKIP
    >>> explorer.servable()  # doctest: +SKIP
    """
    if compare is not None:
        return CompareExplorer(capture, compare, **params)
    if isinstance(params.get("survey"), str | Path):
        from attnpanel.surveys.store import SurveyStore

        params["survey"] = SurveyStore(Path(params["survey"])).read().load()
    path = Path(capture) if isinstance(capture, str | Path) else None
    if path is not None:
        capture = io.load(path)
    capture = virtual.densified(capture)  # kept virtual only to be small on disk: dense
    if path is not None and isinstance(capture, xr.Dataset) and virtual.is_virtual(capture):
        params.setdefault("folder", folder_for(path))
    if "model" in params or "inputs" in params:
        params["model"] = model_run(capture, params.pop("model", None), params.pop("inputs", None))
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


def model_run(capture, model, inputs) -> ModelRun | None:
    """``model`` and ``inputs`` as a :class:`ModelRun` of a capture's layers."""
    if model is None or isinstance(model, ModelRun):
        if inputs is not None:
            raise TypeError("inputs= goes with model=, the torch module they feed")
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model= takes a torch.nn.Module or a ModelRun, not {type(model).__name__}")
    if inputs is None:
        raise TypeError("model= needs inputs=: the inputs the capture was taken on")
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    found = groups(capture) if isinstance(capture, xr.Dataset | xr.DataTree) else {}
    names = [
        str(name) for ds in found.values() if "layer" in ds.coords for name in ds["layer"].values
    ]
    if not names:
        raise ValueError(
            "this trace does not name its layers (a capture does): give "
            "model=attnpanel.ModelRun(model, inputs, layers=[the module names of its layers])"
        )
    return ModelRun(model, args, kwargs, layers=names)

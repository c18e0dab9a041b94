"""One capture as a list of layers, whether it is a Dataset or a DataTree of groups.

:func:`attnpanel.capture` returns a Dataset with a ``layer`` dim when every attention of a
model has the same kind and shape, and an ``xarray.DataTree`` with one such Dataset per
group otherwise (encoder self-attention, decoder self-attention, cross-attention). The
entry points (explorer, export, CLI) take either; this module gives them one view of it:
every layer by its module name, unique across groups, and the group that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import xarray as xr


@dataclass(frozen=True)
class Layer:
    """Where one layer of a capture lives."""

    name: str  # the module name (the ``layer`` coordinate), or "" for a single-layer trace
    group: str  # the DataTree group path ("" for a Dataset)
    index: int  # position along the group's ``layer`` dim (0 when it has none)


def groups(capture: xr.Dataset | xr.DataTree) -> dict[str, xr.Dataset]:
    """``{group path: Dataset}``; a Dataset is the one group ``""``."""
    if isinstance(capture, xr.Dataset):
        return {"": capture}
    if not isinstance(capture, xr.DataTree):
        raise TypeError(f"expected a trace Dataset or DataTree, got {type(capture).__name__}")
    found = {
        node.path.lstrip("/"): node.to_dataset(inherit=False)
        for node in capture.subtree
        if "weights" in node.data_vars
    }
    if not found:
        raise ValueError("this DataTree holds no trace: no group has a 'weights' variable")
    return found


def layers(capture: xr.Dataset | xr.DataTree) -> list[Layer]:
    """Every layer of a capture, group by group, in the order the model ran them."""
    found = []
    for group, ds in groups(capture).items():
        if "layer" in ds.dims:
            names = [str(n) for n in ds["layer"].values]
            found += [Layer(name, group, i) for i, name in enumerate(names)]
        else:
            found.append(Layer(str(ds["layer"].values) if "layer" in ds.coords else "", group, 0))
    return found


def find(capture: xr.Dataset | xr.DataTree, layer: int | str | None = None) -> Layer:
    """A layer by its position among all layers or by its module name (default: the first).

    Raises
    ------
    ValueError
        Naming the layers there are, when ``layer`` is none of them.
    """
    every = layers(capture)
    if layer is None:
        return every[0]
    if isinstance(layer, str) and not layer.lstrip("-").isdigit():
        match = [entry for entry in every if entry.name == layer]
        if match:
            return match[0]
        names = ", ".join(entry.name for entry in every[:12])
        more = f" and {len(every) - 12} more" if len(every) > 12 else ""
        raise ValueError(f"no layer named {layer!r}; the layers are {names}{more}")
    index = int(layer)
    if not -len(every) <= index < len(every):
        raise ValueError(f"layer {index} is out of range: this capture has {len(every)} layers")
    return every[index]


def select(capture: xr.Dataset | xr.DataTree, layer: int | str | None = None) -> xr.Dataset:
    """One layer as a trace without a ``layer`` dim (its name kept as a scalar coordinate)."""
    entry = find(capture, layer)
    ds = groups(capture)[entry.group]
    return ds.isel(layer=entry.index) if "layer" in ds.dims else ds


def group_of(capture: xr.Dataset | xr.DataTree, layer: int | str | None = None) -> xr.Dataset:
    """The stacked group (all its layers) that holds ``layer``."""
    return groups(capture)[find(capture, layer).group]

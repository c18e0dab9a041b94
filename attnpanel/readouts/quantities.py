"""What the value axes of a signal and its reference series are called: the reference
series' own name (their ``long_name``), the quantity a signal shares with them ("total
power" and "device power": "power") and the axis of a model's predicted series. Read by
the top view (:func:`attnpanel.readouts.core.sequence_series`), the importance and the
patching views and the page's checkbox that shows the reference series."""

from __future__ import annotations

import xarray as xr

REFERENCE = "reference series"  # what reference series are called that name nothing


def reference_name(ds: xr.Dataset) -> str:
    """What the trace's reference series are, in its own words (their ``long_name``)."""
    for variable in ("truth", "prediction"):
        if variable in ds and "long_name" in ds[variable].attrs:
            return str(ds[variable].attrs["long_name"])
    return REFERENCE


def common_quantity(name: str, reference: str) -> str:
    """The value axis of a signal drawn with its reference series: their common quantity
    ("total power" and "device power": "power"; reference series that name nothing are
    taken as the signal's quantity, on its axis), else both names."""
    last = name.split()[-1] if name.split() else name
    same = reference == REFERENCE or reference.split()[-1:] == [last]
    return last if same else f"{name}, {reference}"


def signal_quantity(ds: xr.Dataset, name: str, unit: str | None) -> str:
    """The value axis of the input signal ``name`` (in ``unit``) drawn with the trace's
    reference series: their common quantity; both names where the reference series are
    in units of their own (a 143 px axis once read "aggregate power, reference series")."""
    present = [ds[v] for v in ("truth", "prediction") if v in ds]
    units = {str(series.attrs["units"]) for series in present if "units" in series.attrs}
    reference = reference_name(ds)
    if units - {str(unit)}:
        reference = f"{reference} ({', '.join(sorted(units))})"
    return common_quantity(name, reference)


def prediction_axis(ds: xr.Dataset, found, with_signal: bool) -> tuple[str, str | None]:
    """``(label, unit)`` of the value axis of predicted series (``with_signal``: drawn over
    the input signal; ``found`` the :class:`~attnpanel.readouts.core.SequenceSeries` drawn
    with them): the reference series' own quantity and unit, never the input's alone
    ("aggregate power" over kettle curves)."""
    reference = reference_name(ds)
    name = found.ylabel if found.yname == "signal" else "prediction"
    label = common_quantity(name, reference) if with_signal else reference
    unit = found.unit
    for variable in ("prediction", "truth"):
        if variable in ds and "units" in ds[variable].attrs:
            unit = ds[variable].attrs["units"]
            break
    return label, unit

"""NILMTK's HDF5 files: ``/building<i>/elec/meter<j>`` tables (a ``(physical_quantity,
type)`` column such as ``(power, active)`` on a time index), read with pandas' HDFStore.

Meter names come from NILMTK's metadata where the file has it (the building's
``elec_meters``: its site meter is the mains, ``aggregate``; ``appliances``: each one's
``type`` on its ``meters``), read as plain data (:mod:`attnpanel.util.plain_pickle`);
without it a meter is ``meter<j>`` and meter 1 is the mains.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from attnpanel.series.recordings import (
    INPUT,
    Recording,
    RecordingError,
    pick_houses,
    reader,
    series_of,
)
from attnpanel.util.plain_pickle import plain_pytables

METER_KEY = re.compile(r"^/building(\d+)/elec/meter(\d+)$")
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf")
QUANTITIES = (("power", "active"), ("power", "apparent"), ("power", "reactive"))


def _claims(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in HDF5_SUFFIXES


def _names(store: pd.HDFStore, building: str, meters: list[int]) -> dict[int, str]:
    names = {m: f"meter{m}" for m in meters}
    try:
        metadata = store.get_node(f"/building{building}")._v_attrs.metadata
    except (KeyError, AttributeError, TypeError):
        metadata = None
    if not isinstance(metadata, dict):  # none, or refused as not plain data
        if 1 in names:
            names[1] = INPUT
        return names
    for number, meter in (metadata.get("elec_meters") or {}).items():
        if isinstance(meter, dict) and meter.get("site_meter") and int(number) in names:
            names[int(number)] = INPUT
    kinds: dict[str, int] = {}
    for entry in metadata.get("appliances") or []:
        if not isinstance(entry, dict) or not entry.get("meters"):
            continue
        kind = str(entry.get("type", "meter"))
        kinds[kind] = kinds.get(kind, 0) + 1
        label = kind if entry.get("instance", 1) in (1, None) else f"{kind} {entry['instance']}"
        for meter in entry["meters"]:
            if int(meter) in names and names[int(meter)] != INPUT:
                names[int(meter)] = label
    return names


def _column(frame: pd.DataFrame, where: str) -> pd.Series:
    if isinstance(frame, pd.Series):
        return frame
    for quantity in QUANTITIES:
        if quantity in frame.columns:
            return frame[quantity]
    if frame.shape[1] == 1:
        return frame.iloc[:, 0]
    raise RecordingError(f"{where} has no power column; it has {list(frame.columns)}")


@reader("nilmtk", claims=_claims, words="NILMTK's HDF5 (/building<i>/elec/meter<j>)")
def read_nilmtk(path: Path, houses=None) -> list[Recording]:
    found = []
    with plain_pytables():
        try:
            store = pd.HDFStore(path, mode="r")
        except Exception as error:  # PyTables' HDF5ExtError, OSError, ValueError
            raise RecordingError(
                f"{path} is not an HDF5 file: {str(error).splitlines()[0]}"
            ) from None
        with store:
            meters: dict[str, list[int]] = {}
            for key in store.keys():
                match = METER_KEY.match(key)
                if match:
                    meters.setdefault(match.group(1), []).append(int(match.group(2)))
            if not meters:
                raise RecordingError(f"{path} holds no /building<i>/elec/meter<j> table")
            for building in pick_houses(sorted(meters, key=int), houses, str(path)):
                names = _names(store, building, sorted(meters[building]))
                channels = {}
                for meter in sorted(meters[building]):
                    key = f"/building{building}/elec/meter{meter}"
                    column = _column(store.select(key), f"{path}:{key}")
                    index = pd.DatetimeIndex(column.index)
                    if index.tz is None:
                        raise RecordingError(f"{path}:{key} has times without a time zone")
                    channels[names[meter]] = series_of(
                        column.to_numpy(), index.tz_convert("UTC"), names[meter], f"{path}:{key}"
                    )
                found.append(Recording(building, channels, source=f"{path} (NILMTK)"))
    return found

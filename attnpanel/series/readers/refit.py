"""REFIT's cleaned CSVs (``CLEAN_House<N>.csv``: ``Time, Unix, Aggregate``, the nine
submeters' columns numbered 1-9, ``Issues``), one file or a folder of them.

The clock is the ``Unix`` column (UTC seconds); ``Time`` is local text and is not read.
The submeters' names come from a labels file (``labels=``, or ``labels.dat`` /
``CLEAN_House<N>.labels`` beside the CSV) of ``N name`` lines, as UK-DALE's ``labels.dat``;
without one a column keeps its own name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from attnpanel.series.readers.ukdale import read_labels
from attnpanel.series.recordings import (
    INPUT,
    Recording,
    RecordingError,
    pick_houses,
    reader,
    series_of,
    utc_index,
)

HOUSE_IN_NAME = re.compile(r"house_?(\d+)", flags=re.I)
NOT_CHANNELS = ("time", "unix", "issues")


def _header(path: Path) -> list[str]:
    try:
        with path.open(encoding="utf-8", errors="replace") as file:
            return [c.strip().lower() for c in file.readline().split(",")]
    except OSError:
        return []


def _claims(path: Path) -> bool:
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    return bool(files) and all(
        f.suffix.lower() == ".csv" and {"unix", "aggregate"} <= set(_header(f)) for f in files
    )


def _house(path: Path) -> str:
    found = HOUSE_IN_NAME.search(path.stem)
    return found.group(1) if found else path.stem


def _labels(path: Path, labels) -> dict[int, str]:
    if labels is not None:
        return read_labels(Path(labels))
    for beside in (path.with_suffix(".labels"), path.parent / "labels.dat"):
        if beside.exists():
            return read_labels(beside)
    return {}


@reader("refit", claims=_claims, words="REFIT's CLEAN_House<N>.csv (a file or a folder)")
def read_refit(path: Path, houses=None, labels=None) -> list[Recording]:
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    if not files:
        raise RecordingError(f"{path} holds no REFIT CSV (CLEAN_House<N>.csv)")
    named = {_house(f): f for f in files}
    found = []
    for house in pick_houses(list(named), houses, str(path)):
        file = named[house]
        header = _header(file)
        if not {"unix", "aggregate"} <= set(header):
            raise RecordingError(f"{file} is not a REFIT CSV: no Unix and Aggregate columns")
        try:
            frame = pd.read_csv(file, engine="pyarrow")
        except Exception as error:
            raise RecordingError(
                f"{file} is not a CSV table: {str(error).splitlines()[0]}"
            ) from None
        columns = {c.lower(): c for c in frame.columns}
        index = utc_index(frame[columns["unix"]].to_numpy(), f"the Unix times of {file}")
        names = _labels(file, labels)
        channels = {}
        for column in frame.columns:
            low = column.lower()
            if low in NOT_CHANNELS:
                continue
            number = re.search(r"(\d+)$", column)
            name = INPUT if low == "aggregate" else column
            if number and int(number.group(1)) in names and low != "aggregate":
                name = names[int(number.group(1))]
            channels[name] = series_of(frame[column].to_numpy(), index, name, str(file))
        found.append(Recording(house, channels, source=f"{file} (REFIT)"))
    return found

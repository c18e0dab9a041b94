"""A ``pandas.DataFrame`` with a time index, or a CSV or Parquet file of one: one house,
one column per channel, the mains named ``aggregate`` (or ``input=``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from attnpanel.series.recordings import (
    INPUT,
    Recording,
    RecordingError,
    pick_houses,
    reader,
    series_of,
    utc_index,
)

TIME_COLUMNS = ("time", "timestamp", "datetime", "date", "unix", "unix_ts")


def _frame_recording(
    frame: pd.DataFrame, what: str, house: str, input: str, tz: str | None, units: str
) -> Recording:
    frame = frame.copy()
    if not isinstance(frame.index, pd.DatetimeIndex):
        column = next((c for c in frame.columns if str(c).lower() in TIME_COLUMNS), None)
        if column is None:
            raise RecordingError(
                f"{what} has no time index and no time column ({', '.join(TIME_COLUMNS)})"
            )
        frame = frame.set_index(column)
    index = utc_index(frame.index, f"the times of {what}", tz)
    if input not in frame.columns:
        raise RecordingError(
            f"{what} has no column {input!r} (the mains; name another with --input); it has "
            f"{', '.join(map(str, frame.columns))}"
        )
    channels = {}
    for column in frame.columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        if values.isna().all() and frame[column].notna().any():
            continue  # a column of words (REFIT's Issues, notes): not a channel
        channels[str(column)] = series_of(values.to_numpy(), index, str(column), what)
    return Recording(house, channels, input=input, units=units, source=what)


def _houses_ok(houses, house: str) -> None:
    pick_houses([house], houses, "the table")


@reader("frame", claims=lambda path: False, words="a pandas DataFrame with a time index")
def read_frame(frame, houses=None, house: str = "0", input: str = INPUT, tz=None, units: str = "W"):
    _houses_ok(houses, house)
    return [_frame_recording(frame, "the DataFrame", house, input, tz, units)]


def _is_table(path: Path, suffix: str) -> bool:
    return path.is_file() and path.suffix.lower() == suffix


@reader(
    "csv", claims=lambda p: _is_table(p, ".csv"), words="a CSV, a column per channel", generic=True
)
def read_csv(path: Path, houses=None, house=None, input: str = INPUT, tz=None, units="W"):
    house = house or path.stem
    _houses_ok(houses, house)
    try:
        frame = pd.read_csv(path, engine="pyarrow")
    except Exception as error:  # pyarrow's and pandas' parse errors have no common class
        raise RecordingError(f"{path} is not a CSV table: {str(error).splitlines()[0]}") from None
    return [_frame_recording(frame, str(path), house, input, tz, units)]


@reader("parquet", claims=lambda p: _is_table(p, ".parquet"), words="a Parquet file", generic=True)
def read_parquet(path: Path, houses=None, house=None, input: str = INPUT, tz=None, units="W"):
    house = house or path.stem
    _houses_ok(houses, house)
    try:
        frame = pd.read_parquet(path)
    except Exception as error:
        raise RecordingError(
            f"{path} is not a Parquet table: {str(error).splitlines()[0]}"
        ) from None
    return [_frame_recording(frame, str(path), house, input, tz, units)]

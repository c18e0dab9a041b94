"""Recordings: the files researchers keep, read into one form.

A :class:`Recording` is one house (one site, one meter set): each channel its own
``pandas.Series`` of readings in units on a time-zone-aware ``DatetimeIndex`` (UTC), as the
file held them (each channel may keep its own clock, as UK-DALE's ``channel_N.dat`` files
do; :mod:`attnpanel.series.windows` puts them on one grid). The channel the model reads is
the ``input`` (the mains, ``aggregate``); the others are what a model predicts or what is
taken out of the input to corrupt it.

Readers register themselves on one dispatcher, as datashader's backends do:
:func:`reader` names a format, :func:`read_recordings` finds the reader (by ``format=`` or by
asking each whether a path is its kind) and checks what it returns. A new format is a new
module in ``readers/``, not an edit here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

INPUT = "aggregate"  # the mains channel's name in every format this package reads


class RecordingError(ValueError):
    """A recording that cannot be read as asked: the message names what is wrong."""


@dataclass(frozen=True)
class Recording:
    """One house's channels.

    Parameters
    ----------
    house : str
        The house (site) as the file names it: ``"1"`` for UK-DALE's ``house_1``.
    channels : mapping of str to pandas.Series
        Each channel's readings, float, on a sorted, unique, UTC ``DatetimeIndex``.
    input : str
        The channel the model reads (the mains).
    units : str
        The readings' units (``W`` for every power format).
    source : str
        Where it was read from, in words (the file, the format).
    """

    house: str
    channels: Mapping[str, pd.Series]
    input: str = INPUT
    units: str = "W"
    source: str = ""
    time_zone: str = "UTC"  # the zone the clock features and the page's times are read in

    def __post_init__(self):
        if self.input not in self.channels:
            raise RecordingError(
                f"house {self.house} has no channel {self.input!r}; it has "
                f"{', '.join(self.channels) or 'none'}"
            )
        for name, series in self.channels.items():
            check_index(series.index, f"channel {name!r} of house {self.house}")

    @property
    def names(self) -> list[str]:
        """The channels' names, the input first."""
        return [self.input, *(n for n in self.channels if n != self.input)]

    def span(self) -> tuple[pd.Timestamp, pd.Timestamp]:
        """The first and last reading of any channel."""
        starts = [s.index[0] for s in self.channels.values() if len(s)]
        ends = [s.index[-1] for s in self.channels.values() if len(s)]
        if not starts:
            raise RecordingError(f"house {self.house} holds no reading")
        return min(starts), max(ends)


def check_index(index: pd.Index, what: str) -> None:
    """A channel's time index: dates, in one zone (UTC), sorted, each once."""
    if not isinstance(index, pd.DatetimeIndex):
        raise RecordingError(f"{what} is not indexed by time ({type(index).__name__})")
    if index.tz is None:
        raise RecordingError(f"{what} has times without a time zone")
    if not index.is_monotonic_increasing:
        raise RecordingError(f"{what}: its times are not in order")
    if index.has_duplicates:
        first = index[index.duplicated()][0]
        raise RecordingError(f"{what} has duplicate timestamps (first at {first})")


def utc_index(values, what: str, tz: str | None = None) -> pd.DatetimeIndex:
    """Timestamps as a UTC ``DatetimeIndex``: numbers are Unix seconds (UTC); dates carry
    their zone, or are read in ``tz``; dates of several zones at once are refused."""
    values = pd.Index(values)
    if values.dtype.kind in "iuf":
        return pd.DatetimeIndex(pd.to_datetime(np.asarray(values), unit="s", utc=True))
    if isinstance(values, pd.DatetimeIndex):
        index = values
    else:
        try:
            index = pd.DatetimeIndex(pd.to_datetime(values, format="ISO8601"))
        except (ValueError, TypeError) as error:
            text = str(error)
            if "mixed time zones" in text or "tz-aware" in text or "Mixed timezones" in text:
                raise RecordingError(f"{what} mixes time zones; give one zone") from None
            raise RecordingError(f"{what} holds times that are not dates: {text}") from None
    if index.tz is None:
        if tz is None:
            raise RecordingError(
                f"{what} has times without a time zone; say which (--tz UTC, --tz Europe/London)"
            )
        index = index.tz_localize(tz, ambiguous="NaT", nonexistent="NaT")
    return index.tz_convert("UTC")


def series_of(values, index: pd.DatetimeIndex, name: str, what: str) -> pd.Series:
    """One channel: float readings on ``index``, sorted; duplicate times refused."""
    series = pd.Series(np.asarray(values, dtype=np.float64), index=index, name=name)
    series = series[series.index.notna()]
    if not series.index.is_monotonic_increasing:
        series = series.sort_index(kind="stable")
    check_index(series.index, f"{name!r} of {what}")
    return series


def pick_houses(available: Sequence[str], houses: Sequence[str] | None, what: str) -> list[str]:
    """The houses to read of those ``what`` holds; one asked for and not there is named."""
    if houses is None:
        return list(available)
    missing = [h for h in houses if h not in available]
    if missing:
        raise RecordingError(
            f"no house {', '.join(missing)} in {what}; it has {', '.join(available) or 'none'}"
        )
    return [h for h in available if h in houses]


ReadFn = Callable[..., list[Recording]]


@dataclass
class _Format:
    name: str
    read: ReadFn
    claims: Callable[[Path], bool]
    words: str = ""
    generic: bool = False  # claims any file of its suffix: asked after the specific ones


_FORMATS: dict[str, _Format] = {}


def reader(name: str, claims: Callable[[Path], bool], words: str = "", generic: bool = False):
    """Register ``read(path, houses=None, **options) -> [Recording]`` as the reader of
    format ``name``; ``claims(path)`` says whether a path looks like that format (a
    ``generic`` one, any CSV, is asked after the others)."""

    def register(read: ReadFn) -> ReadFn:
        _FORMATS[name] = _Format(name, read, claims, words, generic)
        return read

    return register


def formats() -> dict[str, str]:
    """The registered formats and what each reads (the package registers its own readers
    as it is imported: ``attnpanel/series/__init__.py``)."""
    return {name: f.words for name, f in _FORMATS.items()}


@dataclass
class Recordings:
    """Every house read from one source, by house."""

    houses: dict[str, Recording] = field(default_factory=dict)
    format: str = ""

    def __getitem__(self, house: str) -> Recording:
        key = str(house)
        if key not in self.houses:
            raise RecordingError(
                f"no house {key}; the recording has {', '.join(self.houses) or 'none'}"
            )
        return self.houses[key]

    def __iter__(self):
        return iter(self.houses.values())

    def __len__(self) -> int:
        return len(self.houses)


def read_recordings(
    source, format: str | None = None, houses: Sequence | None = None, **options
) -> Recordings:
    """Read a recording: a path (a UK-DALE folder, a REFIT or plain CSV, a Parquet file, a
    NILMTK HDF5 file) or a ``pandas.DataFrame`` with a time index.

    Parameters
    ----------
    source : str, Path or pandas.DataFrame
        What to read.
    format : str, optional
        One of :func:`formats` (``ukdale``, ``refit``, ``nilmtk``, ``csv``, ``parquet``,
        ``frame``); found from the path when left out.
    houses : sequence, optional
        The houses to read (all by default); one that is not there is an error naming those
        that are.
    **options
        The reader's own (``tz=`` for a CSV of local times, ``labels=`` for REFIT's names,
        ``input=`` for the mains' column of a CSV).

    Returns
    -------
    Recordings
        One :class:`Recording` per house.

    Raises
    ------
    RecordingError
        A path that is not there or not the format named, a house that is not there, times
        without a zone or mixed, duplicate timestamps.
    """
    if isinstance(source, pd.DataFrame):
        format = format or "frame"
    else:
        source = Path(source)
        if not source.exists():
            raise RecordingError(f"no recording at {source}")
        if format is None:
            ordered = sorted(_FORMATS.values(), key=lambda f: f.generic)
            found = [f.name for f in ordered if f.claims(source)]
            if not found:
                raise RecordingError(
                    f"{source} is none of the formats read here ({', '.join(_FORMATS)}); "
                    "name one with --format"
                )
            format = found[0]
    if format not in _FORMATS:
        raise RecordingError(f"no recording format {format!r}; there are {', '.join(_FORMATS)}")
    wanted = None if houses is None else [str(h) for h in houses]
    read = _FORMATS[format].read(source, houses=wanted, **options)
    found = Recordings({r.house: r for r in read}, format)
    for house in wanted or ():
        found[house]  # a house asked for and not read: named
    if not len(found):
        raise RecordingError(f"{source} holds no house in the {format} format")
    return found

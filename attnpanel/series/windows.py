"""Recordings on one clock, cut into windows: what a sequence model is given.

:func:`resampled` puts every channel of a house on one grid (pandas' ``resample``: the mean
of the readings in each step, a step with none is missing); :func:`windows_of` fills short
gaps (forward, up to ``fill`` steps), cuts windows of ``length`` steps every ``stride``
steps and skips every window that still has a missing value (as NILMFormer's
preprocessing does). Each window keeps its timestamps and its house;
:func:`by_house` and :func:`by_date` split them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr

from attnpanel.series.recordings import Recording, RecordingError, Recordings

READINGS = "readings"  # the windows' variable: (window, channel, position), in units


def _freq(freq: str) -> pd.Timedelta:
    try:
        step = pd.Timedelta(pd.tseries.frequencies.to_offset(freq))
    except (ValueError, TypeError):
        raise RecordingError(f"{freq!r} is not a frequency (1min, 10s, 6s, 1h)") from None
    if step <= pd.Timedelta(0):
        raise RecordingError(f"{freq!r} is not a positive step")
    return step


def resampled(recording: Recording, freq: str = "1min", channels: Sequence[str] | None = None):
    """The house's channels on one grid of step ``freq``, ``(time, channel)``, the input
    first; a step where a channel has no reading is NaN.

    Raises
    ------
    RecordingError
        A channel that is not there (naming those that are), a bad frequency.
    """
    step = _freq(freq)
    names = recording.names if channels is None else [recording.input, *channels]
    missing = [n for n in names if n not in recording.channels]
    if missing:
        raise RecordingError(
            f"house {recording.house} has no channel {', '.join(map(repr, missing))}; it has "
            f"{', '.join(recording.names)}"
        )
    first, last = recording.span()
    grid = pd.date_range(first.floor(step), last.floor(step), freq=step)
    columns = {}
    for name in dict.fromkeys(names):
        series = recording.channels[name]
        columns[name] = series.resample(step, origin="epoch").mean().reindex(grid)
    return pd.DataFrame(columns, index=grid)


def windows_of(
    recordings: Recordings | Recording,
    length: int = 480,
    stride: int | None = None,
    freq: str = "1min",
    channels: Sequence[str] | None = None,
    fill: int = 0,
    houses: Sequence | None = None,
) -> xr.Dataset:
    """Windows of ``length`` steps of every house (or of ``houses``).

    Parameters
    ----------
    recordings : Recordings or Recording
        What :func:`attnpanel.series.read_recordings` read.
    length : int
        Steps per window.
    stride : int, optional
        Steps from one window's start to the next (default ``length``: no overlap).
    freq : str
        The step, a pandas frequency (``1min``, ``10s``).
    channels : sequence of str, optional
        The channels besides the input (default every channel of the house).
    fill : int
        Gaps of up to this many steps are filled forward; a window with a gap left is
        skipped.
    houses : sequence, optional
        The houses to cut (default all).

    Returns
    -------
    xarray.Dataset
        ``readings`` ``(window, channel, position)`` float32 in units, coordinates ``time``
        ``(window, position)`` (UTC), ``house`` and ``start`` per window, ``channel``;
        attrs ``freq``, ``length``, ``stride``, ``input``, ``units``, ``skipped`` (windows
        left out for a gap), ``source``.

    Raises
    ------
    RecordingError
        A window longer than the recording, no window without a gap, a channel or house
        that is not there, a bad step.
    """
    if isinstance(recordings, Recording):
        recordings = Recordings({recordings.house: recordings})
    length, stride = int(length), int(stride or length)
    if length < 1 or stride < 1:
        raise RecordingError(
            f"a window is at least 1 step, its stride too (got {length}, {stride})"
        )
    if fill < 0:
        raise RecordingError(f"fill is a number of steps, 0 or more (got {fill})")
    chosen = list(recordings) if houses is None else [recordings[h] for h in houses]
    parts, skipped, names = [], 0, None
    for recording in chosen:
        frame = resampled(recording, freq, channels)
        if names is None:
            names = list(frame.columns)
        elif list(frame.columns) != names:
            raise RecordingError(
                f"house {recording.house} has channels {list(frame.columns)}, the first "
                f"house {names}; name the channels to read with channels="
            )
        if len(frame) < length:
            raise RecordingError(
                f"a window of {length} steps of {freq} is longer than house "
                f"{recording.house}'s recording ({len(frame)} steps)"
            )
        if fill:
            frame = frame.ffill(limit=fill)
        values = frame.to_numpy(dtype=np.float32)  # (T, C)
        starts = np.arange(0, len(frame) - length + 1, stride)
        cut = np.lib.stride_tricks.sliding_window_view(values, length, axis=0)[starts]  # (W, C, L)
        whole = ~np.isnan(cut).any(axis=(1, 2))
        skipped += int((~whole).sum())
        starts, cut = starts[whole], cut[whole]
        if not len(starts):
            continue
        times = frame.index.tz_convert("UTC").tz_localize(None).to_numpy()
        parts.append(
            xr.Dataset(
                {READINGS: (("window", "channel", "position"), np.ascontiguousarray(cut))},
                coords={
                    "time": (("window", "position"), times[starts[:, None] + np.arange(length)]),
                    "house": ("window", np.full(len(starts), recording.house, dtype=object)),
                },
            )
        )
    if not parts:
        raise RecordingError(
            f"no window of {length} steps of {freq} without a gap ({skipped} had one); "
            "fill short gaps with --fill-gaps N"
        )
    found = xr.concat(parts, dim="window")
    first = chosen[0]
    found = found.assign_coords(
        window=np.arange(found.sizes["window"]),
        channel=np.array(names, dtype=object),
        start=("window", found["time"].values[:, 0]),
        house=found["house"].astype(str),
    )
    found["time"].attrs["time_zone"] = "UTC"
    found[READINGS].attrs["units"] = first.units
    found.attrs.update(
        freq=freq, length=length, stride=stride, input=first.input, units=first.units,
        time_zone=first.time_zone, skipped=skipped,
        source="; ".join(r.source for r in chosen if r.source),
    )  # fmt: skip
    return found


def step_seconds(windows: xr.Dataset) -> float:
    """The windows' step in seconds (their ``freq``)."""
    return pd.Timedelta(pd.tseries.frequencies.to_offset(windows.attrs["freq"])).total_seconds()


def by_house(found: xr.Dataset, houses: Sequence) -> xr.Dataset:
    """The windows of ``houses`` (a house not there is named)."""
    wanted = [str(h) for h in houses]
    present = sorted(set(found["house"].values.tolist()))
    missing = [h for h in wanted if h not in present]
    if missing:
        raise RecordingError(
            f"no window of house {', '.join(missing)}; there are {', '.join(present)}"
        )
    return found.isel(window=np.isin(found["house"].values, wanted))


def by_date(found: xr.Dataset, start=None, end=None) -> xr.Dataset:
    """The windows that lie wholly in ``[start, end)`` (UTC dates or timestamps)."""
    keep = np.ones(found.sizes["window"], dtype=bool)
    first, last = found["time"].values[:, 0], found["time"].values[:, -1]
    if start is not None:
        keep &= first >= _utc(start)
    if end is not None:
        keep &= last < _utc(end)
    if not keep.any():
        raise RecordingError(f"no window lies wholly between {start} and {end}")
    return found.isel(window=keep)


def _utc(when) -> np.datetime64:
    stamp = pd.Timestamp(when)
    stamp = stamp.tz_localize("UTC") if stamp.tz is None else stamp.tz_convert("UTC")
    return stamp.tz_localize(None).to_datetime64()

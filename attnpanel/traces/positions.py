"""What each position of a trace is: a time step, a span of steps, or a named token.

A time-series model does not always attend over its input's time steps one to one.
NILMFormer appends a statistics token (attention over ``L + 1`` positions, the token last),
PatchTST attends over patches (each a span of steps), and a classifier may put a CLS token
first. A trace says which, in three coordinates over ``position`` (or ``(batch,
position)``):

==================  ========================================================================
``time``            the time of a time step, the start of a span; NaT for a named token
``time_end``        the time of a span's last step (only where positions are spans)
``position_name``   a named token's name ("statistics", "cls"); "" for a step or a span
==================  ========================================================================

:class:`Layout` maps the input's own timestamps onto the model's positions
(``capture(..., time=stamps, layout=Layout(after=("statistics",)))``), and
:class:`Positions` reads one sample's positions back for every axis, hover and table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import xarray as xr

TIME, TIME_END, POSITION_NAME = "time", "time_end", "position_name"
NAT = np.datetime64("NaT", "ns")


@dataclass(frozen=True)
class Layout:
    """How a model's positions lie over its input's ``T`` time steps.

    Parameters
    ----------
    before, after : tuple of str
        Named tokens the model puts before the steps (a CLS token) and after them
        (NILMFormer's "statistics").
    patch : int, optional
        Steps per position (PatchTST's ``patch_length``): each position is a span.
    stride : int, optional
        Steps from one span's start to the next (``patch_stride``; ``patch`` by default).
        As PatchTST, the spans end on the input's last step: the first ``(T - patch) %
        stride`` steps are read by no span.
    """

    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    patch: int | None = None
    stride: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "before", tuple(str(n) for n in self.before))
        object.__setattr__(self, "after", tuple(str(n) for n in self.after))
        names = self.before + self.after
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError(f"named tokens need distinct, non-empty names, got {names}")
        if self.patch is not None and self.patch < 1:
            raise ValueError(f"patch must be at least 1 step, got {self.patch}")
        if self.stride is not None and (self.patch is None or self.stride < 1):
            raise ValueError("stride is the step between spans: give patch too, stride >= 1")

    @classmethod
    def of_model(cls, model) -> Layout | None:
        """The layout a model's Hugging Face config says (PatchTST's ``patch_length``,
        ``patch_stride`` and ``use_cls_token``); None where it says none."""
        config = getattr(model, "config", None)
        patch = getattr(config, "patch_length", None)
        if not isinstance(patch, int):
            return None
        stride = getattr(config, "patch_stride", None)
        before = ("cls",) if getattr(config, "use_cls_token", False) else ()
        return cls(before=before, patch=patch, stride=stride if isinstance(stride, int) else None)

    def length(self, steps: int) -> int:
        """The model's number of positions over ``steps`` input time steps."""
        return len(self.before) + self._spans(steps) + len(self.after)

    def _spans(self, steps: int) -> int:
        if self.patch is None:
            return steps
        if steps < self.patch:
            raise ValueError(f"{steps} time steps are fewer than one patch of {self.patch}")
        return (steps - self.patch) // (self.stride or self.patch) + 1

    def coords(self, time: np.ndarray) -> dict[str, np.ndarray]:
        """The three coordinates' values (``(..., positions)``) from the input's own
        timestamps ``time`` (``(..., T)`` datetime64)."""
        steps = time.shape[-1]
        lead = time.shape[:-1]
        start = np.asarray(time)
        start = start.astype("datetime64[ns]" if start.dtype.kind == "M" else np.float64)
        fill = NAT if start.dtype.kind == "M" else np.nan  # no time: NaT (NaN for numbers)
        end = None
        if self.patch is not None:
            stride = self.stride or self.patch
            spans = self._spans(steps)
            first = steps - (self.patch + stride * (spans - 1))  # PatchTST's sequence_start
            starts = first + stride * np.arange(spans)
            start, end = start[..., starts], start[..., starts + self.patch - 1]
        before = np.full(lead + (len(self.before),), fill, dtype=start.dtype)
        after = np.full(lead + (len(self.after),), fill, dtype=start.dtype)
        found = {TIME: np.concatenate([before, start, after], axis=-1)}
        if end is not None:
            found[TIME_END] = np.concatenate([before, end, after], axis=-1)
        names = self.names(found[TIME].shape[-1])
        if names is not None:  # the same for every sample, over the same dims as the time
            found[POSITION_NAME] = np.ascontiguousarray(np.broadcast_to(names, lead + names.shape))
        return found

    def names(self, length: int) -> np.ndarray | None:
        """``position_name`` of ``length`` positions without a clock (None: no names)."""
        if not (self.before or self.after):
            return None
        middle = length - len(self.before) - len(self.after)
        if middle < 0:
            names = self.before + self.after
            raise ValueError(f"{length} positions cannot hold the tokens {names}")
        return np.array([*self.before, *([""] * middle), *self.after], dtype=str)

    def words(self) -> str:
        """The layout in a few words, for a trace's ``positions`` attribute."""
        parts = []
        if self.before:
            parts.append(f"{', '.join(self.before)} first")
        if self.patch is not None:
            parts.append(f"spans of {self.patch} steps every {self.stride or self.patch}")
        if self.after:
            parts.append(f"{', '.join(self.after)} last")
        return "; ".join(parts) or "one position per time step"


def _time_coord(time) -> tuple[np.ndarray, dict]:
    """Timestamps as ``datetime64[ns]`` (what netCDF and zarr read back) and their zone."""
    attrs = {}
    if isinstance(time, pd.Series):
        time = pd.DatetimeIndex(time) if isinstance(time.dtype, pd.DatetimeTZDtype) else time
    if isinstance(time, pd.DatetimeIndex) and time.tz is not None:
        attrs["time_zone"] = str(time.tz)  # stored as naive UTC, which both formats keep
        time = time.tz_convert("UTC").tz_localize(None)
    time = np.asarray(time)
    if time.dtype.kind == "O":  # numpy's own dtype for the values (numbers, text), if any
        time = np.asarray(time.tolist())
    if time.dtype.kind in "OSU":  # text: dates written out ("2024-05-01 08:00"), or not
        time = _parse_dates(time)
    if time.dtype.kind == "M":
        time = time.astype("datetime64[ns]")
    elif time.dtype.kind not in "iuf":
        raise ValueError(f"time must be numbers or dates, got {time.dtype} values")
    return time, attrs


def position_coords(time, layout: Layout | None, batch: int, length: int, attrs: dict) -> dict:
    """``time`` (and ``time_end``, ``position_name``: :mod:`attnpanel.traces.positions`)
    over the trace's positions, from timestamps of the positions or of the input's own
    steps laid out by ``layout``."""
    found = {}
    if time is not None:
        time, time_attrs = _time_coord(time)
        attrs.update(time_attrs)
        if time.ndim not in (1, 2) or (time.ndim == 2 and time.shape[0] != batch):
            raise ValueError(
                f"time must be (position,) or (batch, position) with batch {batch}, "
                f"got {time.shape}"
            )
        if layout is None and time.shape[-1] != length:
            raise ValueError(
                f"time holds {time.shape[-1]} timestamps for {length} positions: give one "
                "per position, or the input's own with layout=Layout(...) saying where "
                "the others are (a token before or after the steps, patches)"
            )
        found = {TIME: time} if layout is None else layout.coords(time)
    elif layout is not None and (names := layout.names(length)) is not None:
        found = {POSITION_NAME: names}
    if layout is not None:
        attrs["positions"] = layout.words()
    coords = {}
    for name, values in found.items():
        if values.shape[-1] != length:
            raise ValueError(
                f"positions={layout} lays {time.shape[-1]} time steps out as "
                f"{values.shape[-1]} positions; the model has {length}"
            )
        coords[name] = (("position",) if values.ndim == 1 else ("batch", "position"), values)
    return coords


def _parse_dates(text: np.ndarray) -> np.ndarray:
    """Timestamps written as text, as ``datetime64``; text that is no date is refused."""
    try:
        parsed = pd.to_datetime(text.ravel(), format="mixed")
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"time holds text that is not a date ({error}); give numbers or dates, and "
            "labels such as words as tokens="
        ) from None
    if getattr(parsed, "tz", None) is not None:
        parsed = parsed.tz_convert("UTC").tz_localize(None)
    return np.asarray(parsed, dtype="datetime64[ns]").reshape(text.shape)


def _of_sample(ds: xr.Dataset, name: str, sample: int) -> np.ndarray | None:
    if name not in ds.coords:
        return None
    values = ds[name]
    if "batch" in values.dims:
        values = values.isel(batch=sample)
    return np.asarray(values.values)


@dataclass(frozen=True)
class Positions:
    """One sample's positions: their times (NaT where a position has none), the ends of
    spans, and the names of named tokens ("" elsewhere)."""

    times: np.ndarray | None  # datetime64[ns]; None: the trace has no clock
    ends: np.ndarray | None  # datetime64[ns]: span ends; None: no spans
    names: np.ndarray  # str, "" where a position is a step or a span
    zone: str | None = None  # the clock the labels are read in (the trace's time_zone)

    @classmethod
    def of(cls, ds: xr.Dataset, sample: int = 0) -> Positions:
        times = _of_sample(ds, TIME, sample)
        length = ds.sizes.get("position", ds.sizes.get("query", 0 if times is None else len(times)))
        names = _of_sample(ds, POSITION_NAME, sample)
        return cls(
            times,
            _of_sample(ds, TIME_END, sample),
            np.full(length, "", dtype=object) if names is None else names.astype(object),
            ds.attrs.get("time_zone"),
        )

    @property
    def named(self) -> np.ndarray:
        """True at named tokens (bool, one per position)."""
        return self.names != ""

    def kind(self, index: int) -> str:
        """ "token", "span" or "time step" (a position of a trace without a clock: "step")."""
        if self.names[index]:
            return "token"
        if self.ends is not None and not np.isnat(self.ends[index]):
            return "span"
        return "time step" if self.times is not None else "step"

    def labels(self) -> list[str] | None:
        """Each position as text for axes and hovers: its clock time (``HH:MM`` within a
        day, ``MM-DD HH:MM`` across days, seconds where steps are shorter than a minute),
        a span as ``start–end``, a token by its name; None without a clock (or where a
        position that is no token has no time)."""
        if self.times is None or self.times.size == 0:
            named = self.named.any()
            return [str(n) or str(i) for i, n in enumerate(self.names)] if named else None
        timed = ~self.named
        if self.times.dtype.kind != "M":  # numbers: as they are
            return [str(n) or f"{t:g}" for n, t in zip(self.names, self.times, strict=True)]
        values = self._local(self.times)
        ends = None if self.ends is None else self._local(self.ends)
        if np.isnat(values[timed]).any():
            return None
        known = values[timed] if ends is None else np.concatenate([values[timed], ends[timed]])
        if known.size == 0:
            return [str(n) for n in self.names]
        days = known.astype("datetime64[D]")
        steps = np.diff(np.sort(known))
        minute = np.timedelta64(60, "s")
        fine = bool(steps.size) and np.min(steps[steps > np.timedelta64(0, "s")], initial=minute)
        fine = fine < minute
        start = 5 if days.min() != days.max() else 11
        stop = 19 if fine else 16

        def clock(value) -> str:
            return np.datetime_as_string(value, unit="s")[start:stop].replace("T", " ")

        found = []
        for i, name in enumerate(self.names):
            if name:
                found.append(str(name))
            elif ends is not None and not np.isnat(ends[i]) and ends[i] != values[i]:
                found.append(f"{clock(values[i])}–{clock(ends[i])}")
            else:
                found.append(clock(values[i]))
        return found

    def _local(self, times: np.ndarray) -> np.ndarray:
        """``times`` (naive UTC) on the trace's own clock, to the second."""
        if self.zone and self.zone != "UTC":
            index = pd.DatetimeIndex(times).tz_localize("UTC").tz_convert(self.zone)
            times = np.asarray(index.tz_localize(None), dtype="datetime64[ns]")
        return times.astype("datetime64[s]")

    def words(self) -> str:
        """What the positions are, in a few words: "480 time steps of 60 s; position 480:
        the statistics token"."""
        timed = int((~self.named).sum())
        kind = self.kind(int(np.argmin(self.named))) if timed else "step"
        step = self.step()
        parts = [f"{timed} {kind}{'s' if timed != 1 else ''}"
                 + (f" every {_duration(step)}" if step is not None else "")]  # fmt: skip
        parts += [f"position {i}: the {n} token" for i, n in enumerate(self.names) if n]
        return "; ".join(parts)

    def dates(self) -> str | None:
        """The calendar days the positions lie on, in the trace's clock: "Mon 3 Mar 2014",
        or "3 Mar 2014 to 4 Mar 2014"; None without a clock."""
        if self.times is None or self.times.dtype.kind != "M":
            return None
        known = self._local(self.times[~self.named & ~np.isnat(self.times)])
        if known.size == 0:
            return None
        first, last = (pd.Timestamp(t) for t in (known.min(), known.max()))
        if first.date() == last.date():
            return f"{first:%a} {first.day} {first:%b %Y}"
        return f"{first.day} {first:%b %Y} to {last.day} {last:%b %Y}"

    def step(self) -> np.timedelta64 | None:
        """The regular step between successive positions that have a time (the stride of
        spans), else None; named tokens are not steps."""
        if self.times is None or self.times.dtype.kind != "M":
            return None
        times = self.times[~self.named].astype("datetime64[s]")
        steps = np.diff(times)
        if steps.size == 0 or np.isnat(steps).any() or not (steps == steps[0]).all():
            return None
        return steps[0]


def _duration(step: np.timedelta64) -> str:
    """A step in words: "1 min", "6 s", "1 h"."""
    seconds = int(step / np.timedelta64(1, "s"))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"

"""Synthetic household power at 1-minute resolution, with per-appliance ground truth.

The driving example of attnpanel is non-intrusive load monitoring (NILM): a model sees
only the household aggregate and recovers what each appliance drew. Real smart-meter data
cannot ship with the package, so this module generates a plausible stand-in, seeded and
reproducible:

* a base load of 60-200 W with minute-to-minute noise, a slow wander and evening steps
  (lights, TV);
* a fridge cycling at 80-150 W (on 15-30 min, off 30-60 min) with a start-up spike;
* a kettle at 2-3 kW for 2-4 min, in the morning and the evening;
* a microwave at 1-1.5 kW for 1-6 min around meals;
* a washing machine running 60-120 min: a ~2 kW heater phase, 100-300 W tumbling and
  300-600 W spin bursts;
* a dishwasher running 90-150 min: two ~2 kW heater phases between pump phases.

The aggregate is their sum, clipped to 0-6000 W, with readings under 5 W set to 0.
:func:`generate` returns a continuous series and :func:`windows` cuts it into 8-hour
windows of 480 steps, both as ``xarray.Dataset`` with named dims ``time``/``appliance``
(or ``window``/``position``/``appliance``) and real ``datetime64`` timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xarray as xr

APPLIANCES = ("fridge", "kettle", "microwave", "washing_machine", "dishwasher")
MINUTES_PER_DAY = 24 * 60
TRAIN_SEED = 0  # seed of the days the demo model trains on (from PowerConfig.start)
HELDOUT_SEED = 1  # seed of the held-out days (metrics, demo)
HELDOUT_START = "2025-06-02"  # held-out days start well after the 400 training days


@dataclass
class PowerConfig:
    """Parameters of the synthetic household; powers in W, durations and times in minutes."""

    start: str = "2024-01-01"  # timestamp of the first minute (midnight of the first day)
    window: int = 480  # steps per window: 8 hours at 1-minute resolution
    base_bounds: tuple[float, float] = (60.0, 200.0)  # base load is kept inside these bounds
    base_level: tuple[float, float] = (65.0, 110.0)  # per-day base level, drawn uniformly
    base_noise: float = 3.0  # std of the minute-to-minute base noise
    base_wander: float = 6.0  # std of the slow (half-hour) wander of the base load
    evening_steps: tuple[int, int] = (1, 3)  # how many evening steps per day (inclusive)
    evening_step_power: tuple[float, float] = (15.0, 35.0)  # size of one evening step
    evening_on: tuple[int, int] = (17 * 60, 21 * 60)  # window in which an evening step starts
    evening_off: tuple[int, int] = (22 * 60, 24 * 60)  # window in which it ends
    fridge_power: tuple[float, float] = (80.0, 150.0)  # compressor running power
    fridge_on: tuple[int, int] = (15, 30)  # length of a compressor run
    fridge_off: tuple[int, int] = (30, 60)  # pause between runs
    fridge_spike: tuple[float, float] = (1.6, 2.2)  # first on-minute, as a multiple of the run
    kettle_power: tuple[float, float] = (2000.0, 3000.0)  # heating element
    kettle_duration: tuple[int, int] = (2, 4)  # one boil (inclusive)
    kettle_slots: tuple[tuple[int, int], ...] = ((6 * 60, 9 * 60), (17 * 60, 22 * 60))  # when
    kettle_probability: float = 0.85  # chance of a boil in each slot of a day
    kettle_second: float = 0.3  # chance of a second boil in the same slot
    microwave_power: tuple[float, float] = (1000.0, 1500.0)  # magnetron draw
    microwave_duration: tuple[int, int] = (1, 6)  # one use (inclusive)
    microwave_slots: tuple[tuple[int, int], ...] = (
        (7 * 60, 9 * 60),
        (12 * 60, 14 * 60),
        (18 * 60, 21 * 60),
    )  # meal times
    microwave_probability: float = 0.45  # chance of a use at each meal
    washer_probability: float = 0.5  # chance of a wash on a given day
    washer_start: tuple[int, int] = (8 * 60, 19 * 60)  # when a wash starts
    washer_duration: tuple[int, int] = (60, 120)  # whole programme (inclusive)
    washer_heater: tuple[float, float] = (1800.0, 2200.0)  # heater phase power (~2 kW)
    washer_heater_duration: tuple[int, int] = (10, 25)  # heater phase length
    washer_tumble: tuple[float, float] = (100.0, 300.0)  # drum tumbling power
    washer_spin: tuple[float, float] = (300.0, 600.0)  # spin burst power
    washer_spin_bursts: tuple[int, int] = (2, 4)  # spin bursts at the end (inclusive)
    washer_spin_duration: tuple[int, int] = (2, 5)  # one spin burst
    dishwasher_probability: float = 0.5  # chance of a dishwasher run on a given day
    dishwasher_start: tuple[int, int] = (12 * 60, 22 * 60)  # when a run starts
    dishwasher_duration: tuple[int, int] = (90, 150)  # whole programme (inclusive)
    dishwasher_heater: tuple[float, float] = (1800.0, 2200.0)  # both heater phases (~2 kW)
    dishwasher_heater_duration: tuple[int, int] = (10, 25)  # one heater phase
    dishwasher_pump: tuple[float, float] = (60.0, 150.0)  # circulation / drain pump
    appliance_noise: float = 0.01  # relative std of minute-to-minute appliance noise
    clip: tuple[float, float] = (0.0, 6000.0)  # the meter's range
    floor: float = 5.0  # readings below this are reported as 0


def _uniform_int(rng: np.random.Generator, bounds: tuple[int, int], size=None):
    """Integers drawn uniformly from the inclusive ``bounds``."""
    return rng.integers(bounds[0], bounds[1] + 1, size=size)


def _segment(rng: np.random.Generator, bounds, duration: int, cfg: PowerConfig) -> np.ndarray:
    """``duration`` minutes at one level drawn from ``bounds``, with noise kept inside them."""
    level = rng.uniform(*bounds)
    noise = 1 + rng.normal(0, cfg.appliance_noise, duration)
    return np.clip(level * noise, *bounds)


def _paint(series: np.ndarray, start: int, profile: np.ndarray) -> None:
    """Add ``profile`` to ``series`` from ``start``, truncated at the end of the series."""
    stop = min(start + len(profile), len(series))
    if start < stop:
        series[start:stop] += profile[: stop - start]


def _base_load(rng: np.random.Generator, n_days: int, cfg: PowerConfig) -> np.ndarray:
    n = n_days * MINUTES_PER_DAY
    level = np.repeat(rng.uniform(*cfg.base_level, size=n_days), MINUTES_PER_DAY)
    # The wander is white noise averaged over half an hour: smooth, with no periodic pattern.
    kernel = np.ones(30) / np.sqrt(30)
    wander = np.convolve(rng.normal(0, cfg.base_wander, n + 29), kernel, mode="valid")
    base = level + wander + rng.normal(0, cfg.base_noise, n)
    by_day = base.reshape(n_days, MINUTES_PER_DAY)  # a view: writes land in base
    counts = _uniform_int(rng, cfg.evening_steps, n_days)
    for day, count in enumerate(counts):
        on = _uniform_int(rng, cfg.evening_on, count)
        off = _uniform_int(rng, cfg.evening_off, count)
        for a, b, p in zip(on, off, rng.uniform(*cfg.evening_step_power, count), strict=True):
            by_day[day, a:b] += p
    return np.clip(base, *cfg.base_bounds)


def _fridge(rng: np.random.Generator, n: int, cfg: PowerConfig) -> np.ndarray:
    # Enough cycles to cover the series; a cycle is an "on" run followed by an "off" pause.
    n_cycles = n // (cfg.fridge_on[0] + cfg.fridge_off[0]) + 2
    on = _uniform_int(rng, cfg.fridge_on, n_cycles)
    off = _uniform_int(rng, cfg.fridge_off, n_cycles)
    power = rng.uniform(*cfg.fridge_power, n_cycles)
    lengths = np.stack([on, off], axis=1).ravel()  # on0, off0, on1, off1, ...
    levels = np.stack([power, np.zeros(n_cycles)], axis=1).ravel()
    phase = int(rng.integers(0, on[0] + off[0]))  # the series starts mid-cycle
    fridge = np.repeat(levels, lengths)[phase : phase + n]
    noise = 1 + rng.normal(0, cfg.appliance_noise, n)
    fridge = np.where(fridge > 0, np.clip(fridge * noise, *cfg.fridge_power), 0.0)
    starts = np.concatenate([[0], np.cumsum(lengths)])[0::2] - phase  # first on-minute
    starts = starts[(starts > 0) & (starts < n)]
    fridge[starts] *= rng.uniform(*cfg.fridge_spike, len(starts))
    return fridge


def _in_slots(rng, n_days, slots, probability, second=0.0):
    """Event start minutes (absolute) for per-day time slots, each used with a probability.

    With probability ``second`` a used slot has a second event 20 min to 2 h after the first.
    """
    starts = []
    for lo, hi in slots:
        days = np.flatnonzero(rng.random(n_days) < probability)
        first = days * MINUTES_PER_DAY + rng.integers(lo, hi, len(days))
        again = first[rng.random(len(first)) < second]
        starts += [first, again + rng.integers(20, 121, len(again))]
    return np.sort(np.concatenate(starts))


def _kettle(rng, n_days, cfg):
    kettle = np.zeros(n_days * MINUTES_PER_DAY)
    for start in _in_slots(
        rng, n_days, cfg.kettle_slots, cfg.kettle_probability, cfg.kettle_second
    ):
        duration = int(_uniform_int(rng, cfg.kettle_duration))
        _paint(kettle, start, _segment(rng, cfg.kettle_power, duration, cfg))
    return kettle


def _microwave(rng, n_days, cfg):
    microwave = np.zeros(n_days * MINUTES_PER_DAY)
    for start in _in_slots(rng, n_days, cfg.microwave_slots, cfg.microwave_probability):
        duration = int(_uniform_int(rng, cfg.microwave_duration))
        _paint(microwave, start, _segment(rng, cfg.microwave_power, duration, cfg))
    return microwave


def washing_machine_profile(rng: np.random.Generator, cfg: PowerConfig) -> np.ndarray:
    """One washing-machine programme, minute by minute.

    A few minutes of filling and tumbling, the ~2 kW heater phase, tumbling at 100-300 W,
    and 300-600 W spin bursts separated by tumbling at the end.
    """
    duration = int(_uniform_int(rng, cfg.washer_duration))
    # Tumbling varies minute by minute as the drum turns and pauses.
    profile = rng.uniform(*cfg.washer_tumble, duration)
    heat_start = int(rng.integers(3, 8))
    heat = int(_uniform_int(rng, cfg.washer_heater_duration))
    profile[heat_start : heat_start + heat] = _segment(rng, cfg.washer_heater, heat, cfg)
    position = duration
    for _ in range(int(_uniform_int(rng, cfg.washer_spin_bursts))):
        length = int(_uniform_int(rng, cfg.washer_spin_duration))
        if position - length < heat_start + heat + 10:
            break  # a short programme keeps some tumbling between heating and spinning
        position -= length
        profile[position : position + length] = _segment(rng, cfg.washer_spin, length, cfg)
        position -= int(rng.integers(2, 6))  # tumbling between bursts
    return profile


def dishwasher_profile(rng: np.random.Generator, cfg: PowerConfig) -> np.ndarray:
    """One dishwasher programme, minute by minute: pump, heat, pump, heat, pump."""
    duration = int(_uniform_int(rng, cfg.dishwasher_duration))
    heat = _uniform_int(rng, cfg.dishwasher_heater_duration, 2)
    pumps = duration - heat.sum()
    # Split the pump time into three phases, each at least 10 minutes.
    cuts = np.sort(rng.integers(10, pumps - 10, 2))
    while cuts[1] - cuts[0] < 10:
        cuts = np.sort(rng.integers(10, pumps - 10, 2))
    pump = np.diff(np.concatenate([[0], cuts, [pumps]]))
    phases = [
        (cfg.dishwasher_pump, pump[0]),
        (cfg.dishwasher_heater, heat[0]),
        (cfg.dishwasher_pump, pump[1]),
        (cfg.dishwasher_heater, heat[1]),
        (cfg.dishwasher_pump, pump[2]),
    ]
    return np.concatenate([_segment(rng, bounds, int(n), cfg) for bounds, n in phases])


def _programmes(rng, n_days, probability, start_bounds, make_profile, cfg):
    n = n_days * MINUTES_PER_DAY
    series = np.zeros(n)
    for day in np.flatnonzero(rng.random(n_days) < probability):
        start = day * MINUTES_PER_DAY + int(rng.integers(*start_bounds))
        _paint(series, start, make_profile(rng, cfg))
    return series


def generate(n_days: int, seed: int = 0, config: PowerConfig | None = None) -> xr.Dataset:
    """Generate ``n_days`` of 1-minute household power with its appliance ground truth.

    Parameters
    ----------
    n_days : int
        Number of whole days, starting at midnight of ``config.start``.
    seed : int
        Seed of the random generator; the same seed and config give the same data.
    config : PowerConfig, optional
        Household parameters; the defaults follow the spec in the module docstring.

    Returns
    -------
    xarray.Dataset
        ``aggregate`` (time) and ``appliance_power`` (appliance, time), float32, in W, with
        ``time`` as datetime64[ns] at 1-minute steps and ``appliance`` as names.

    Raises
    ------
    ValueError
        When ``n_days`` is not a positive integer.
    """
    if int(n_days) != n_days or n_days < 1:
        raise ValueError(f"n_days must be a positive integer, got {n_days!r}")
    n_days = int(n_days)
    cfg = config or PowerConfig()
    rng = np.random.default_rng(seed)
    n = n_days * MINUTES_PER_DAY
    base = _base_load(rng, n_days, cfg)
    appliances = np.stack(
        [
            _fridge(rng, n, cfg),
            _kettle(rng, n_days, cfg),
            _microwave(rng, n_days, cfg),
            _programmes(
                rng,
                n_days,
                cfg.washer_probability,
                cfg.washer_start,
                washing_machine_profile,
                cfg,
            ),
            _programmes(
                rng,
                n_days,
                cfg.dishwasher_probability,
                cfg.dishwasher_start,
                dishwasher_profile,
                cfg,
            ),
        ]
    )  # (appliance, time)
    aggregate = np.clip(base + appliances.sum(axis=0), *cfg.clip)
    aggregate[aggregate < cfg.floor] = 0.0
    time = np.datetime64(cfg.start, "ns") + np.arange(n) * np.timedelta64(1, "m")
    return xr.Dataset(
        {
            "aggregate": (("time",), aggregate.astype(np.float32)),
            "appliance_power": (("appliance", "time"), appliances.astype(np.float32)),
        },
        coords={"time": time, "appliance": list(APPLIANCES)},
        attrs={"units": "W", "seed": seed, "n_days": n_days, "source": "attnpanel.nilm.power"},
    )


def windows(
    ds: xr.Dataset, length: int = 480, stride: int | None = None, offset: int = 0
) -> xr.Dataset:
    """Cut a continuous series into windows.

    Parameters
    ----------
    ds : xarray.Dataset
        Output of :func:`generate` (dims ``time`` and ``appliance``).
    length : int
        Steps per window; 480 is 8 hours at 1-minute resolution.
    stride : int, optional
        Steps between window starts; defaults to ``length`` (no overlap).
    offset : int
        Step of the first window start.

    Returns
    -------
    xarray.Dataset
        ``aggregate`` (window, position) and ``appliance_power`` (window, appliance,
        position), with a ``time`` coordinate of dims (window, position).

    Raises
    ------
    ValueError
        When the series is too short for one window, or the arguments are not positive.
    """
    stride = length if stride is None else stride
    if length < 1 or stride < 1 or offset < 0:
        raise ValueError(
            f"length ({length}) and stride ({stride}) must be positive, offset ({offset}) >= 0"
        )
    n = ds.sizes["time"]
    starts = np.arange(offset, n - length + 1, stride)
    if len(starts) == 0:
        raise ValueError(
            f"a series of {n} steps holds no window of {length} steps from offset {offset}"
        )
    index = starts[:, None] + np.arange(length)  # (window, position)
    aggregate = ds["aggregate"].values[index]
    appliance = ds["appliance_power"].values[:, index].transpose(1, 0, 2)
    return xr.Dataset(
        {
            "aggregate": (("window", "position"), aggregate),
            "appliance_power": (("window", "appliance", "position"), appliance),
        },
        coords={
            "time": (("window", "position"), ds["time"].values[index]),
            "appliance": ds["appliance"].values,
            "window": np.arange(len(starts)),
            "position": np.arange(length),
        },
        attrs=dict(ds.attrs, window_length=length, stride=stride),
    )

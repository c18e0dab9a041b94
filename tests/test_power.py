"""The synthetic household: every appliance within its spec, seeded, clipped, windowed."""

from __future__ import annotations

import numpy as np
import pytest

from attnpanel.nilm.power import APPLIANCES, MINUTES_PER_DAY, PowerConfig, generate, windows

N_DAYS = 60


@pytest.fixture(scope="module")
def household():
    return generate(N_DAYS, seed=3)


def runs(on: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of every run of True, ignoring runs cut by the series' ends."""
    edges = np.diff(on.astype(np.int8))
    starts = np.flatnonzero(edges == 1) + 1
    stops = np.flatnonzero(edges == -1) + 1
    if on[0]:
        stops = stops[1:]
    return list(zip(starts, stops[: len(starts)], strict=False))


def power(ds, name: str) -> np.ndarray:
    return ds["appliance_power"].sel(appliance=name).values


def minute_of_day(ds) -> np.ndarray:
    time = ds["time"].values
    return ((time - time.astype("datetime64[D]")) // np.timedelta64(1, "m")).astype(int)


def test_dims_coords_and_dtype(household):
    assert household["aggregate"].dims == ("time",)
    assert household["appliance_power"].dims == ("appliance", "time")
    assert list(household["appliance"].values) == list(APPLIANCES)
    assert household.sizes["time"] == N_DAYS * MINUTES_PER_DAY
    time = household["time"].values
    assert time.dtype == np.dtype("datetime64[ns]")
    assert time[0] == np.datetime64(PowerConfig().start)
    assert np.all(np.diff(time) == np.timedelta64(1, "m"))
    assert household["aggregate"].dtype == np.float32


def test_same_seed_same_data_other_seed_differs():
    a, b, c = generate(3, seed=7), generate(3, seed=7), generate(3, seed=8)
    assert a.identical(b)
    assert not np.array_equal(a["aggregate"].values, c["aggregate"].values)


def test_aggregate_is_base_plus_appliances_clipped(household):
    cfg = PowerConfig()
    aggregate = household["aggregate"].values
    appliances = household["appliance_power"].sum("appliance").values
    base = aggregate - appliances
    unclipped = aggregate < cfg.clip[1]
    # Where the meter did not saturate, the rest is the base load, inside its bounds.
    assert base[unclipped].min() >= cfg.base_bounds[0] - 0.5
    assert base[unclipped].max() <= cfg.base_bounds[1] + 0.5
    assert aggregate.min() >= 0 and aggregate.max() <= cfg.clip[1]


def test_base_load_has_noise_and_evening_steps(household):
    base = household["aggregate"].values - household["appliance_power"].sum("appliance").values
    minute = minute_of_day(household)
    night = base[(minute >= 2 * 60) & (minute < 5 * 60)]
    evening = base[(minute >= 21 * 60) & (minute < 22 * 60)]
    assert evening.mean() > night.mean() + 15  # at least one evening step is always on
    assert np.std(np.diff(night)) > 1  # minute-to-minute noise, not a flat line


def test_clipping_and_floor():
    cfg = PowerConfig(base_level=(1.0, 2.0), base_bounds=(0.0, 200.0), clip=(0.0, 2500.0))
    ds = generate(10, seed=1, config=cfg)
    aggregate = ds["aggregate"].values
    assert aggregate.max() == 2500.0  # kettles at 2-3 kW saturate the meter
    assert aggregate.min() == 0.0
    assert not np.any((aggregate > 0) & (aggregate < cfg.floor))


def test_fridge_cycles(household):
    cfg = PowerConfig()
    fridge = power(household, "fridge")
    cycles = runs(fridge > 0)
    assert len(cycles) > N_DAYS * 15  # a cycle every 45-90 minutes
    lengths = np.array([b - a for a, b in cycles])
    assert lengths.min() >= cfg.fridge_on[0] and lengths.max() <= cfg.fridge_on[1]
    pauses = np.array([c[0] - p[1] for p, c in zip(cycles, cycles[1:], strict=False)])
    assert pauses.min() >= cfg.fridge_off[0] and pauses.max() <= cfg.fridge_off[1]
    steady = np.concatenate([fridge[a + 1 : b] for a, b in cycles])
    assert steady.min() >= 80 and steady.max() <= 150
    spikes = np.array([fridge[a] for a, _ in cycles])
    after = np.array([fridge[a + 1] for a, _ in cycles])
    assert np.all(spikes > 1.3 * after)  # a start-up spike opens every run


@pytest.mark.parametrize(
    "name, watts, minutes",
    [("kettle", (2000, 3000), (2, 4)), ("microwave", (1000, 1500), (1, 6))],
)
def test_short_appliances(household, name, watts, minutes):
    values = power(household, name)
    events = runs(values > 0)
    assert len(events) > N_DAYS  # more than one a day on average
    lengths = np.array([b - a for a, b in events])
    assert lengths.min() >= minutes[0] and lengths.max() <= minutes[1]
    on = values[values > 0]
    assert on.min() >= watts[0] and on.max() <= watts[1]


def test_kettle_in_the_morning_and_evening(household):
    minute = minute_of_day(household)
    starts = np.array([a for a, _ in runs(power(household, "kettle") > 0)])
    hour = minute[starts] // 60
    morning, evening = (hour >= 6) & (hour < 11), (hour >= 17) & (hour < 24)
    assert np.all(morning | evening)
    assert morning.sum() > N_DAYS / 2 and evening.sum() > N_DAYS / 2


def test_washing_machine_programme(household):
    values = power(household, "washing_machine")
    programmes = runs(values > 0)
    assert len(programmes) > N_DAYS / 4
    for a, b in programmes:
        assert 60 <= b - a <= 120
        run = values[a:b]
        heater = run >= 1500
        assert 10 <= heater.sum() <= 25 and len(runs(np.r_[False, heater, False])) == 1
        assert not heater[35:].any()  # heats early in the programme
        rest = run[~heater]
        assert rest.min() >= 100 and rest.max() <= 600
        tail = run[-30:]
        assert np.sum(tail >= 300) >= 4  # spin bursts at the end
        assert np.sum((run >= 100) & (run <= 300)) > (b - a) / 3  # mostly tumbling


def test_dishwasher_programme(household):
    values = power(household, "dishwasher")
    programmes = runs(values > 0)
    assert len(programmes) > N_DAYS / 4
    for a, b in programmes:
        assert 90 <= b - a <= 150
        run = values[a:b]
        heater = run >= 1500
        heats = runs(np.r_[False, heater, False])
        assert len(heats) == 2  # two heater phases...
        assert not heater[0] and not heater[-1]  # ...between pump phases
        assert run[heater].min() >= 1800 and run[heater].max() <= 2200
        pump = run[~heater]
        assert pump.min() >= 60 and pump.max() <= 150


def test_windows_cut_the_series(household):
    cut = windows(household, length=480, offset=60)
    assert cut["aggregate"].dims == ("window", "position")
    assert cut["appliance_power"].dims == ("window", "appliance", "position")
    assert cut["time"].dims == ("window", "position")
    assert cut.sizes["position"] == 480
    assert cut.sizes["window"] == (N_DAYS * MINUTES_PER_DAY - 60) // 480
    second = cut.isel(window=1)
    start = 60 + 480
    np.testing.assert_array_equal(
        second["aggregate"].values, household["aggregate"].values[start : start + 480]
    )
    np.testing.assert_array_equal(
        second["appliance_power"].values,
        household["appliance_power"].values[:, start : start + 480],
    )
    assert second["time"].values[0] == household["time"].values[start]
    assert np.all(np.diff(cut["time"].values, axis=1) == np.timedelta64(1, "m"))


def test_overlapping_windows_and_errors(household):
    overlapping = windows(household.isel(time=slice(0, 1440)), length=480, stride=240)
    assert overlapping.sizes["window"] == 5
    with pytest.raises(ValueError, match="no window of 480 steps"):
        windows(household.isel(time=slice(0, 100)))
    with pytest.raises(ValueError, match="must be positive"):
        windows(household, stride=0)
    with pytest.raises(ValueError, match="positive integer"):
        generate(0)

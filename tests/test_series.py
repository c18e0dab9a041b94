"""attnpanel.series: recordings in the layouts researchers keep, read into houses, put on one
clock and cut into windows; recipes; checkpoints; the metrics on hand-made cases."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest
import torch
from recordings import START, house_power, write_nilmtk, write_refit, write_ukdale
from reference_nilmformer import small_nilmformer, trainer_checkpoint

from attnpanel import series
from attnpanel.interventions.model_run import Patching
from attnpanel.series import RecipeError, RecordingError
from attnpanel.util.plain_pickle import PlainPickleError, plain_loads


@pytest.fixture(scope="module")
def house() -> pd.DataFrame:
    return house_power(hours=24)


@pytest.fixture(scope="module")
def files(tmp_path_factory, house):
    """One house written in every layout (UK-DALE holds a second house)."""
    root = tmp_path_factory.mktemp("recordings")
    house.to_csv(root / "plain.csv", index_label="time")
    house.to_parquet(root / "plain.parquet")
    return {
        "ukdale": write_ukdale(root / "ukdale", {"1": house, "2": house_power(hours=12, seed=1)}),
        "refit": write_refit(root / "CLEAN_House3.csv", house),
        "nilmtk": write_nilmtk(root / "house.h5", {"1": house}),
        "csv": root / "plain.csv",
        "parquet": root / "plain.parquet",
    }


@pytest.mark.parametrize("layout", ["ukdale", "refit", "nilmtk", "csv", "parquet"])
def test_every_layout_reads_the_same_house(files, house, layout):
    """The format is found from the path; the channels are named as the file names them;
    one minute of the resampled mains equals the mean of its readings (whole watts where
    the format writes integers)."""
    found = series.read_recordings(files[layout])
    assert found.format == layout
    recording = next(iter(found))
    assert recording.names[:3] == ["aggregate", "kettle", "fridge"]
    grid = series.resampled(recording, "1min", channels=["kettle", "fridge"])
    expected = house.resample("1min").mean()
    rounding = 0.5 if layout in ("ukdale", "refit") else 1e-3
    for name in ("aggregate", "kettle", "fridge"):
        got = grid[name].to_numpy()
        assert got.shape == expected[name].shape
        np.testing.assert_allclose(got, expected[name].to_numpy(), atol=rounding)
    assert grid.index.tz is not None and grid.index[0] == START


def test_ukdale_keeps_its_houses_and_names_the_missing_one(files):
    found = series.read_recordings(files["ukdale"])
    assert list(found.houses) == ["1", "2"]
    with pytest.raises(RecordingError, match="no house 9 .*it has 1, 2"):
        series.read_recordings(files["ukdale"], houses=[9])
    one = series.read_recordings(files["ukdale"], houses=["2"])
    assert list(one.houses) == ["2"]


def test_refit_without_labels_keeps_the_column_names(tmp_path, house):
    path = write_refit(tmp_path / "CLEAN_House7.csv", house)
    path.with_suffix(".labels").unlink()
    recording = series.read_recordings(path)["7"]
    assert recording.names[:3] == ["aggregate", "Appliance1", "Appliance2"][:3]


def test_nilmtk_without_metadata_names_meters(tmp_path, house):
    path = write_nilmtk(tmp_path / "bare.h5", {"4": house}, metadata=False)
    assert series.read_recordings(path)["4"].names == ["aggregate", "meter2", "meter3"]


def test_nilmtk_metadata_is_read_as_plain_data_never_run(tmp_path, house):
    """A metadata attribute that would run code when unpickled is not run: the meters
    keep their plain names and nothing is executed."""
    path = write_nilmtk(tmp_path / "hostile.h5", {"1": house}, metadata=False)
    ran = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    import tables

    with tables.open_file(path, mode="a") as handle:
        handle.get_node("/building1")._v_attrs.metadata = Hostile()
    assert series.read_recordings(path)["1"].names == ["aggregate", "meter2", "meter3"]
    assert not ran.exists()


def test_plain_pickle_refuses_a_global_and_reads_plain_data():
    assert plain_loads(pickle.dumps({"a": [1, 2.5, "x"], 3: (None, True)})) == {
        "a": [1, 2.5, "x"],
        3: (None, True),
    }
    with pytest.raises(PlainPickleError, match="global posix.system"):
        plain_loads(b"cposix\nsystem\n(S'true'\ntR.")


def test_windows_keep_times_and_house_and_skip_gaps(house):
    frame = house.copy()
    frame.iloc[5000:5010, 0] = np.nan  # 60 s of no mains inside the second 8-hour window
    gappy = series.read_recordings(frame.dropna())
    cut = series.windows_of(gappy, length=480, freq="1min")
    assert cut.sizes == {"window": 2, "channel": 3, "position": 480}
    assert cut.attrs["skipped"] == 1
    starts = pd.DatetimeIndex(cut["start"].values)
    assert list(starts) == [pd.Timestamp("2014-03-03 00:00"), pd.Timestamp("2014-03-03 16:00")]
    assert (np.diff(cut["time"].values[0]) == np.timedelta64(60, "s")).all()
    assert set(cut["house"].values) == {"0"}
    filled = series.windows_of(gappy, length=480, freq="1min", fill=1)
    assert filled.sizes["window"] == 3 and filled.attrs["skipped"] == 0


def test_windows_with_a_stride_overlap(house):
    cut = series.windows_of(series.read_recordings(house), length=480, stride=240, freq="1min")
    assert cut.sizes["window"] == 5
    np.testing.assert_array_equal(
        cut["readings"].values[1, :, :240], cut["readings"].values[0, :, 240:]
    )


def test_splits_by_house_and_date(files):
    cut = series.windows_of(series.read_recordings(files["ukdale"]), length=240, freq="1min")
    assert set(series.by_house(cut, ["2"])["house"].values) == {"2"}
    later = series.by_date(cut, start="2014-03-03 12:00")
    assert (later["start"].values >= np.datetime64("2014-03-03T12:00")).all()
    with pytest.raises(RecordingError, match="no window of house 5; there are 1, 2"):
        series.by_house(cut, [5])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.tz_localize(None), "without a time zone"),
        (lambda f: pd.concat([f.iloc[:10], f.iloc[5:20]]), "duplicate timestamps"),
        (lambda f: f.rename(columns={"aggregate": "mains"}), "no column 'aggregate'"),
    ],
)
def test_bad_recordings_are_named(house, change, message):
    with pytest.raises(RecordingError, match=message):
        series.read_recordings(change(house))


def test_a_csv_of_local_times_needs_a_zone_and_mixed_zones_are_refused(tmp_path, house):
    local = house.iloc[:100].tz_convert("Europe/London").tz_localize(None)
    local.to_csv(tmp_path / "local.csv", index_label="time")
    with pytest.raises(RecordingError, match="without a time zone; say which"):
        series.read_recordings(tmp_path / "local.csv")
    found = series.read_recordings(tmp_path / "local.csv", tz="Europe/London")
    assert next(iter(found)).channels["aggregate"].index[0] == START
    # a local clock over the change to summer time: two offsets, each time exact
    summer = ["2014-03-30T00:59:00+00:00", "2014-03-30T02:00:00+01:00"]
    pd.DataFrame({"time": summer, "aggregate": [1, 2]}).to_csv(tmp_path / "dst.csv", index=False)
    index = next(iter(series.read_recordings(tmp_path / "dst.csv"))).channels["aggregate"].index
    assert list(index) == [
        pd.Timestamp("2014-03-30 00:59", tz="UTC"),
        pd.Timestamp("2014-03-30 01:00", tz="UTC"),
    ]
    mixed = pd.DataFrame(
        {"time": ["2014-03-03T00:00:00+00:00", "2014-03-03T00:01:00"], "aggregate": [1, 2]}
    )
    mixed.to_csv(tmp_path / "mixed.csv", index=False)
    with pytest.raises(RecordingError, match="mixes time zones|not dates"):
        series.read_recordings(tmp_path / "mixed.csv")


def test_a_file_of_another_format_and_a_window_too_long(tmp_path, files):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(RecordingError, match="none of the formats"):
        series.read_recordings(tmp_path / "notes.txt")
    with pytest.raises(RecordingError, match="not a UK-DALE folder|not an HDF5 file"):
        series.read_recordings(files["csv"], format="nilmtk")
    with pytest.raises(RecordingError, match="longer than house 1's recording"):
        series.windows_of(series.read_recordings(files["nilmtk"]), length=5000, freq="1min")


def test_the_nilmformer_recipe_follows_its_interface(house):
    """Channel 0 the clipped mains over the scale, then sin and cos of minute, hour,
    weekday (Monday 0) and month (January 1), in that order; 481 positions, the token last."""
    cut = series.windows_of(series.read_recordings(house), length=480, freq="1min")
    recipe = series.make_recipe("nilmformer", scale=4000.0, clip=3000.0, targets=["kettle"])
    (x,), kwargs = recipe.inputs(cut)
    assert x.shape == (3, 9, 480) and kwargs == {}
    mains = np.clip(cut["readings"].sel(channel="aggregate").values, 0, 3000) / 4000
    np.testing.assert_allclose(x[:, 0].numpy(), mains, rtol=1e-6)
    stamp = pd.Timestamp(cut["time"].values[1, 7])  # 08:07 on Monday, March 3rd
    expected = []
    for value, period in ((7, 60), (8, 24), (0, 7), (3, 12)):
        expected += [np.sin(2 * np.pi * value / period), np.cos(2 * np.pi * value / period)]
    assert stamp == pd.Timestamp("2014-03-03 08:07")
    np.testing.assert_allclose(x[1, 1:, 7].numpy(), expected, atol=1e-6)
    assert recipe.tokens_after == ("statistics",)
    assert recipe.input_channels()[:3] == ["mains / scale", "sin minute", "cos minute"]
    out = torch.full((3, 1, 480), -0.5)
    out[:, :, 0] = 0.5
    back = recipe.outputs(out, cut)
    assert back.shape == (3, 1, 480) and back[0, 0, 0] == 2000.0 and back[0, 0, 1] == 0.0


def test_a_recipe_is_written_and_read_back_as_json(tmp_path, house):
    cut = series.windows_of(series.read_recordings(house), length=480, freq="1min")
    fitted = series.NILMFormerRecipe.fitted(cut, clip=6000.0, targets=["kettle"])
    assert fitted.scale == pytest.approx(float(cut["readings"].sel(channel="aggregate").max()))
    fitted.save(tmp_path / "recipe.json")
    again = series.read_recipe(tmp_path / "recipe.json")
    assert again == fitted
    assert series.read_recipe(tmp_path / "recipe.json", scale=5000.0).scale == 5000.0
    with pytest.raises(RecipeError, match="predicts one target"):
        series.read_recipe(tmp_path / "recipe.json", targets=["kettle", "fridge"])
    with pytest.raises(RecipeError, match="needs the scale"):
        series.make_recipe("nilmformer", targets=["kettle"])
    with pytest.raises(RecipeError, match="no recipe 'bert'"):
        series.make_recipe("bert")


def test_the_generic_recipe_lays_channels_last_or_first(house):
    cut = series.windows_of(series.read_recordings(house), length=480, freq="1min")
    last = series.make_recipe("generic", channels=["aggregate", "fridge"], scale=10.0)
    (x,), _ = last.inputs(cut)
    assert x.shape == (3, 480, 2)
    np.testing.assert_allclose(x[0, :, 1], cut["readings"].values[0, 2] / 10.0, rtol=1e-6)
    first = series.make_recipe("generic", layout="BCL", targets=["kettle"])
    (y,), _ = first.inputs(cut)
    assert y.shape == (3, 1, 480)
    assert first.outputs(torch.ones(3, 480), cut).shape == (3, 1, 480)
    with pytest.raises(RecipeError, match="expects 480 positions"):
        first.outputs(torch.ones(3, 1, 7), cut)


def test_a_trainers_checkpoint_loads_and_bad_ones_are_named(tmp_path):
    model = small_nilmformer()
    trainer_checkpoint(model, tmp_path / "trainer.pt")
    other = small_nilmformer()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    series.load_checkpoint(other, tmp_path / "trainer.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value)

    class Hostile:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"model_state_dict": model.state_dict(), "note": Hostile()}, tmp_path / "bad.pt")
    with pytest.raises(
        series.ModelError, match=r"holds (builtins\.)?print, which a checkpoint is not allowed"
    ):
        series.load_checkpoint(other, tmp_path / "bad.pt")
    torch.save({"weights": {"a": 1}}, tmp_path / "nostate.pt")
    with pytest.raises(series.ModelError, match="no model_state_dict, state_dict, model key"):
        series.read_state(tmp_path / "nostate.pt")
    with pytest.raises(series.ModelError, match="missing .*unexpected"):
        series.load_checkpoint(torch.nn.Linear(2, 2), tmp_path / "trainer.pt")


def test_factories_by_file_and_module_and_their_errors():
    model = series.make_model("tests/reference_nilmformer.py:small_nilmformer")
    assert type(model).__name__ == "ReferenceNILMFormer" and not model.training
    assert series.load_factory("attnpanel.series.metrics:nilm") is series.nilm
    with pytest.raises(series.ModelError, match="the factory raised RuntimeError: cannot find"):
        series.make_model("tests/reference_nilmformer.py:factory_that_raises")
    with pytest.raises(series.ModelError, match="has no function nothing"):
        series.load_factory("tests/reference_nilmformer.py:nothing")
    with pytest.raises(series.ModelError, match="give FILE.py:FUNCTION"):
        series.load_factory("model.py")


def test_nilm_metrics_on_a_hand_made_case():
    y = np.array([0.0, 100.0, 2000.0, 3000.0])
    y_hat = np.array([50.0, 100.0, 1000.0, 2500.0])
    found = series.nilm(y, y_hat, threshold=1500.0)
    assert found["MAE"] == pytest.approx((50 + 0 + 1000 + 500) / 4)
    assert found["MSE"] == pytest.approx((50**2 + 1000**2 + 500**2) / 4)
    assert found["RMSE"] == pytest.approx(np.sqrt(found["MSE"]))
    nde = (50**2 + 1000**2 + 500**2) / (100**2 + 2000**2 + 3000**2)
    assert found["NDE"] == pytest.approx(nde)
    assert found["NDE (NILMTK)"] == pytest.approx(np.sqrt(nde))
    assert found["SAE"] == pytest.approx(abs(3650 - 5100) / 5100)
    assert found["MR"] == pytest.approx((0 + 100 + 1000 + 2500) / (50 + 100 + 2000 + 3000))
    assert found["TECA"] == pytest.approx(1 - 1550 / (2 * 5100))
    # on: truth [F F T T], prediction [F F F T]: tp 1, tn 2, fn 1, fp 0
    assert found["accuracy"] == 0.75 and found["precision"] == 1.0 and found["recall"] == 0.5
    assert found["F1"] == pytest.approx(2 / 3)
    assert found["balanced accuracy"] == pytest.approx((0.5 + 1.0) / 2)


def test_energy_per_day_and_forecast_metrics():
    time = pd.date_range("2014-03-03", periods=4, freq="12h").to_numpy()
    found = series.energy([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 3.0, 3.0], time, period="D")
    # days: truth 3 + 1, 7 + 1; prediction 2 + 1, 6 + 1
    assert found["MAE"] == pytest.approx(1.0) and found["SAE"] == pytest.approx(2 / 12)
    fc = series.forecast([2.0, 4.0], [1.0, 4.0], history=[1.0, 2.0, 4.0])
    assert fc["MAE"] == 0.5 and fc["RMSE"] == pytest.approx(np.sqrt(0.5))
    assert fc["sMAPE"] == pytest.approx(100 * (2 * 1 / 3 + 0) / 2)
    assert fc["MASE"] == pytest.approx(0.5 / 1.5)


def test_a_recording_models_page_run_predicts_in_units_and_takes_a_submeter_out(house):
    """The ModelRun a page gets: its prediction of a window equals the recording model's;
    "without fridge" is the same window with the fridge's readings taken out of the mains."""
    cut = series.windows_of(series.read_recordings(house), length=480, freq="1min")
    recipe = series.make_recipe("nilmformer", scale=6000.0, targets=["kettle"])
    run = series.RecordingModel(small_nilmformer(), recipe, cut, {"kettle": 2000.0})
    page = run.model_run()
    assert page.corruption_names()[:2] == ["without kettle", "without fridge"]
    predicted = page.prediction(1)  # over the trace's 481 positions: none at the token
    np.testing.assert_allclose(predicted[:, :480], run.predictions()[1], rtol=1e-6)
    assert np.isnan(predicted[:, 480]).all()
    (x,), _, _ = page.corrupted(1, Patching(how="without fridge"))
    readings = cut["readings"].isel(window=1)
    mains = (readings.sel(channel="aggregate") - readings.sel(channel="fridge")).clip(min=0)
    np.testing.assert_allclose(x[0, 0].numpy(), mains.values / 6000.0, rtol=1e-6)
    with pytest.raises(RecipeError, match="no submeter 'oven'"):
        run.without("oven")

"""Lossless save and load, lazy zarr, and every bad file of the issue's point 4."""

from __future__ import annotations

import json
import pathlib
import pickle

import dask.array
import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from dask.callbacks import Callback

from attnpanel import MultiHeadSelfAttention, load, save, trace
from attnpanel.traces import io

SUFFIXES = (".nc", ".zarr")


def make_trace(mask="causal", batch=4, length=24, d_model=16, n_heads=4) -> xr.Dataset:
    layer = MultiHeadSelfAttention(d_model, n_heads, mask=mask)
    time = pd.date_range("2024-03-01 06:00", periods=length, freq="min")
    tokens = [[f"t{b}_{i}" for i in range(length)] for b in range(batch)]
    return trace(layer, torch.randn(batch, length, d_model), time=time, tokens=tokens)


def write_raw(ds: xr.Dataset, path: pathlib.Path) -> None:
    """Write without :func:`save`'s validation, as a foreign or damaged file would be."""
    if path.suffix == ".nc":
        ds.to_netcdf(path, engine="h5netcdf")
    else:
        ds.to_zarr(path, mode="w", zarr_format=2)


def assert_lossless(ds: xr.Dataset, back: xr.Dataset) -> None:
    xr.testing.assert_identical(back, ds)
    for name, var in ds.variables.items():
        assert back[name].dtype == var.dtype, name
    assert {k: type(v) for k, v in back.attrs.items()}.keys() == ds.attrs.keys()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip_is_lossless(tmp_path, suffix):
    ds = make_trace()
    assert ds.time.dtype == np.dtype("datetime64[ns]")
    path = save(ds, tmp_path / f"trace{suffix}")
    back = load(path)
    assert_lossless(ds, back)
    assert back.token.values[3, 5] == "t3_5"
    assert pd.Timestamp(back.time.values[-1]) == pd.Timestamp("2024-03-01 06:23")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_custom_mask_and_per_sample_time_round_trip(tmp_path, suffix):
    blocked = np.eye(6, dtype=bool)[::-1].copy()
    layer = MultiHeadSelfAttention(8, 2, mask=torch.from_numpy(blocked))
    time = np.array(
        [pd.date_range(f"2024-01-0{d}", periods=6, freq="min") for d in (1, 2)], "datetime64[ns]"
    )
    ds = trace(layer, torch.randn(2, 6, 8), time=time)
    back = load(save(ds, tmp_path / f"custom{suffix}"))
    assert_lossless(ds, back)
    assert back["mask"].dtype == bool
    np.testing.assert_array_equal(back["mask"].values, blocked)


def test_cross_format_round_trip(tmp_path):
    ds = make_trace()
    from_nc = load(save(ds, tmp_path / "a.nc"))
    from_zarr = load(save(from_nc, tmp_path / "b.zarr"))
    again = load(save(from_zarr, tmp_path / "c.nc"))
    assert_lossless(ds, again)


def test_zarr_chunks_are_one_map(tmp_path):
    save(make_trace(batch=2, length=24), tmp_path / "t.zarr")
    ds = xr.open_zarr(tmp_path / "t.zarr")
    assert ds.weights.encoding["chunks"] == (1, 1, 24, 24)
    assert ds.q.encoding["chunks"][0] == 1


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_missing_file(tmp_path, suffix):
    with pytest.raises(FileNotFoundError, match="no trace at .*nowhere"):
        load(tmp_path / f"nowhere{suffix}")


def test_unknown_suffix(tmp_path):
    (tmp_path / "trace.pkl").write_bytes(pickle.dumps({"weights": 1}))
    with pytest.raises(ValueError, match=r"unknown trace format '.pkl'.*use one of .nc, .zarr"):
        load(tmp_path / "trace.pkl")
    with pytest.raises(ValueError, match="unknown trace format"):
        save(make_trace(), tmp_path / "trace.json")


def test_corrupted_netcdf(tmp_path):
    path = tmp_path / "junk.nc"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=r"cannot read .*junk.nc as a netcdf trace"):
        load(path)


def test_corrupted_zarr_chunk(tmp_path):
    path = save(make_trace(), tmp_path / "t.zarr")
    chunk = next(p for p in (path / "weights").iterdir() if not p.name.startswith("."))
    chunk.write_bytes(b"not a compressed chunk")
    with pytest.raises(ValueError, match=r"cannot read .*t.zarr as a zarr trace"):
        load(path)
    (tmp_path / "file.zarr").write_text("a file, not a store")
    with pytest.raises(ValueError, match="a .zarr trace is a directory"):
        load(tmp_path / "file.zarr")


def test_pickle_codec_is_refused_before_decoding(tmp_path):
    """A zarr store whose chunks are pickles would run code when read: it is refused."""
    path = tmp_path / "evil.zarr"
    sentinel = tmp_path / "code-ran"
    (path / "weights").mkdir(parents=True)
    (path / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
    (path / "weights" / ".zarray").write_text(
        json.dumps(
            {
                "zarr_format": 2,
                "shape": [1],
                "chunks": [1],
                "dtype": "|O",
                "compressor": None,
                "fill_value": None,
                "filters": [{"id": "pickle", "protocol": 5}],
                "order": "C",
            }
        )
    )
    (path / "weights" / ".zattrs").write_text(json.dumps({"_ARRAY_DIMENSIONS": ["batch"]}))

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (sentinel,))

    (path / "weights" / "0").write_bytes(pickle.dumps(np.array([Payload()], dtype=object)))
    with pytest.raises(ValueError, match="asks for the 'pickle' codec, which runs code"):
        load(path)
    assert not sentinel.exists()


def damaged(ds: xr.Dataset, name: str, index: tuple, value: float) -> xr.Dataset:
    ds = ds.copy(deep=True)
    ds[name].values[index] = value
    return ds


BAD_VALUES = [
    ("weights", (1, 2, 3, 4), np.nan, "weights contains NaN at batch=1, head=2, query=3, key=4"),
    ("weights", (3, 0, 9, 1), np.inf, "weights contains Inf at batch=3, head=0, query=9, key=1"),
    ("x", (2, 7, 5), -np.inf, "x contains Inf at batch=2, position=7, feature=5"),
    ("output", (0, 11, 3), np.nan, "output contains NaN at batch=0, position=11, feature=3"),
    ("weights", (2, 1, 8, 2), -0.125, "weights are negative at batch=2, head=1, query=8, key=2"),
    (
        "weights",
        (0, 3, 17, 0),
        0.9,
        "weights rows must sum to 1, but the row at batch=0, head=3, query=17 sums to",
    ),
]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize(("variable", "index", "value", "message"), BAD_VALUES)
def test_bad_values_are_named_with_their_location(
    tmp_path, suffix, variable, index, value, message
):
    path = tmp_path / f"bad{suffix}"
    write_raw(damaged(make_trace(), variable, index, value), path)
    with pytest.raises(ValueError, match=rf"bad{suffix} is not a valid trace: {message}"):
        load(path)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_wrong_and_missing_dims_are_named(tmp_path, suffix):
    ds = make_trace()
    cases = {
        "renamed": (
            ds.rename_dims(key="keys"),
            r"scores has dims .*\(missing key; unexpected keys",
        ),
        "dropped": (
            ds.assign(weights=ds.weights.isel(key=0, drop=True)),
            r"weights has dims \('batch', 'head', 'query'\).* \(missing key\)",
        ),
        "absent": (ds.drop_vars("weights"), "trace has no 'weights' variable"),
        "swapped": (
            ds.assign(q=ds.q.transpose("head", "batch", "position", "head_dim")),
            r"q has dims \('head', 'batch'.*in the wrong order",
        ),
    }
    for name, (bad, message) in cases.items():
        path = tmp_path / f"{name}{suffix}"
        write_raw(bad, path)
        with pytest.raises(ValueError, match=rf"{name}{suffix} is not a valid trace: {message}"):
            load(path)


def test_save_refuses_an_invalid_trace(tmp_path):
    with pytest.raises(ValueError, match="weights contains NaN"):
        save(damaged(make_trace(), "weights", (0, 0, 0, 0), np.nan), tmp_path / "t.nc")
    assert not (tmp_path / "t.nc").exists()


class LargestResult(Callback):
    """Records the largest array any dask task returned."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def _posttask(self, key, result, dsk, state, id):
        self.largest = max(self.largest, getattr(result, "nbytes", 0))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_large_traces_open_lazily_and_validate_chunk_by_chunk(tmp_path, monkeypatch, suffix):
    ds = make_trace(batch=6, length=40)
    path = save(ds, tmp_path / f"big{suffix}")
    one_sample = ds.weights.nbytes // 6
    monkeypatch.setattr(io, "LAZY_BYTES", ds.weights.nbytes // 2)
    monkeypatch.setattr(io, "LAZY_CHUNK_BYTES", one_sample)
    with LargestResult() as tasks:
        lazy = load(path)
    assert isinstance(lazy.weights.data, dask.array.Array)
    assert isinstance(lazy.scores.data, dask.array.Array)
    assert lazy.weights.data.chunks[0] == (1,) * 6
    assert 0 < tasks.largest <= one_sample  # no task ever held more than one sample
    xr.testing.assert_identical(lazy.load(), ds)
    eager = load(path, lazy=False)
    assert isinstance(eager.weights.data, np.ndarray)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_lazy_validation_finds_the_bad_chunk(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"big{suffix}"
    write_raw(damaged(make_trace(), "weights", (3, 2, 5, 7), np.nan), path)  # contiguous
    monkeypatch.setattr(io, "LAZY_BYTES", 1)
    with pytest.raises(ValueError, match="weights contains NaN at batch=3, head=2, query=5, key=7"):
        load(path)


def test_a_zarr_v3_store_loads_as_one_trace(tmp_path):
    """In zarr v3 every array's folder holds a zarr.json: only a group's is a group."""
    import warnings

    import attnpanel

    ds = attnpanel.demo(n_windows=2)
    path = tmp_path / "v3.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: fixed-length strings have no v3 spec yet
        ds.to_zarr(path, zarr_format=3, consolidated=False)
        back = attnpanel.load(path)
    assert isinstance(back, xr.Dataset)
    np.testing.assert_array_equal(back["weights"].values, ds["weights"].values)


def test_a_reference_series_with_no_reading_saves_as_explore_shows_it(tmp_path):
    """NaN in ``signal`` / ``truth`` / ``prediction`` is "no reading here" (a gap, a
    token's place): ``save`` and ``load`` keep it as ``explore`` draws it; Inf is refused."""
    ds = make_trace()
    signal = np.random.default_rng(0).random((ds.sizes["batch"], ds.sizes["position"]))
    signal[:, -1] = np.nan
    ds = ds.assign(signal=(("batch", "position"), signal))
    save(ds, tmp_path / "gap.nc")
    back = load(tmp_path / "gap.nc")
    np.testing.assert_array_equal(np.isnan(back["signal"].values), np.isnan(signal))
    signal[1, 2] = np.inf
    with pytest.raises(ValueError, match="signal contains Inf at batch=1, position=2"):
        save(ds.assign(signal=(("batch", "position"), signal)), tmp_path / "inf.nc")


def test_info_of_a_trace_with_a_position_without_time(tmp_path, capsys):
    """A position without a time (NaT) is shown by its index; ``attnpanel info`` exits 0."""
    from attnpanel.cli.main import main

    ds = make_trace().drop_vars("token")
    time = np.arange(ds.sizes["position"]).astype("datetime64[m]").astype("datetime64[ns]")
    time[-1] = np.datetime64("NaT")
    save(ds.assign_coords(time=("position", time)), tmp_path / "nat.nc")
    assert main(["info", str(tmp_path / "nat.nc")]) == 0
    last = ds.sizes["position"] - 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:1] == [str(last)] for line in lines)  # its row: no time
    assert any(line.split()[:1] == [f"{last - 1}@00:{last - 1:02d}"] for line in lines)


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_load_of_some_samples_reads_and_validates_those_alone(tmp_path, suffix):
    """``load(path, samples=[k])``: sample ``k`` as the whole load has it, its number kept in
    the batch coordinate; another sample's corrupt value is neither read nor refused (a
    figure of one sample read every one of the demo's 32 windows: 3.3 s of its 4)."""
    ds = make_trace(batch=4)
    ds["weights"][0, 0, 0, 0] = np.nan  # sample 0 is corrupt; sample 2 is not
    path = tmp_path / f"t{suffix}"
    write_raw(ds, path)
    with pytest.raises(ValueError, match="NaN"):
        load(path)
    two = load(path, samples=[2])
    assert two.sizes["batch"] == 1 and two["batch"].values.tolist() == [2]
    np.testing.assert_array_equal(two["weights"].values[0], ds["weights"].values[2])
    with pytest.raises(
        IndexError, match="sample 4 is out of range: the trace has 4 samples, 0 to 3"
    ):
        load(path, samples=[4])

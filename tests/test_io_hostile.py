"""Hostile trace files (issue #11): each gets an error, never code, other files, or the
machine's memory.

Every hostile file below is one that the reader (xarray, h5py, zarr) opens without
complaint: where it matters, the test shows the reader following it to another file before
showing that :func:`attnpanel.load` refuses it, and refuses it before any data is read.
"""

from __future__ import annotations

import json
import os
import shutil

import h5netcdf
import h5py
import numpy as np
import pytest
import torch
import xarray as xr
from dask.callbacks import Callback
from test_cli import run_cli

from attnpanel import MultiHeadSelfAttention, load, save, trace
from attnpanel.cli import main
from attnpanel.kernels import memory as memory_rules
from attnpanel.traces import io
from attnpanel.traces.schema import ATTENTION_DIMS

SUFFIXES = (".nc", ".zarr")
# hand-made files: no consolidated zarr metadata, stored chunks that the dask chunks split
pytestmark = [
    pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata"),
    pytest.mark.filterwarnings("ignore:The specified chunks separate the stored chunks"),
]


def small_trace(batch: int = 2, length: int = 8) -> xr.Dataset:
    layer = MultiHeadSelfAttention(8, 2, mask="causal")
    tokens = [[f"t{b}_{i}" for i in range(length)] for b in range(batch)]
    return trace(layer, torch.randn(batch, length, 8), tokens=tokens)


class Tasks(Callback):
    """Counts the dask tasks run (every read of a lazily opened file is one)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.largest = 0

    def _posttask(self, key, result, dsk, state, id):
        self.count += 1
        self.largest = max(self.largest, getattr(result, "nbytes", 0))


@pytest.fixture
def memory(monkeypatch):
    """Sets the bytes a load may use, so that a size check means the same on any machine."""

    def limit(n_bytes: int) -> None:
        monkeypatch.setattr(memory_rules, "MAX_ATTENTION_BYTES", n_bytes)

    return limit


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trips_of_a_dataset_and_a_datatree_still_work(tmp_path, suffix, lazy):
    ds = small_trace()
    back = load(save(ds, tmp_path / f"one{suffix}"), lazy=lazy)
    xr.testing.assert_identical(back.load(), ds)
    tree = xr.DataTree.from_dict({"/encoder": small_trace(), "/decoder": small_trace(3, 5)})
    tree.attrs = {"source": "two groups"}
    back = load(save(tree, tmp_path / f"tree{suffix}"), lazy=lazy)
    assert isinstance(back, xr.DataTree) and back.attrs == tree.attrs
    for group in ("encoder", "decoder"):
        stored = back[group].to_dataset(inherit=False)
        assert (stored.weights.chunks is not None) == lazy
        xr.testing.assert_identical(stored.load(), tree[group].to_dataset(inherit=False))


# zarr stores: links, special files, the pickle codec in every metadata document


def pickle_folder(path):
    """A folder whose metadata asks for the pickle codec (it holds no chunk to decode)."""
    path.mkdir()
    metadata = {
        "zarr_format": 2,
        "shape": [2, 2, 8, 8],
        "chunks": [1, 1, 8, 8],
        "dtype": "|O",
        "compressor": None,
        "fill_value": None,
        "filters": [{"id": "pickle", "protocol": 5}],
        "order": "C",
    }
    (path / ".zarray").write_text(json.dumps(metadata))
    (path / ".zattrs").write_text(json.dumps({"_ARRAY_DIMENSIONS": list(ATTENTION_DIMS)}))
    return path


@pytest.mark.parametrize("member", ["weights", "weights/.zarray", "pickle"])
def test_a_link_inside_a_zarr_store_is_refused(tmp_path, member):
    path = save(small_trace(), tmp_path / "t.zarr")
    other = save(small_trace(), tmp_path / "other.zarr")  # another trace's data
    if member == "pickle":
        # The old check walked the store without following links, so it never read this
        # metadata; a zarr release that decodes pickle would then have run the chunks.
        target = pickle_folder(tmp_path / "evil")
        member = "weights"
    else:
        target = other / member
    link = path / member
    shutil.rmtree(link) if link.is_dir() else link.unlink()
    link.symlink_to(target, target_is_directory=target.is_dir())
    if target.parent == other:  # the reader follows the link into the other store
        read = xr.open_zarr(path).weights.values
        np.testing.assert_array_equal(read, xr.open_zarr(other).weights.values)
    with pytest.raises(ValueError, match=rf"t\.zarr/{member} is a symbolic link \(to .*"):
        load(path)


def test_a_linked_chunk_and_a_named_pipe_in_a_zarr_store_are_refused(tmp_path):
    path = save(small_trace(), tmp_path / "t.zarr")
    secret = tmp_path / "secret.txt"
    secret.write_text("a file of the machine, not of the store")
    (path / "weights" / "0.0.0.0").unlink()
    (path / "weights" / "0.0.0.0").symlink_to(secret)
    with pytest.raises(ValueError, match=r"weights/0\.0\.0\.0 is a symbolic link \(to .*secret"):
        load(path)
    (path / "weights" / "0.0.0.0").unlink()
    os.mkfifo(path / "weights" / "0.0.0.0")  # a read of it would wait forever
    with pytest.raises(ValueError, match=r"0\.0\.0\.0 is neither a file nor a folder"):
        load(path)


def test_a_store_given_as_a_link_is_followed_once(tmp_path):
    ds = small_trace()
    save(ds, tmp_path / "t.zarr")
    (tmp_path / "link.zarr").symlink_to(tmp_path / "t.zarr", target_is_directory=True)
    xr.testing.assert_identical(load(tmp_path / "link.zarr"), ds)
    (tmp_path / "t.zarr" / "weights" / "0.0.0.0").unlink()
    (tmp_path / "t.zarr" / "weights" / "0.0.0.0").symlink_to(tmp_path / "t.zarr" / ".zgroup")
    with pytest.raises(ValueError, match="is a symbolic link"):
        load(tmp_path / "link.zarr")


def test_consolidated_and_v3_metadata_are_checked_for_the_pickle_codec(tmp_path):
    path = save(small_trace(), tmp_path / "t.zarr")
    consolidated = json.loads((path / ".zmetadata").read_text())
    consolidated["metadata"]["weights/.zarray"]["filters"] = [{"id": "pickle", "protocol": 5}]
    (path / ".zmetadata").write_text(json.dumps(consolidated))  # weights/.zarray stays clean
    with pytest.raises(ValueError, match=r"\.zmetadata asks for the 'pickle' codec"):
        load(path)
    path = save(small_trace(), tmp_path / "v3.zarr")
    (path / "extra").mkdir()
    v3 = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [2],
        "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
        "codecs": [{"name": "numcodecs.pickle", "configuration": {"protocol": 5}}],
    }
    (path / "extra" / "zarr.json").write_text(json.dumps(v3))
    with pytest.raises(ValueError, match=r"extra/zarr\.json asks for the 'numcodecs\.pickle'"):
        load(path)


# netCDF (HDF5) files: data kept in, or linked from, other files


def replace_dataset(handle: h5py.File, name: str, make) -> None:
    """Put ``make(shape, dtype)`` in place of a netCDF variable, on the same dimensions."""
    old = handle[name]
    shape, dtype = old.shape, old.dtype
    dims = [old.dims[i][0].name for i in range(old.ndim)]
    attrs = {k: v for k, v in old.attrs.items() if k != "DIMENSION_LIST"}
    for i, dim in enumerate(dims):
        old.dims[i].detach_scale(handle[dim])
    del handle[name]
    new = make(shape, dtype)
    for i, dim in enumerate(dims):
        new.dims[i].attach_scale(handle[dim])
    new.attrs.update(attrs)


def test_hdf5_external_storage_is_refused(tmp_path):
    """The issue's file: tokens stored in another local file, shown as the served tokens."""
    path = save(small_trace(), tmp_path / "hostile.nc")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"PASSWORD" * 64)
    with h5py.File(path, "r+") as handle:
        replace_dataset(
            handle,
            "token",
            lambda shape, _: handle.create_dataset(
                "token", shape=shape, dtype="S8", external=[(str(secret), 0, 16 * 8)]
            ),
        )
    assert xr.open_dataset(path, engine="h5netcdf").token.values[0, 0] == b"PASSWORD"
    with pytest.raises(
        ValueError, match=r"variable token keeps its data in .*secret\.txt \(HDF5 external storage"
    ):
        load(path)
    result = run_cli("info", str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("attnpanel: error: ") and "external storage" in result.stderr


def test_hdf5_external_link_is_refused(tmp_path):
    other = save(small_trace(), tmp_path / "other.nc")
    path = save(small_trace(), tmp_path / "hostile.nc")
    with h5py.File(path, "r+") as handle:
        handle["extra"] = h5py.ExternalLink(str(other), "/x")
    opened = xr.open_dataset(path, engine="h5netcdf")  # the reader follows it
    np.testing.assert_array_equal(opened.extra.values, load(other).x.values)
    with pytest.raises(ValueError, match=r"/extra is an external link to /x in .*other\.nc"):
        load(path)


def test_hdf5_virtual_dataset_is_refused(tmp_path):
    other = save(small_trace(), tmp_path / "other.nc")
    path = save(small_trace(), tmp_path / "hostile.nc")
    with h5py.File(path, "r+") as handle:

        def virtual(shape, dtype):
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(other), "weights", shape=shape)
            return handle.create_virtual_dataset("weights", layout)

        replace_dataset(handle, "weights", virtual)
    opened = xr.open_dataset(path, engine="h5netcdf")  # the other file's weights
    np.testing.assert_array_equal(opened.weights.values, load(other).weights.values)
    with pytest.raises(
        ValueError, match=r"variable weights is a virtual dataset mapped from .*other"
    ):
        load(path)


# declared sizes that cannot fit in memory


def sparse_trace(path, shape: tuple, fill: float, chunks: tuple | None = None):
    """A trace of ``weights`` alone, declared ``shape`` but never written: each cell reads
    as ``fill`` and the file stays a few KB whatever it declares."""
    if path.suffix == ".nc":
        with h5netcdf.File(path, "w") as handle:
            handle.dimensions = dict(zip(ATTENTION_DIMS, shape, strict=True))
            handle.create_variable(
                "weights", ATTENTION_DIMS, "f4", chunks=chunks, fillvalue=np.float32(fill)
            )
        with h5py.File(path, "r+") as handle:
            del handle["weights"].attrs["_FillValue"]  # else xarray reads the cells as NaN
        return path
    (path / "weights").mkdir(parents=True)
    (path / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
    metadata = {
        "zarr_format": 2,
        "shape": list(shape),
        "chunks": list(chunks or shape),
        "dtype": "<f4",
        "compressor": None,
        "fill_value": fill,
        "filters": None,
        "order": "C",
    }
    (path / "weights" / ".zarray").write_text(json.dumps(metadata))
    (path / "weights" / ".zattrs").write_text(json.dumps({"_ARRAY_DIMENSIONS": ATTENTION_DIMS}))
    return path


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_the_issues_sparse_file_is_refused_before_any_read(tmp_path, memory, suffix):
    """7.5 KB declaring 40,000 x 40,000 weights whose rows sum to 1: before, it passed
    validation and `attnpanel info` was killed by the kernel at 17.9 GB."""
    path = sparse_trace(tmp_path / f"hostile{suffix}", (1, 1, 40_000, 40_000), 1 / 40_000)
    assert sum(f.stat().st_size for f in [path, *path.rglob("*")] if f.is_file()) < 16_000
    memory(8 * 2**30)
    message = (
        r"weights has shape \(1, 1, 40000, 40000\); one sample of it needs 17\.9 GiB to be "
        r"viewed \(read, then computed in float64\), but only 8 GiB of memory may be used"
    )
    with Tasks() as tasks:
        for lazy in (None, True, False):
            with pytest.raises(ValueError, match=message):
                load(path, lazy=lazy)
    assert tasks.count == 0  # nothing was read


def test_info_on_the_sparse_file_prints_one_line(tmp_path, memory, capsys):
    path = sparse_trace(tmp_path / "hostile.nc", (1, 1, 40_000, 40_000), 1 / 40_000)
    memory(8 * 2**30)
    assert main(["info", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("attnpanel: error: ") and captured.err.count("\n") == 1
    assert "needs 17.9 GiB" in captured.err and "Traceback" not in captured.err


def test_an_eager_load_that_cannot_fit_is_refused_and_lazy_reads_it(tmp_path, memory, monkeypatch):
    path = sparse_trace(tmp_path / "big.nc", (8, 1, 1000, 1000), 1 / 1000)  # 30.5 MiB
    memory(16 * 2**20)
    monkeypatch.setattr(io, "LAZY_CHUNK_BYTES", 4 * 2**20)
    with pytest.raises(
        ValueError,
        match=r"loading it needs 30\.5 MiB \(weights has shape \(8, 1, 1000, 1000\), 30\.5 MiB\), "
        r"but only 16 MiB of memory may be used; load it with lazy=True",
    ):
        load(path, lazy=False)
    with Tasks() as tasks:
        lazy = load(path)  # by default, what cannot be held whole stays on disk
    assert lazy.weights.chunks is not None
    assert 0 < tasks.largest <= 4 * 2**20


def test_a_stored_chunk_that_cannot_fit_is_refused(tmp_path, memory, monkeypatch):
    shape = (8, 1, 500, 500)
    path = sparse_trace(tmp_path / "chunked.nc", shape, 1 / 500, chunks=shape)  # one 7.6 MiB chunk
    memory(4 * 2**20)
    monkeypatch.setattr(io, "LAZY_CHUNK_BYTES", 2**20)
    with Tasks() as tasks:
        with pytest.raises(
            ValueError,
            match=r"weights is stored in chunks of shape \(8, 1, 500, 500\), 7\.63 MiB each, and "
            r"a chunk is decoded whole, but only 4 MiB of memory may be used",
        ):
            load(path)
        with pytest.raises(ValueError, match=r"only 4 MiB of memory may be used$"):
            load(path, lazy=False)  # and lazy=True is not suggested: it would not help
    assert tasks.count == 0


def test_coordinates_too_large_to_index_are_refused_before_opening(tmp_path, memory):
    path = tmp_path / "long.nc"
    length = 2**27  # the query and key coordinates: 1 GiB of int64 each, never written
    with h5netcdf.File(path, "w") as handle:
        handle.dimensions = dict(zip(ATTENTION_DIMS, (1, 1, length, length), strict=True))
        for dim in ("query", "key"):
            handle.create_variable(dim, (dim,), "i8")
        handle.create_variable("weights", ATTENTION_DIMS, "f4", chunks=(1, 1, 1, 1024))
    assert path.stat().st_size < 64_000
    memory(2**30)
    with pytest.raises(
        ValueError,
        match=r"opening it reads its 1-D arrays whole, 2 GiB in all \((query|key) has shape "
        r"\(134217728,\)\), but only 1 GiB",
    ):
        load(path)

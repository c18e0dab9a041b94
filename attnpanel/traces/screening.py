"""Screening a stored trace before any of its data is read.

A file is refused, with a message naming it and the reason, when reading it could run code
(a zarr codec that unpickles), reach outside it (external links, external storage, virtual
datasets, symbolic links inside a store) or need more memory than may be used (declared
sizes of the whole trace, of one stored or dask chunk, of one sample of an attention map;
a stored chunk that decodes past its declared size, :mod:`attnpanel.traces.bombs`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xarray as xr

from attnpanel.kernels.memory import available_memory
from attnpanel.traces import bombs

_ZARR_METADATA = {".zarray", ".zgroup", ".zattrs", ".zmetadata", "zarr.json"}


METADATA_BYTES = 64 * 2**20  # a zarr metadata file larger than this is refused unread


VIEW_ITEMSIZE = 8  # views and summaries hold one sample of every head again as float64


class _Declared(NamedTuple):
    """An array as a file's metadata declares it, before anything of it is read."""

    name: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * self.itemsize


def _size(n_bytes: int) -> str:
    unit, scale = ("GiB", 2**30) if n_bytes >= 2**30 else ("MiB", 2**20)
    return f"{n_bytes / scale:.3g} {unit}"


def _codec_names(metadata) -> list[str]:
    """Every codec ``id`` (zarr v2) or ``name`` (zarr v3) in a parsed metadata document."""
    names = []
    if isinstance(metadata, dict):
        for key, value in metadata.items():
            if key in ("id", "name") and isinstance(value, str):
                names.append(value)
            else:
                names.extend(_codec_names(value))
    elif isinstance(metadata, list):
        for item in metadata:
            names.extend(_codec_names(item))
    return names


def _refuse_code(metadata_path: Path, metadata) -> None:
    """Raise if zarr metadata asks for a codec that could run code when it decodes.

    numcodecs' ``pickle`` codec unpickles chunk bytes, which executes whatever an
    attacker put there; a trace never needs it.
    """
    unsafe = [n for n in _codec_names(metadata) if "pickle" in n.lower()]
    if unsafe:
        raise ValueError(
            f"{metadata_path} asks for the {unsafe[0]!r} codec, which runs code when "
            "it decodes data; refusing to read an untrusted trace"
        )


def _store_files(path: Path) -> list[Path]:
    """Every file in a zarr store; a link, or anything but a file or a folder, is refused.

    A link leads out of the store: its metadata could come from another folder (one that
    asks for the pickle codec) and its chunks from any file on the machine.
    """
    files, folders = [], [path]
    while folders:  # not recursive: a store nested thousands of folders deep is no error
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise ValueError(
                        f"{entry.path} is a symbolic link (to {os.readlink(entry.path)}); "
                        "a zarr trace holds its own files, refusing to follow it out of the store"
                    )
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    files.append(Path(entry.path))
                else:
                    raise ValueError(
                        f"{entry.path} is neither a file nor a folder; "
                        "a zarr trace holds only those"
                    )
    return files


def _read_metadata(metadata_path: Path):
    size = metadata_path.stat().st_size
    if size > METADATA_BYTES:
        raise ValueError(
            f"{metadata_path} holds {_size(size)} of zarr metadata, more than any trace needs "
            f"({_size(METADATA_BYTES)}); refusing to read it"
        )
    try:
        return json.loads(metadata_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{metadata_path} is not valid zarr metadata: {error}") from error


def _zarr_shape(metadata_path: Path, shape) -> tuple[int, ...]:
    if isinstance(shape, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        return tuple(shape)
    raise ValueError(f"{metadata_path} declares the shape {shape!r}, which is not a list of sizes")


def _zarr_arrays(metadata_path: Path, metadata, name: str) -> list[_Declared]:
    """The arrays a metadata document declares: itself (``.zarray``, an array's
    ``zarr.json``) or those it consolidates (``.zmetadata``, a group's ``zarr.json``)."""
    if not isinstance(metadata, dict):
        return []
    if "shape" in metadata and ("dtype" in metadata or "data_type" in metadata):
        shape = _zarr_shape(metadata_path, metadata["shape"])
        dtype = metadata.get("dtype", metadata.get("data_type"))
        return [_Declared(name, shape, bombs.zarr_itemsize(dtype))]
    found = []
    for key, value in metadata.items():
        child = name
        if key not in ("metadata", "consolidated_metadata"):
            child = "/".join(p for p in (name, key.removesuffix("/.zarray")) if p)
        found.extend(_zarr_arrays(metadata_path, value, child))
    return found


def _inspect_zarr(path: Path) -> tuple[list[_Declared], list[tuple[Path, object]], list[Path]]:
    """Every array a zarr store declares, its metadata documents and its files; links,
    code-running codecs and oversized or invalid metadata (``.zarray``, ``.zgroup``,
    ``.zattrs``, ``.zmetadata``, ``zarr.json``) are refused."""
    if not path.is_dir():
        raise ValueError(f"cannot read {path} as a zarr trace: a .zarr trace is a directory")
    declared, documents = [], []
    files = _store_files(path)
    for file in files:
        if file.name not in _ZARR_METADATA:
            continue
        metadata = _read_metadata(file)
        folder = file.parent.relative_to(path).as_posix()
        try:
            _refuse_code(file, metadata)
            declared.extend(_zarr_arrays(file, metadata, "" if folder == "." else folder))
        except RecursionError as error:
            raise ValueError(f"{file} is not valid zarr metadata: nested too deeply") from error
        documents.append((file, metadata))
    return declared, documents, files


def _refuse_external_links(path: Path, handle) -> None:
    """Raise for an HDF5 link that leads into another file (or is of no standard kind)."""
    import h5py

    links = []
    handle.id.links.visit(
        lambda name, info: links.append((name.decode(errors="replace"), info.type)), info=True
    )
    for name, kind in links:
        if kind == h5py.h5l.TYPE_EXTERNAL:
            link = handle.get(name, getlink=True)  # the link itself, not followed
            raise ValueError(
                f"{path}: /{name} is an external link to {link.path} in {link.filename}; "
                "a trace holds its own data and reads no other file"
            )
        if kind not in (h5py.h5l.TYPE_HARD, h5py.h5l.TYPE_SOFT):
            raise ValueError(f"{path}: /{name} is a user-defined HDF5 link; a trace has none")


def _refuse_outside_storage(path: Path, name: str, dataset) -> None:
    """Raise for a dataset whose bytes live in other files: external storage or a VDS."""
    if dataset.external:
        files = sorted({os.fsdecode(entry[0]) for entry in dataset.external})
        raise ValueError(
            f"{path}: variable {name} keeps its data in {', '.join(files)} (HDF5 external "
            "storage); a trace holds its own data and reads no other file"
        )
    if dataset.is_virtual:
        sources = sorted({source.file_name for source in dataset.virtual_sources()})
        raise ValueError(
            f"{path}: variable {name} is a virtual dataset mapped from {', '.join(sources)}; "
            "a trace holds its own data and reads no other file"
        )


def _inspect_netcdf(path: Path) -> list[_Declared]:
    """Every dataset of a netCDF (HDF5) file; links to other files, external raw storage
    and virtual datasets are refused."""
    import h5py

    if not path.is_file():  # a folder, or a device or pipe that a read would never finish
        raise ValueError(f"cannot read {path} as a netcdf trace: a .nc trace is a file")
    declared = []

    def inspect(name: str, item) -> None:
        if isinstance(item, h5py.Dataset):
            _refuse_outside_storage(path, name, item)
            declared.append(_Declared(name, tuple(item.shape or ()), item.dtype.itemsize))

    try:
        with h5py.File(path, "r") as handle:
            _refuse_external_links(path, handle)  # first: the walk below must not follow one
            handle.visititems(inspect)  # hard links only
    except OSError as error:
        raise ValueError(f"cannot read {path} as a netcdf trace: {error}") from error
    return declared


def refuse_unsafe_storage(path: Path, fmt: str, budget: int | None = None) -> None:
    """Refuse, before any data is read, what no trace holds: code to run, data kept in
    other files, coordinates too large to index, or a stored chunk that is, or decodes
    to, more than its array declares (a compression bomb).

    Opening a file reads every 1-D coordinate whole (xarray makes them indexes), so all
    1-D arrays must fit in ``budget`` bytes (by default, the memory that may be used).
    """
    budget = available_memory() if budget is None else budget
    try:
        if fmt == "zarr":
            declared, documents, files = _inspect_zarr(path)
        else:
            declared = _inspect_netcdf(path)
    except OSError as error:  # an unreadable folder or file of a store
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error
    indexes = [array for array in declared if len(array.shape) == 1]
    needed = sum(array.nbytes for array in indexes)
    if needed > budget:
        largest = max(indexes, key=lambda array: array.nbytes)
        raise ValueError(
            f"{path}: opening it reads its 1-D arrays whole, {_size(needed)} in all "
            f"({largest.name} has shape {largest.shape}), but only {_size(budget)} of memory "
            "may be used"
        )
    try:
        if fmt == "zarr":
            bombs.refuse_zarr_bombs(path, documents, files)
        else:
            bombs.refuse_hdf5_bombs(path)
    except OSError as error:
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error


def _stored_chunk_bytes(var: xr.Variable) -> int:
    """Bytes a reader decodes at once for any read of ``var``: one stored chunk (0 for
    contiguous storage, which is read slice by slice)."""
    stored = var.encoding.get("preferred_chunks") or {}
    if not stored:
        return 0
    cells = np.prod([stored.get(d, n) for d, n in var.sizes.items()], dtype=object)
    return int(cells) * var.dtype.itemsize


def _refuse_unviewable(path: Path, name: str, var: xr.Variable, budget: int) -> None:
    """Raise if one sample of an attention-shaped variable cannot be held to be viewed."""
    if "query" not in var.dims or "key" not in var.dims:
        return
    cells = np.prod([n for d, n in var.sizes.items() if d not in ("layer", "batch")], dtype=object)
    needed = int(cells) * (var.dtype.itemsize + VIEW_ITEMSIZE)
    if needed > budget:
        raise ValueError(
            f"{path}: {name} has shape {tuple(var.shape)}; one sample of it needs "
            f"{_size(needed)} to be viewed (read, then computed in float64), but only "
            f"{_size(budget)} of memory may be used"
        )


def _refuse_large_reads(path: Path, name: str, var: xr.Variable, budget: int) -> None:
    """Raise if a lazy read of ``var`` decodes a stored chunk or builds a dask chunk that
    cannot fit."""
    stored = _stored_chunk_bytes(var)
    if stored > budget:
        shape = tuple(var.encoding["preferred_chunks"].get(d, n) for d, n in var.sizes.items())
        raise ValueError(
            f"{path}: {name} is stored in chunks of shape {shape}, {_size(stored)} each, and "
            f"a chunk is decoded whole, but only {_size(budget)} of memory may be used"
        )
    if var.chunks:  # dask-backed; the others (indexes) are in memory already
        piece = tuple(max(sizes) for sizes in var.chunks)
        needed = int(np.prod(piece, dtype=object)) * var.dtype.itemsize
        if needed > budget:
            raise ValueError(
                f"{path}: {name} would be read in pieces of shape {piece}, {_size(needed)} "
                f"each, but only {_size(budget)} of memory may be used"
            )


def refuse_what_cannot_fit(
    path: Path, members: dict[str | None, xr.Dataset], lazy: bool, budget: int
) -> None:
    """Raise, before any data is read, if loading or viewing the opened groups could not
    fit in ``budget`` bytes: eagerly, everything at once; lazily, every single read."""
    variables = {
        f"{group}/{name}" if group else str(name): var
        for group, ds in members.items()
        for name, var in ds.variables.items()
    }
    for name, var in variables.items():
        _refuse_unviewable(path, name, var, budget)
    if lazy:
        for name, var in variables.items():
            _refuse_large_reads(path, name, var, budget)
        return
    total = sum(ds.nbytes for ds in members.values())
    if total > budget:
        name, largest = max(variables.items(), key=lambda item: item[1].nbytes)
        lazy_fits = all(_stored_chunk_bytes(var) <= budget for var in variables.values())
        hint = "; load it with lazy=True to keep it on disk and read it in chunks"
        raise ValueError(
            f"{path}: loading it needs {_size(total)} ({name} has shape {tuple(largest.shape)}, "
            f"{_size(largest.nbytes)}), but only {_size(budget)} of memory may be used"
            + (hint if lazy_fits else "")
        )

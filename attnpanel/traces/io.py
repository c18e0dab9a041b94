"""Lossless save and validated load of traces, as netCDF (``.nc``) or zarr (``.zarr``).

Large traces open lazily with dask: :func:`load` validates them in one streaming pass,
chunk by chunk, and returns a Dataset whose arrays are read only when a view asks for a
slice. Zarr traces are written in chunks of one (sample, head) map, so a view of one map
reads one chunk; netCDF files get HDF5 chunks of the same shape.

Every file is treated as hostile, and gets an error, never code, other files, or the
machine's memory. Before any data is read, :func:`load` refuses a zarr store that asks for
the pickle codec or holds a symbolic link, a netCDF file with an external link, external
storage or a virtual dataset, and declared sizes that cannot fit in the memory that may be
used; every reader failure on a corrupted file becomes a ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xarray as xr

from attnpanel.kernels.memory import available_memory
from attnpanel.traces.layers import groups
from attnpanel.traces.validate import validate
from attnpanel.traces.virtual import attach, detach
from attnpanel.util.files import check_target, write_safely

FORMATS = {".nc": "netcdf", ".zarr": "zarr"}
LAZY_BYTES = 256 * 2**20  # traces larger than this stay on disk until sliced
LAZY_CHUNK_BYTES = 32 * 2**20  # size of one dask chunk when a lazy trace is streamed
CHUNK_BYTES = 8 * 2**20  # target size of one zarr chunk of an attention-shaped array
MAP_DIMS = ("layer", "batch", "head")  # one chunk holds one attention map of these
ZARR_FORMAT = 2  # zarr v2 has a stable spec for the string `token` coordinate
_ZARR_METADATA = {".zarray", ".zgroup", ".zattrs", ".zmetadata", "zarr.json"}
METADATA_BYTES = 64 * 2**20  # a zarr metadata file larger than this is refused unread
VIEW_ITEMSIZE = 8  # views and summaries hold one sample of every head again as float64
_STALE_ENCODING = (
    "chunks",
    "preferred_chunks",
    "compressor",
    "compressors",
    "filters",
    "serializer",
    "shards",
    "zlib",
    "complevel",
    "shuffle",
    "fletcher32",
    "contiguous",
    "chunksizes",
    "source",
    "original_shape",
)


def _format(path: Path) -> str:
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"unknown trace format {path.suffix or '(no suffix)'!r} for {path}; "
            f"use one of {', '.join(FORMATS)}"
        ) from None


def _chunks(var: xr.Variable) -> dict[str, int]:
    """One chunk per (layer, sample, head) and, for attention maps, ~CHUNK_BYTES of rows."""
    chunks = {d: 1 for d in MAP_DIMS if d in var.dims}
    if "key" in var.dims and "query" in var.dims:
        row_bytes = var.sizes["key"] * var.dtype.itemsize
        chunks["query"] = max(1, min(var.sizes["query"], CHUNK_BYTES // max(row_bytes, 1)))
    return chunks


def _for_writing(ds: xr.Dataset, fmt: str) -> xr.Dataset:
    """A shallow copy without encodings from a previous read, zarr-chunked if needed; a
    virtual trace without its lazy maps (its ``lse`` gives them back on reading)."""
    ds = detach(ds).copy()
    for var in ds.variables.values():
        var.encoding = {k: v for k, v in var.encoding.items() if k not in _STALE_ENCODING}
    for name, var in list(ds.variables.items()):
        chunks = _chunks(var)
        if not chunks or name in ds.indexes:
            continue
        sizes = tuple(chunks.get(d, var.sizes[d]) for d in var.dims)
        if fmt == "netcdf":  # HDF5 chunks of the same shape: a lazy read of a map reads one
            var.encoding["chunksizes"] = sizes
        elif name in ds.data_vars:  # dask chunks, which to_zarr writes one by one
            ds[name] = ds[name].chunk(chunks)
        else:  # coordinates such as (batch, position) tokens
            ds = ds.assign_coords({name: var.chunk(chunks)})
    return ds


def save(ds: xr.Dataset | xr.DataTree, path: str | Path, overwrite: bool = False) -> Path:
    """Validate a trace and write it to ``path``; the suffix picks the format.

    Parameters
    ----------
    ds : xarray.Dataset or xarray.DataTree
        A trace (see :func:`attnpanel.trace`), in memory or lazy, or a capture of several
        groups (:func:`attnpanel.capture`), written as netCDF groups or zarr subgroups.
    path : str or Path
        ``*.nc`` (netCDF4 through h5netcdf) or ``*.zarr`` (a directory, zarr v2).
        The trace is written beside it and moved into place when complete: a failed or
        interrupted save leaves what was there untouched.
    overwrite : bool
        Replace an existing trace file or store at ``path``. Something that is not a
        netCDF file or zarr store is never replaced.

    Returns
    -------
    Path
        The written path.

    Raises
    ------
    ValueError
        For an unknown suffix, or a dataset that is not a valid trace.
    FileExistsError
        ``path`` exists and ``overwrite`` is false, or it is not a trace file or store.
    """
    path = Path(path)
    fmt = _format(path)
    check_target(path, fmt, overwrite)  # before any work
    if isinstance(ds, xr.DataTree):
        found = groups(ds)  # raises for a tree that holds no trace
        for group, member in found.items():
            _validate_named(member, group)
        out = xr.DataTree.from_dict(
            {f"/{group}": _for_writing(member, fmt) for group, member in found.items()}
        )
        out.attrs = dict(ds.attrs)
    else:
        validate(ds)
        out = _for_writing(ds, fmt)

    def write(target: Path) -> None:
        if fmt == "netcdf":
            out.to_netcdf(target, engine="h5netcdf")
        else:
            out.to_zarr(target, mode="w-", zarr_format=ZARR_FORMAT, consolidated=True)

    return write_safely(path, fmt, write, overwrite)


def _validate_named(ds: xr.Dataset, group: str) -> None:
    try:
        validate(ds)
    except ValueError as error:
        raise ValueError(f"group {group!r}: {error}") from error


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


def _zarr_itemsize(dtype) -> int:
    """Bytes per element of a zarr v2 ``dtype`` or v3 ``data_type``; 8 (one pointer) where
    numpy cannot tell, as for variable-length strings."""
    if isinstance(dtype, dict):  # a v3 data type with a configuration
        configuration = dtype.get("configuration")
        length = configuration.get("length_bytes") if isinstance(configuration, dict) else None
        return length if isinstance(length, int) and length > 0 else 8
    try:
        return np.dtype(dtype).itemsize
    except (TypeError, ValueError):
        return 8


def _zarr_arrays(metadata_path: Path, metadata, name: str) -> list[_Declared]:
    """The arrays a metadata document declares: itself (``.zarray``, an array's
    ``zarr.json``) or those it consolidates (``.zmetadata``, a group's ``zarr.json``)."""
    if not isinstance(metadata, dict):
        return []
    if "shape" in metadata and ("dtype" in metadata or "data_type" in metadata):
        shape = _zarr_shape(metadata_path, metadata["shape"])
        dtype = metadata.get("dtype", metadata.get("data_type"))
        return [_Declared(name, shape, _zarr_itemsize(dtype))]
    found = []
    for key, value in metadata.items():
        child = name
        if key not in ("metadata", "consolidated_metadata"):
            child = "/".join(p for p in (name, key.removesuffix("/.zarray")) if p)
        found.extend(_zarr_arrays(metadata_path, value, child))
    return found


def _inspect_zarr(path: Path) -> list[_Declared]:
    """Every array a zarr store declares; links, code-running codecs and oversized or
    invalid metadata (``.zarray``, ``.zgroup``, ``.zattrs``, ``.zmetadata``, ``zarr.json``)
    are refused."""
    if not path.is_dir():
        raise ValueError(f"cannot read {path} as a zarr trace: a .zarr trace is a directory")
    declared = []
    for file in _store_files(path):
        if file.name not in _ZARR_METADATA:
            continue
        metadata = _read_metadata(file)
        folder = file.parent.relative_to(path).as_posix()
        try:
            _refuse_code(file, metadata)
            declared.extend(_zarr_arrays(file, metadata, "" if folder == "." else folder))
        except RecursionError as error:
            raise ValueError(f"{file} is not valid zarr metadata: nested too deeply") from error
    return declared


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


def _refuse_unsafe_storage(path: Path, fmt: str, budget: int) -> None:
    """Refuse, before any data is read, what no trace holds: code to run, data kept in
    other files, or coordinates too large to index.

    Opening a file reads every 1-D coordinate whole (xarray makes them indexes), so all
    1-D arrays must fit in ``budget`` bytes.
    """
    try:
        declared = _inspect_zarr(path) if fmt == "zarr" else _inspect_netcdf(path)
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


def _open(path: Path, fmt: str, chunks: dict, group: str | None = None) -> xr.Dataset:
    if fmt == "netcdf":
        return xr.open_dataset(path, engine="h5netcdf", group=group, chunks=chunks)
    return xr.open_zarr(path, group=group, consolidated=None, chunks=chunks)


def _lazy_chunks(ds: xr.Dataset) -> dict[str, int]:
    """Dask chunks of about LAZY_CHUNK_BYTES: whole samples where they fit, else row blocks.

    Fewer, larger reads than one task per stored (sample, head) map make a streaming
    validation several times faster, while any one task still holds at most a few of them.
    """
    per_sample = 0
    for var in ds.data_vars.values():
        samples = int(np.prod([var.sizes[d] for d in ("layer", "batch") if d in var.dims]))
        per_sample = max(per_sample, var.nbytes // max(samples, 1))
    whole = dict.fromkeys(("head", "query", "key", "position"), -1)
    if per_sample <= LAZY_CHUNK_BYTES:
        return {"layer": 1, "batch": max(1, LAZY_CHUNK_BYTES // max(per_sample, 1)), **whole}
    row_bytes = max(ds.sizes.get("key", 1) * 8, 1)  # float64 at most
    rows = max(1, LAZY_CHUNK_BYTES // row_bytes)
    return {**whole, "layer": 1, "batch": 1, "head": 1, "query": rows}


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


def _refuse_what_cannot_fit(
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


def _close(members: dict) -> None:
    for ds in members.values():
        ds.close()


def _open_checked(
    path: Path, fmt: str, groups: list[str | None], lazy: bool | None, budget: int
) -> tuple[dict[str | None, xr.Dataset], bool]:
    """Each group opened (metadata and indexes only), dask-chunked where it stays on disk,
    and refused where it could not fit in memory; returns the groups and whether lazy."""
    members = {}
    try:
        for group in groups:
            members[group] = _open(path, fmt, {}, group)
        if lazy is None:
            lazy = sum(ds.nbytes for ds in members.values()) > min(LAZY_BYTES, budget)
        if lazy:
            for group, ds in members.items():
                chunks = _lazy_chunks(ds)
                ds.close()
                members[group] = _open(path, fmt, chunks, group)
    except Exception as error:  # any reader failure means the file is not a trace
        _close(members)
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error
    try:
        _refuse_what_cannot_fit(path, members, lazy, budget)
    except ValueError:
        _close(members)
        raise
    return members, lazy


def _validated(path: Path, fmt: str, ds: xr.Dataset, lazy: bool, group: str | None):
    """``ds`` read (unless lazy) and validated; closed on failure."""
    where = f"group {group!r}: " if group else ""
    try:
        if not lazy:
            ds = ds.load()  # small: validate in memory, where it is fastest
        ds = attach(ds)  # a virtual trace's maps, computed from q, k and lse on demand
        validate(ds)
    except MemoryError:
        ds.close()
        raise
    except Exception as error:  # a failed check, or a chunk that cannot be decoded
        ds.close()
        if isinstance(error, ValueError):
            raise ValueError(f"{path} is not a valid trace: {where}{error}") from error
        raise ValueError(f"cannot read {path} as a {fmt} trace: {where}{error}") from error
    if not lazy:
        ds.close()
    return ds


def _group_names(path: Path, fmt: str) -> list[str]:
    """The groups below the root that hold a trace; empty for a single-Dataset file."""
    try:
        if fmt == "netcdf":
            import h5py

            with h5py.File(path, "r") as handle:
                return [name for name, item in handle.items() if isinstance(item, h5py.Group)]
        return sorted(
            child.name
            for child in path.iterdir()
            if child.is_dir() and any((child / n).exists() for n in (".zgroup", "zarr.json"))
        )
    except OSError as error:
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error


def _root_attrs(path: Path, fmt: str) -> dict:
    try:
        with _open(path, fmt, {}) as root:
            return dict(root.attrs)
    except Exception as error:
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error


def load(path: str | Path, lazy: bool | None = None) -> xr.Dataset | xr.DataTree:
    """Read and validate a trace, refusing a hostile file before any of its data is read.

    Parameters
    ----------
    path : str or Path
        A ``.nc`` file or ``.zarr`` directory written by :func:`save`.
    lazy : bool, optional
        Keep the arrays on disk (dask) instead of reading them; by default, traces larger
        than :data:`LAZY_BYTES` (256 MiB) or than the memory that may be used stay lazy
        and are validated chunk by chunk, in dask chunks of about :data:`LAZY_CHUNK_BYTES`.

    Returns
    -------
    xarray.Dataset or xarray.DataTree
        A DataTree (one validated trace per group) for a file that :func:`save` wrote from
        one.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not a trace: unreadable or corrupted content, wrong or missing dims,
        NaN or Inf, negative weights, rows that do not sum to 1 (the message names the file,
        the variable and the first offending location). Also, before any data is read, if
        the file is hostile: a zarr store that asks for the pickle codec or holds a
        symbolic link; a netCDF file with an external link, external storage or a virtual
        dataset; or declared sizes that cannot fit in the memory that may be used
        (:func:`attnpanel.kernels.memory.available_memory`): the whole trace for an eager load,
        one stored or dask chunk for a lazy one, one sample of an attention map for either.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    fmt = _format(path)
    if fmt == "zarr" and path.is_symlink():
        path = path.resolve()  # the store may be a link; nothing inside it may
    budget = available_memory()
    _refuse_unsafe_storage(path, fmt, budget)
    names = _group_names(path, fmt)
    members, lazy = _open_checked(path, fmt, names or [None], lazy, budget)
    if not names:
        return _validated(path, fmt, members[None], lazy, None)
    loaded = {}
    for name in names:
        try:
            loaded[f"/{name}"] = _validated(path, fmt, members[name], lazy, name)
        except ValueError:
            _close(members)
            raise
    tree = xr.DataTree.from_dict(loaded)
    tree.attrs = _root_attrs(path, fmt)
    return tree

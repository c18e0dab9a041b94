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
from pathlib import Path

import numpy as np
import xarray as xr

from attnpanel.kernels.memory import available_memory
from attnpanel.traces import screening, upgrades
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


def check_samples(members: dict, samples: list[int] | None) -> None:
    """Refuse (IndexError) a sample one of the traces ``members`` (by group) does not have,
    naming how many it has."""
    for group, ds in members.items():
        n = ds.sizes.get("batch", 0)
        for sample in samples or ():
            if not 0 <= sample < n:
                where = f" (group {group})" if group else ""
                raise IndexError(
                    f"sample {sample} is out of range: the trace{where} has {n} "
                    f"sample{'s' if n != 1 else ''}, 0 to {n - 1}"
                )


def _cut(ds: xr.Dataset, samples: list[int] | None) -> xr.Dataset:
    """``ds``'s ``samples`` only (their batch coordinate keeps their numbers), before any
    of its data is read."""
    if samples is None:
        return ds
    if "batch" not in ds.coords:
        ds = ds.assign_coords(batch=np.arange(ds.sizes["batch"]))
    return ds.isel(batch=list(samples))


def _close(members: dict) -> None:
    for ds in members.values():
        ds.close()


def _open_checked(
    path: Path,
    fmt: str,
    groups: list[str | None],
    lazy: bool | None,
    budget: int,
    samples: list[int] | None = None,
) -> tuple[dict[str | None, xr.Dataset], bool]:
    """Each group opened (metadata and indexes only), cut to ``samples`` where given,
    dask-chunked where it stays on disk, and refused where it could not fit in memory;
    returns the groups and whether lazy."""
    members = {}
    try:
        for group in groups:
            members[group] = _open(path, fmt, {}, group)
        check_samples(members, samples)
        members = {group: _cut(ds, samples) for group, ds in members.items()}
        if lazy is None:
            lazy = sum(ds.nbytes for ds in members.values()) > min(LAZY_BYTES, budget)
        if lazy:
            for group, ds in members.items():
                chunks = _lazy_chunks(ds)
                ds.close()
                members[group] = _cut(_open(path, fmt, chunks, group), samples)
    except IndexError:
        _close(members)
        raise
    except Exception as error:  # any reader failure means the file is not a trace
        _close(members)
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error
    try:
        screening.refuse_what_cannot_fit(path, members, lazy, budget)
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
        ds = attach(upgrades.upgrade(ds))  # today's names; a virtual trace's maps on demand
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
        return sorted(child.name for child in path.iterdir() if _is_zarr_group(child))
    except OSError as error:
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error


def _is_zarr_group(folder: Path) -> bool:
    """A zarr v2 group, or a zarr v3 node whose metadata says group (in v3 every array's
    folder holds a ``zarr.json`` too)."""
    if not folder.is_dir():
        return False
    if (folder / ".zgroup").exists():
        return True
    metadata = folder / "zarr.json"
    if not metadata.is_file() or metadata.stat().st_size > screening.METADATA_BYTES:
        return False
    try:
        return json.loads(metadata.read_text(encoding="utf-8")).get("node_type") == "group"
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def _root_attrs(path: Path, fmt: str) -> dict:
    try:
        with _open(path, fmt, {}) as root:
            return dict(root.attrs)
    except Exception as error:
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error


def load(
    path: str | Path, lazy: bool | None = None, samples: list[int] | None = None
) -> xr.Dataset | xr.DataTree:
    """Read and validate a trace, refusing a hostile file before any of its data is read.

    Parameters
    ----------
    path : str or Path
        A ``.nc`` file or ``.zarr`` directory written by :func:`save`.
    lazy : bool, optional
        Keep the arrays on disk (dask) instead of reading them; by default, traces larger
        than :data:`LAZY_BYTES` (256 MiB) or than the memory that may be used stay lazy
        and are validated chunk by chunk, in dask chunks of about :data:`LAZY_CHUNK_BYTES`.
    samples : list of int, optional
        Read and validate these samples only, nothing of the others (a figure of one
        sample read the demo's 32 in 3.3 s); their ``batch`` coordinate keeps their
        numbers in the file.

    Returns
    -------
    xarray.Dataset or xarray.DataTree
        A DataTree (one validated trace per group) for a file that :func:`save` wrote from
        one.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    IndexError
        If one of ``samples`` is not in the trace (the message says how many there are).
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
    screening.refuse_unsafe_storage(path, fmt, budget)
    names = _group_names(path, fmt)
    members, lazy = _open_checked(path, fmt, names or [None], lazy, budget, samples)
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

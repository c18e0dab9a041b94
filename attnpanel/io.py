"""Lossless save and validated load of traces, as netCDF (``.nc``) or zarr (``.zarr``).

Large zarr traces open lazily with dask: :func:`load` validates them chunk by chunk and
returns a Dataset whose arrays are read only when a view asks for a slice.
"""

from __future__ import annotations

from pathlib import Path

import xarray as xr

from attnpanel.trace import validate

FORMATS = {".nc": "netcdf", ".zarr": "zarr"}
LAZY_BYTES = 256 * 2**20  # traces larger than this stay on disk until sliced


def _format(path: Path) -> str:
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"unknown trace format {path.suffix or '(no suffix)'!r} for {path}; "
            f"use one of {', '.join(FORMATS)}"
        ) from None


def save(ds: xr.Dataset, path: str | Path) -> Path:
    """Write a trace to ``path``; the suffix picks the format.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace (see :func:`attnpanel.trace`).
    path : str or Path
        ``*.nc`` (netCDF4 through h5netcdf) or ``*.zarr`` (a directory).

    Returns
    -------
    Path
        The written path.
    """
    path = Path(path)
    fmt = _format(path)
    validate(ds)
    if fmt == "netcdf":
        ds.to_netcdf(path, engine="h5netcdf")
    else:
        chunks = {d: 1 for d in ("batch", "layer") if d in ds.dims}
        ds.chunk(chunks).to_zarr(path, mode="w", consolidated=True)
    return path


def load(path: str | Path, lazy: bool | None = None) -> xr.Dataset:
    """Read and validate a trace.

    Parameters
    ----------
    path : str or Path
        A ``.nc`` file or ``.zarr`` directory written by :func:`save`.
    lazy : bool, optional
        Keep the arrays on disk (dask) instead of reading them; by default, traces larger
        than 256 MiB stay lazy.

    Returns
    -------
    xarray.Dataset

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not a trace: wrong or missing dims, NaN or Inf, negative weights,
        rows that do not sum to 1, or unreadable content.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    fmt = _format(path)
    try:
        if fmt == "netcdf":
            ds = xr.open_dataset(path, engine="h5netcdf", chunks={})
        else:
            ds = xr.open_zarr(path, consolidated=None)
    except Exception as error:  # any reader failure means the file is not a trace
        raise ValueError(f"cannot read {path} as a {fmt} trace: {error}") from error
    if lazy is None:
        lazy = ds.nbytes > LAZY_BYTES
    validate(ds)
    if not lazy:
        ds = ds.load()
        ds.close()
    return ds

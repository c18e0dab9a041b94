"""Head rankings (:func:`attnpanel.head_importance`) saved beside traces, as netCDF.

A ranking is a small file: one ``importance`` variable over ``(layer, head)`` and the attrs
that say how it was measured. It is read as any file here is, as hostile: screened before
any data is read (:mod:`attnpanel.traces.screening`), then checked for what a ranking is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr

from attnpanel.kernels.memory import available_memory
from attnpanel.traces import screening
from attnpanel.util.files import check_target, write_safely

RANKING = "importance"
MEASURED = ("method", "how", "measure")  # attrs a ranking carries


def save_ranking(importance: xr.DataArray, path: str | Path, overwrite: bool = False) -> Path:
    """Write a head ranking to ``path`` (``.nc``), never half-written."""
    path = Path(path)
    if path.suffix.lower() != ".nc":
        raise ValueError(f"a ranking is saved as netCDF (.nc), not {path.suffix or 'no suffix'}")
    check_ranking(importance, str(path))
    check_target(path, "netcdf", overwrite)
    out = importance.rename(RANKING).to_dataset()

    def write(target: Path) -> None:
        out.to_netcdf(target, engine="h5netcdf")

    return write_safely(path, "netcdf", write, overwrite)


def check_ranking(importance: xr.DataArray, where: str) -> None:
    """Raise ``ValueError`` unless ``importance`` is a ranking of heads."""
    if importance.dims != ("layer", "head"):
        raise ValueError(f"{where}: a ranking has dims (layer, head), not {importance.dims}")
    values = np.asarray(importance.values)
    if not np.issubdtype(values.dtype, np.floating) or np.isinf(values).any():
        raise ValueError(f"{where}: a ranking holds finite floats (NaN for a missing head)")
    missing = [name for name in MEASURED if name not in importance.attrs]
    if missing:
        raise ValueError(f"{where}: the ranking does not say its {', '.join(missing)}")


def load_ranking(path: str | Path) -> xr.DataArray:
    """Read a head ranking written by :func:`save_ranking` (or a trace file that holds one).

    Raises
    ------
    FileNotFoundError
        If nothing is at ``path``.
    ValueError
        For a hostile or unreadable file, or a file without a ranking.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no ranking at {path}")
    if path.suffix.lower() != ".nc":
        raise ValueError(f"{path}: a ranking is a netCDF file (.nc)")
    screening.refuse_unsafe_storage(path, "netcdf", available_memory())
    try:
        with xr.open_dataset(path, engine="h5netcdf") as ds:
            if RANKING not in ds:
                raise ValueError(f"{path} holds no head ranking ({RANKING!r})")
            importance = ds[RANKING].load()
    except ValueError:
        raise
    except Exception as error:  # any reader failure: not a ranking
        raise ValueError(f"cannot read {path} as a netCDF file: {error}") from error
    check_ranking(importance, str(path))
    return importance


def ranked(importance: xr.DataArray) -> list[tuple[str, int, float]]:
    """``(layer, head, value)`` most important first (by magnitude), missing heads left out."""
    rows = [
        (str(layer), int(head), float(importance.sel(layer=layer, head=head)))
        for layer in importance["layer"].values
        for head in importance["head"].values
    ]
    rows = [row for row in rows if np.isfinite(row[2])]
    return sorted(rows, key=lambda row: -abs(row[2]))

"""Head rankings (:func:`attnpanel.head_importance`) and patching effects
(:func:`attnpanel.patching_effect`) saved beside traces, as netCDF.

A ranking is a small file: one ``importance`` variable over ``(layer, head)`` (or one
``patching_effect`` variable over ``(layer, head)`` or ``(layer, head, position)``) and the
attrs that say how it was measured. It is read as any file here is, as hostile: screened before
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
EFFECT = "patching_effect"
EFFECT_MEASURED = ("method", "what", "direction", "measure")  # attrs an effect carries
RANKING_KINDS = {  # variable -> (the dims it may have, the attrs it must carry)
    RANKING: ((("layer", "head"),), MEASURED),
    EFFECT: ((("layer", "head"), ("layer", "head", "position")), EFFECT_MEASURED),
}


def save_ranking(
    importance: xr.DataArray, path: str | Path, overwrite: bool = False, kind: str = RANKING
) -> Path:
    """Write a head ranking (or, ``kind="patching_effect"``, a patching effect) to ``path``
    (``.nc``), never half-written."""
    path = Path(path)
    if path.suffix.lower() != ".nc":
        raise ValueError(f"a ranking is saved as netCDF (.nc), not {path.suffix or 'no suffix'}")
    check_ranking(importance, str(path), kind)
    check_target(path, "netcdf", overwrite)
    out = importance.rename(kind).to_dataset()

    def write(target: Path) -> None:
        out.to_netcdf(target, engine="h5netcdf")

    return write_safely(path, "netcdf", write, overwrite)


def check_ranking(importance: xr.DataArray, where: str, kind: str = RANKING) -> None:
    """Raise ``ValueError`` unless ``importance`` is a ranking of heads (of ``kind``)."""
    shapes, measured = RANKING_KINDS[kind]
    if importance.dims not in shapes:
        said = " or ".join(f"({', '.join(d)})" for d in shapes)
        raise ValueError(f"{where}: a {kind} has dims {said}, not {importance.dims}")
    values = np.asarray(importance.values)
    if not np.issubdtype(values.dtype, np.floating) or np.isinf(values).any():
        raise ValueError(f"{where}: a ranking holds finite floats (NaN for a missing head)")
    missing = [name for name in measured if name not in importance.attrs]
    if missing:
        raise ValueError(f"{where}: the ranking does not say its {', '.join(missing)}")


def load_ranking(path: str | Path, kind: str = RANKING) -> xr.DataArray:
    """Read a head ranking (or a patching effect) written by :func:`save_ranking`.

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
            if kind not in ds:
                what = "head ranking" if kind == RANKING else kind.replace("_", " ")
                raise ValueError(f"{path} holds no {what} ({kind!r})")
            importance = ds[kind].load()
    except ValueError:
        raise
    except Exception as error:  # any reader failure: not a ranking
        raise ValueError(f"cannot read {path} as a netCDF file: {error}") from error
    check_ranking(importance, str(path), kind)
    return importance


def ranked(importance: xr.DataArray) -> list[tuple]:
    """``(layer, head, value)`` (``(layer, head, position, value)`` for an effect by head
    and position) most important first (by magnitude), missing heads left out."""
    values = np.asarray(importance.values)
    coords = [importance[d].values for d in importance.dims]
    rows = []
    for index in np.ndindex(*values.shape):
        value = float(values[index])
        if np.isfinite(value):
            labels = [c[i] for c, i in zip(coords, index, strict=True)]
            rows.append((str(labels[0]), *(int(x) for x in labels[1:]), value))
    return sorted(rows, key=lambda row: -abs(row[-1]))

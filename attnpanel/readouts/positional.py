"""Positional encodings and head averages as labelled arrays, for the positional view.

:func:`sinusoidal_encoding` is the fixed encoding of Vaswani et al., "Attention Is All
You Need" (NeurIPS 2017, section 3.5)::

    PE[pos, 2i]     = sin(pos / base ** (2i / d_model))
    PE[pos, 2i + 1] = cos(pos / base ** (2i / d_model))

:func:`head_average` is the mean of a trace's weights over heads, which is what
``torch.nn.MultiheadAttention`` returns by default (``average_attn_weights=True``). No
plotting here; the views turn these arrays into heatmaps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

DEFAULT_BASE = 10000.0  # Vaswani et al.'s wavelength base


def sinusoidal_encoding(length: int, d_model: int, base: float = DEFAULT_BASE) -> xr.DataArray:
    """The sinusoidal positional encoding matrix.

    Parameters
    ----------
    length : int
        Number of positions.
    d_model : int
        Width of the encoding; an odd width ends with a sine column.
    base : float
        Wavelength base; the wavelengths run geometrically from ``2 pi`` to
        ``base * 2 pi``.

    Returns
    -------
    xarray.DataArray
        ``(position, dimension)`` float32 values in ``[-1, 1]``, named ``encoding``.

    Raises
    ------
    ValueError
        If ``length`` or ``d_model`` is not a positive integer or ``base`` is not > 0.
    """
    for name, value in (("length", length), ("d_model", d_model)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not base > 0:
        raise ValueError(f"base must be positive, got {base!r}")
    position = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    pair = np.arange(0, d_model, 2, dtype=np.float64)  # 2i, (ceil(D / 2),)
    angle = position / base ** (pair / d_model)  # (L, ceil(D / 2))
    encoding = np.empty((length, d_model), dtype=np.float64)
    encoding[:, 0::2] = np.sin(angle)
    encoding[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return xr.DataArray(
        encoding.astype(np.float32),
        dims=("position", "dimension"),
        coords={"position": np.arange(length), "dimension": np.arange(d_model)},
        name="encoding",
        attrs={"kind": "sinusoidal", "base": float(base), "d_model": int(d_model)},
    )


def head_average(trace: xr.Dataset | xr.DataArray, heads: Sequence[int] | None = None):
    """The attention weights averaged over heads, as ``nn.MultiheadAttention`` returns.

    Parameters
    ----------
    trace : xarray.Dataset or xarray.DataArray
        A trace (its ``weights`` are used) or a weights array with a ``head`` dim.
    heads : sequence of int, optional
        Average only these heads (by position), e.g. the heads left switched on.

    Returns
    -------
    xarray.DataArray
        ``(batch, query, key)`` (with ``layer`` in front for a multi-layer trace), named
        ``head_average``; rows still sum to 1.

    Raises
    ------
    ValueError
        If there are no weights with a ``head`` dim, or ``heads`` is empty or out of range.
    """
    if isinstance(trace, xr.Dataset):
        if "weights" not in trace:
            raise ValueError(
                f"trace has no 'weights' (it holds {', '.join(map(str, trace.data_vars))})"
            )
        weights = trace["weights"]
    elif isinstance(trace, xr.DataArray):
        weights = trace
    else:
        raise ValueError(f"expected a trace Dataset or a weights DataArray, got {type(trace)}")
    if "head" not in weights.dims:
        raise ValueError(f"weights have no 'head' dim (dims {weights.dims})")
    if heads is not None:
        heads = list(heads)
        n_heads = weights.sizes["head"]
        if not heads or any(not 0 <= h < n_heads for h in heads):
            raise ValueError(f"heads must be a non-empty subset of 0..{n_heads - 1}, got {heads}")
        weights = weights.isel(head=heads)
    average = weights.mean("head", keep_attrs=True)
    average.name = "head_average"
    return average

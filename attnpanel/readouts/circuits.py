"""Every head's QK and OV circuits and every pair's composition, read from a trace's
weights (:func:`circuits`, ``attnpanel.circuits``), saved and read as netCDF
(``attnpanel circuits TRACE -o circuits.nc``; ``attnpanel info circuits.nc``).

The definitions, and what they can and cannot say, are those of
:mod:`attnpanel.kernels.circuits` and ``docs/why.md``. The result is a Dataset:

=========================  =================================================  ==========
``composition``            mode (Q, K, V), layer, head, later_layer,          score 0..1
                           later_head; NaN where the later layer is not later
``composition_baseline``   mode: the mean score of random matrices of the      score
                           heads' shapes (``composition_baseline_p95``: p95)
``qk_singular``            layer, head, rank: singular values of ``QK``
``ov_singular``            layer, head, rank: singular values of ``OV``
``ov_copying``             layer, head: share of ``OV``'s eigenvalue mass of   0..1
                           positive real part
=========================  =================================================  ==========

A capture of several kinds of attention (a DataTree: an encoder-decoder's encoder, its
decoder's self- and cross-attention) is several residual streams, or one read by two kinds
of layer: composition is taken within each group, never across (as TransformerLens refuses
it for encoder-decoders), and the result is a DataTree of the same groups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels.circuits import (
    BASELINE_DRAWS,
    COMPOSITIONS,
    composition_scores,
    copying_scores,
    head_circuits,
    later_circuit,
    random_baseline,
)
from attnpanel.readouts.core import layer_names
from attnpanel.traces import screening
from attnpanel.util.files import write_safely

KIND = "circuits"  # attrs["kind"] of a saved result
NEEDS = ("w_q", "w_k", "w_v", "w_o")
NOTE = (
    "from the layers' own projection matrices: biases left out, a LayerNorm before a layer "
    "not folded in; composition within one group of layers, earlier into later"
)


def circuits(trace: xr.Dataset | xr.DataTree, draws: int = BASELINE_DRAWS):
    """Every head's circuits and every pair's composition scores, from a trace's weights.

    Parameters
    ----------
    trace : xarray.Dataset or xarray.DataTree
        A trace with ``w_q``, ``w_k``, ``w_v`` and ``w_o`` (a capture keeps them where they
        reproduce the model's q, k, v and output), one layer or a stack of them.
    draws : int
        Pairs of random matrices whose mean composition score is the baseline.

    Returns
    -------
    xarray.Dataset or xarray.DataTree
        See the module's table; a DataTree for a DataTree, one node per group.

    Raises
    ------
    ValueError
        When the trace lacks a projection matrix (naming it, and the layer).
    """
    if isinstance(trace, xr.DataTree):
        groups = {node.path: node.to_dataset() for node in trace.subtree if "weights" in node.ds}
        return xr.DataTree.from_dict(
            {path: stream_circuits(ds, draws, group=path) for path, ds in groups.items()}
        )
    return stream_circuits(trace, draws)


def stream_circuits(ds: xr.Dataset, draws: int = BASELINE_DRAWS, group: str = "") -> xr.Dataset:
    """:func:`circuits` of one Dataset: its layers in order, earlier into later."""
    where = f" (group {group})" if group else ""
    missing = [name for name in NEEDS if name not in ds]
    if missing:
        raise ValueError(
            f"the trace{where} has no {', '.join(missing)}: circuits are read from the "
            "projection matrices, which capture keeps only where they reproduce the model's "
            "q, k, v and output (rotary embeddings, for one, leave a layer without them)"
        )
    stacked = ds if "layer" in ds.dims else ds.expand_dims("layer")
    for name in NEEDS:
        bad = ~np.isfinite(stacked[name]).all(("feature_out", "feature_in")).values
        if bad.any():
            layers = ", ".join(layer_names(stacked)[i] for i in np.flatnonzero(bad))
            raise ValueError(f"the trace{where} has no {name} of layer {layers}")
    heads = int(stacked.sizes["head"])
    qk, ov = head_circuits(*(tensor(stacked[name]) for name in NEEDS), heads=heads)
    width, rank = qk.left.shape[-2:]
    scores = composition_scores(ov, [later_circuit(qk, ov, mode) for mode in COMPOSITIONS])
    baseline = random_baseline(width, rank, draws)
    names = layer_names(stacked)
    modes = len(COMPOSITIONS)
    out = xr.Dataset(
        {
            "composition": (
                ("mode", "layer", "head", "later_layer", "later_head"),
                scores.numpy(),
                {"long_name": "composition score", "units": "1"},
            ),
            "composition_baseline": (
                "mode",
                np.full(modes, baseline[0], np.float32),
                {"long_name": "mean composition score of random matrices", "draws": draws},
            ),
            "composition_baseline_p95": ("mode", np.full(modes, baseline[1], np.float32)),
            "qk_singular": (("layer", "head", "rank"), qk.singular_values().numpy()),
            "ov_singular": (("layer", "head", "rank"), ov.singular_values().numpy()),
            "ov_copying": (
                ("layer", "head"),
                copying_scores(ov).numpy(),
                {"long_name": "OV copying score (positive eigenvalue share)", "units": "1"},
            ),
        },
        coords={
            "mode": list(COMPOSITIONS),
            "layer": names,
            "head": np.arange(heads),
            "later_layer": names,
            "later_head": np.arange(heads),
            "rank": np.arange(rank),
        },
        attrs={
            "kind": KIND,
            "d_model": int(width),
            "head_dim": int(rank),
            "n_heads": heads,
            "source": str(ds.attrs.get("source", "")),
            "note": NOTE,
        },
    )
    if "kv_heads" in ds.attrs:
        out.attrs["kv_heads"] = int(ds.attrs["kv_heads"])
    if group:
        out.attrs["group"] = group
    return out


def has_weights(ds: xr.Dataset) -> bool:
    """Whether every layer of a trace has its ``w_q, w_k, w_v, w_o`` (finite: a stacked
    capture fills a layer without them with NaN). A grouped-query capture's ``w_k`` and
    ``w_v`` are repeated per query head, as its k and v are."""
    return all(name in ds and bool(np.isfinite(ds[name]).all()) for name in NEEDS)


def ov_copying(ds: xr.Dataset) -> xr.DataArray | None:
    """Each head's OV copying score ``(layer, head)`` of a trace's layers, or None where it
    lacks any layer's ``w_q, w_k, w_v, w_o`` (the model view's tiles carry it)."""
    if not has_weights(ds):
        return None
    stacked = ds if "layer" in ds.dims else ds.expand_dims("layer")
    _, ov = head_circuits(*(tensor(stacked[name]) for name in NEEDS), heads=stacked.sizes["head"])
    return xr.DataArray(
        copying_scores(ov).numpy(),
        dims=("layer", "head"),
        coords={"layer": layer_names(stacked), "head": np.arange(stacked.sizes["head"])},
        name="ov_copying",
    )


def tensor(array: xr.DataArray) -> torch.Tensor:
    """A stacked weight ``(layer, feature_out, feature_in)`` as a float32 tensor."""
    values = array.transpose("layer", "feature_out", "feature_in").values
    return torch.as_tensor(np.asarray(values, dtype=np.float32))


def save_circuits(result: xr.Dataset, path: str | Path, overwrite: bool = False) -> Path:
    """Write a :func:`circuits` Dataset to ``path`` (``.nc``), never half-written."""
    path = Path(path)
    if path.suffix.lower() != ".nc":
        raise ValueError(f"circuits are saved as netCDF (.nc), not {path.suffix or 'no suffix'}")
    return write_safely(path, "netcdf", lambda t: result.to_netcdf(t, engine="h5netcdf"), overwrite)


def load_circuits(path: str | Path) -> xr.Dataset | None:
    """A saved :func:`circuits` Dataset, read as any file here is (screened first); None for
    a netCDF file of another kind."""
    path = Path(path)
    screening.refuse_unsafe_storage(path, "netcdf")
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        if ds.attrs.get("kind") != KIND:
            return None
        return ds.load()

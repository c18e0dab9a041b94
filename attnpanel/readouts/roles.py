"""Each head's role on one sample of a trace, from the trace's own weights.

The same statistics and words as :func:`attnpanel.head_roles` (one implementation,
:mod:`attnpanel.kernels.roles`), read from the weights a trace holds for one sample: for
a page without the model, or before a survey over every sample is at hand. Token roles read
the trace's ``token`` coordinate (equal tokens, equal ids); offsets are said in the input's
clock where the trace has a regular ``time``.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels.roles import RoleInputs
from attnpanel.kernels.statistics import head_statistics_of
from attnpanel.readouts.core import time_step
from attnpanel.surveys.roles import head_roles
from attnpanel.traces.positions import Positions


def trace_roles(ds: xr.Dataset, sample: int = 0) -> xr.Dataset | None:
    """``(layer, head)`` roles of one sample of a trace (one layer, or layers stacked), or
    None where the trace holds no weights (a virtual trace) or no self-attention."""
    if "weights" not in ds or ds.sizes["query"] != ds.sizes["key"]:
        return None
    stacked = "layer" in ds.dims
    layers = [ds.isel(layer=i) for i in range(ds.sizes["layer"])] if stacked else [ds]
    names = (
        [str(v) for v in np.atleast_1d(ds["layer"].values)] if "layer" in ds.coords else ["layer"]
    )
    found: dict[str, list] = {}
    positions = Positions.of(ds, sample)
    named = torch.from_numpy(positions.named.astype(bool)) if positions.named.any() else None
    for layer in layers:
        weights = torch.from_numpy(np.asarray(layer["weights"].isel(batch=[sample]).values))
        padding = None
        if "padding" in layer:
            padding = torch.from_numpy(np.asarray(layer["padding"].isel(batch=[sample]).values))
        stats = head_statistics_of(
            weights.float(), padding, roles=RoleInputs(_token_ids(layer, sample)), named=named
        )
        for name, values in stats.items():
            found.setdefault(name, []).append(values.numpy())
    data = {
        name: (("sample", "layer", "head"), np.stack(values, axis=1))
        for name, values in found.items()
    }
    survey = xr.Dataset(data, coords={"layer": np.array(names, dtype=object)})
    if named is not None:
        survey.attrs["named_tokens"] = [str(n) for n in positions.names if n]
    if "token" not in ds.coords:
        survey.attrs["token_roles"] = "no tokens in the trace: duplicate and induction are NaN"
    step = time_step(ds, sample)
    seconds = None if step is None else float(step / np.timedelta64(1, "s"))
    return head_roles(survey, step=seconds)


def _token_ids(layer: xr.Dataset, sample: int) -> torch.Tensor | None:
    if "token" not in layer.coords:
        return None
    token = layer["token"]
    if "batch" in token.dims:
        token = token.isel(batch=sample)
    codes: dict = {}
    return torch.tensor([[codes.setdefault(str(t), len(codes)) for t in token.values]])

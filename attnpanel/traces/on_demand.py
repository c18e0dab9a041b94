"""A dense trace whose maps are recomputed on demand, sample by sample, bit for bit.

A dense trace holds ``scores`` and ``weights``, ``(batch, head, query, key)`` float32:
450 MiB for the demo's 32 windows of 8 heads at L = 480, most of a served demo's memory,
while a page reads one sample's maps at a time. :func:`maps_on_demand` gives the same trace
with the two maps as lazy dask arrays, one chunk per sample, each chunk the trace's own
recomputation (:func:`attnpanel.traces.stages.attention_stage` from its ``q``, ``k``, mask
and bias: the same kernel, :func:`attnpanel.kernels.attention.attend`, that attnpanel's
layer runs). It keeps a map on demand only where every sample's recomputation equals the
map held, bit for bit: a trace another kernel made (SDPA, a fused kernel, a hook on
someone else's model) comes back with its maps as they were, and says why in its attrs.

What reads one sample (``ds["weights"].isel(batch=b).values``) computes that sample's
chunk (about 15 ms at L = 480 with 8 heads); the last :data:`KEPT_SAMPLES` samples a map
gave are kept. What reads every sample (a mean over the batch, a saved file) computes all
of them, chunk by chunk, and holds what it asked for.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import xarray as xr

from attnpanel.traces import virtual
from attnpanel.traces.schema import ATTENTION_DIMS
from attnpanel.traces.stages import attention_stage

ON_DEMAND = "maps_on_demand"  # attr: how the maps are held (or why they stay dense)
RECOMPUTED = {"scores": "raw", "weights": "softmax"}  # map -> the stage that recomputes it
KEPT_SAMPLES = 1  # samples each map keeps once computed (a page reads one at a time)


class SampleMaps:
    """One map of a trace, computed a sample at a time from the trace without its maps;
    the last :data:`KEPT_SAMPLES` samples are kept (read-only)."""

    def __init__(self, bare: xr.Dataset, stage: str):
        self.bare = bare
        self.stage = stage
        self._lock = threading.Lock()
        self.sample = functools.lru_cache(maxsize=KEPT_SAMPLES)(self._compute)

    def _compute(self, batch: int) -> np.ndarray:
        values = attention_stage(self.bare, self.stage, batch=batch)
        found = np.asarray(values.transpose(*ATTENTION_DIMS[1:]).values, dtype=np.float32)
        found.flags.writeable = False
        return found

    def chunk(self, batch: int) -> np.ndarray:
        """Sample ``batch``'s maps, ``(1, head, query, key)``."""
        with self._lock:  # two threads asking for one sample compute it once
            return self.sample(batch)[None]

    def lazy(self, shape: tuple[int, ...]):
        """The whole map as a dask array of one chunk per sample."""
        import dask.array as da
        from dask.base import tokenize

        batch, heads, length, keys = shape
        token = f"attnpanel-{self.stage}-on-demand-{tokenize(self.stage, shape, id(self))}"
        graph = {(token, b, 0, 0, 0): (self.chunk, b) for b in range(batch)}
        chunks = ((1,) * batch, (heads,), (length,), (keys,))
        return da.Array(graph, token, chunks, dtype=np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 arrays hold the same bits (NaN payloads and -0.0 included)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def maps_on_demand(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with ``scores`` and ``weights`` recomputed on demand where that is exact.

    Parameters
    ----------
    ds : xarray.Dataset
        A dense one-layer trace with ``q``, ``k`` and its ``scale``.

    Returns
    -------
    xarray.Dataset
        A new Dataset (``ds`` is not changed): each map whose every sample the trace's
        recomputation gives bit for bit is a lazy array of the same dims, coords, attrs and
        values; the others as they were. Attr :data:`ON_DEMAND` says which are on demand,
        or why none is. Comparing costs one recomputation of every sample, the time the
        maps took to record.
    """
    names = [name for name in RECOMPUTED if name in ds.data_vars]
    if not names or virtual.is_virtual(ds) or "layer" in ds.dims:
        return ds  # nothing dense to recompute, or not one layer's trace
    missing = [name for name in ("q", "k") if name not in ds]
    if missing or "scale" not in ds.attrs:
        why = f"it holds no {' or '.join(missing)}" if missing else "it has no 'scale' attr"
        return ds.assign_attrs({ON_DEMAND: f"none: {why}, from which to recompute its maps"})
    bare = ds.drop_vars(names)
    lazy, differ = {}, []
    for name in names:
        maps = SampleMaps(bare, RECOMPUTED[name])
        held = ds[name].transpose(*ATTENTION_DIMS)
        if all(same_bits(maps.chunk(b)[0], held.values[b]) for b in range(ds.sizes["batch"])):
            lazy[name] = held.copy(data=maps.lazy(held.shape))
        else:
            differ.append(name)
    found = ds.assign(lazy)
    said = [f"{', '.join(lazy)} recomputed on demand from q and k"] if lazy else []
    if differ:
        said.append(f"{', '.join(differ)} held: not bit for bit what the trace recomputes")
    return found.assign_attrs({ON_DEMAND: "; ".join(said)})

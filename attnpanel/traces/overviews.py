"""Overview levels: each map of a trace reduced to display resolution, built once, stored.

At L = 65,536 a map has 4.3e9 cells: it is never drawn (nor computed) cell by cell at
full view. Its overview (:func:`attnpanel.kernels.tiles.overview`: per pixel the heaviest weight,
the mean weight and the share of cells blocked) takes one streaming pass and 2.7 MB.
:class:`Overviews` keeps the overviews of one trace, keyed by :class:`Entry` (sample,
layer, head, mask, pixels): in memory, and in a folder beside the trace file as one small
zarr store per entry, so that a reopened trace paints at once.

Stores are written under a temporary name and renamed into place once complete
(:func:`attnpanel.util.files.write_safely`): an interrupted build leaves at most a hidden
``.*.tmp`` folder, which is never read. Each store records the trace's
:func:`fingerprint`; one made from other numbers is not used.

:meth:`Overviews.build` computes many entries at once on ``dask.distributed`` (a
``LocalCluster`` by default, or the scheduler at an address): each task gets the ``q``,
``k`` (and ``lse``) of one sample and head, ``O(L x head_dim)``, and returns the
overview; the caller writes the stores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xarray as xr
import zarr

from attnpanel.kernels import masks as masks_module
from attnpanel.kernels import tiles
from attnpanel.kernels.masks import MASK_MODES
from attnpanel.traces import screening, virtual
from attnpanel.util import cancel, files
from attnpanel.util.locks import KeyLocks

PIXELS = (480, 480)
PARTS = ("max", "mean", "blocked")  # the arrays of one overview (tiles.Overview's fields)
SUFFIX = ".overviews"  # the folder beside a trace file: trace.zarr -> trace.zarr.overviews


@dataclass(frozen=True)
class Entry:
    """One map: a sample, a head, a mask mode, a layer (stacked traces) and a pixel size."""

    sample: int
    head: int
    mask: str
    layer: int | None = None
    pixels: tuple[int, int] = PIXELS

    def __post_init__(self):
        if self.mask not in MASK_MODES:
            raise ValueError(f"an overview needs a mask mode {MASK_MODES}, not {self.mask!r}")

    @property
    def name(self) -> str:
        """The store's file name."""
        layer = "" if self.layer is None else f"layer{self.layer}-"
        rows, cols = self.pixels
        return f"{layer}sample{self.sample}-head{self.head}-{self.mask}-{rows}x{cols}.zarr"


def folder_for(path: str | Path) -> Path:
    """Where the overviews of the trace file ``path`` are stored."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def fingerprint(ds: xr.Dataset) -> str:
    """A digest of what an overview is computed from: ``q``, ``k``, ``lse`` (where the
    trace holds it), the padding, the scale and the mask mode."""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("q", "k", virtual.LSE, "padding"):
        if name in ds:
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(ds[name].values).tobytes())
    digest.update(repr((ds.attrs.get("scale"), ds.attrs.get("mask"))).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Task:
    """What one overview needs, small enough to ship to a worker (numpy only)."""

    q: np.ndarray  # (1, 1, L, E)
    k: np.ndarray  # (1, 1, S, E)
    lse: np.ndarray | None  # (1, 1, L) float64, or None: computed from q and k
    padding: np.ndarray | None  # (1, S) bool
    mask: str
    scale: float
    pixels: tuple[int, int]


def compute(task: Task) -> tiles.Overview:
    """One overview (runs on a worker): the rows' ``lse`` under the task's mask if not
    given (one pass of the fused kernel), then :func:`attnpanel.kernels.tiles.overview`."""
    q, k = torch.from_numpy(task.q), torch.from_numpy(task.k)
    padding = None if task.padding is None else torch.from_numpy(task.padding)
    masking = masks_module.Masking(task.mask, key_padding=padding)
    if task.lse is None:
        lse = tiles.log_sum_exp(q, k, masking, task.scale)
    else:
        lse = torch.from_numpy(task.lse)
    with cancel.shielded():  # stored and shared: other views wait for it
        result = tiles.overview(q, k, lse.double(), masking, task.scale, pixels=task.pixels)
    return tiles.Overview(*(getattr(result, part)[0, 0] for part in PARTS))


class Overviews:
    """The overviews of one trace, computed on demand, kept in memory and (given a folder)
    stored in zarr.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``q`` and ``k`` (virtual or dense), stacked by ``layer`` or not.
    folder : path, optional
        Where the stores live (:func:`folder_for` of the trace file); None keeps them in
        memory only.
    """

    def __init__(self, ds: xr.Dataset, folder: str | Path | None = None):
        for name in ("q", "k"):
            if name not in ds:
                raise ValueError(f"overviews are computed from q and k; this trace has no {name!r}")
        self.ds = ds
        self.folder = None if folder is None else Path(folder)
        self.fingerprint = fingerprint(ds)
        self._memory: dict[Entry, tiles.Overview] = {}
        self._computing = KeyLocks()

    def entries(
        self,
        samples: Iterable[int] | None = None,
        heads: Iterable[int] | None = None,
        masks: Iterable[str] | None = None,
        layers: Iterable[int | None] | None = None,
        pixels: tuple[int, int] = PIXELS,
    ) -> list[Entry]:
        """Every entry of the given samples, heads, masks and layers (default: all of the
        trace's, under its own mask)."""
        ds = self.ds
        samples = range(ds.sizes["batch"]) if samples is None else samples
        heads = range(ds.sizes["head"]) if heads is None else heads
        masks = [ds.attrs.get("mask", "none")] if masks is None else masks
        if layers is None:
            layers = range(ds.sizes["layer"]) if "layer" in ds.dims else [None]
        return [
            Entry(int(s), int(h), m, None if layer is None else int(layer), tuple(pixels))
            for layer in layers
            for s in samples
            for h in heads
            for m in masks
        ]

    def get(self, entry: Entry) -> tiles.Overview:
        """The overview of one map: from memory, else its store, else computed (and
        stored)."""
        found = self._memory.get(entry)
        if found is not None:
            return found
        with self._computing.hold(entry):  # sessions asking for one map compute it once
            found = self._memory.get(entry)
            if found is None:
                found = self._read(entry)
                if found is None:
                    found = compute(self.task(entry))
                    self._write(entry, found)
                self._memory[entry] = found
        return found

    def stored(self, entry: Entry) -> bool:
        """Whether a complete store of this trace holds the entry (its data is not read)."""
        return self._open(entry) is not None

    def has(self, entry: Entry) -> bool:
        """Whether the entry is at hand, in memory or stored: :meth:`get` computes nothing."""
        return entry in self._memory or self.stored(entry)

    def task(self, entry: Entry) -> Task:
        """What computing ``entry`` needs, cut from the trace.

        Raises
        ------
        ValueError
            For a sample or head out of range, or a mask an overview cannot hold (an
            additive bias, a per-sample mask beyond padded keys: see
            :func:`attnpanel.traces.virtual.masking`).
        """
        ds = self.ds if entry.layer is None else self.ds.isel(layer=entry.layer)
        for dim, index in (("batch", entry.sample), ("head", entry.head)):
            if not 0 <= index < ds.sizes[dim]:
                raise ValueError(f"{dim} {index} is out of range: this trace has {ds.sizes[dim]}")
        padding = virtual.masking(ds, entry.mask, entry.sample).key_padding
        q, k = virtual.qk(ds, entry.sample)
        one = slice(entry.head, entry.head + 1)
        own = entry.mask == ds.attrs.get("mask", "none") and virtual.is_virtual(ds)
        return Task(
            q=q[:, one].contiguous().numpy(),
            k=k[:, one].contiguous().numpy(),
            lse=virtual.row_lse(ds, entry.mask, entry.sample)[:, one].numpy() if own else None,
            padding=None if padding is None else padding.numpy(),
            mask=entry.mask,
            scale=float(ds.attrs["scale"]),
            pixels=entry.pixels,
        )

    def build(
        self,
        entries: Iterable[Entry],
        scheduler: str | None = None,
        workers: int = 2,
        progress: bool = True,
    ) -> list[Entry]:
        """Compute and store every entry not stored yet, on ``dask.distributed``: the
        scheduler at ``scheduler``, or a ``LocalCluster`` of ``workers`` processes (one
        thread each). Returns the entries computed. Stores are written as results arrive,
        so an interrupted build keeps what it finished."""
        from distributed import Client, LocalCluster, as_completed
        from tqdm.auto import tqdm

        todo = [entry for entry in dict.fromkeys(entries) if not self.stored(entry)]
        if not todo:
            return []
        cluster = None
        if scheduler is None:
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=None)
        try:
            with Client(scheduler or cluster) as client:
                futures = {
                    client.submit(compute, self.task(entry), pure=False): entry for entry in todo
                }
                done = as_completed(futures)
                for future in tqdm(done, total=len(todo), disable=not progress, unit="map"):
                    entry = futures[future]
                    found = future.result()
                    self._write(entry, found)
                    self._memory[entry] = found
        finally:
            if cluster is not None:
                cluster.close()
        return todo

    def _write(self, entry: Entry, found: tiles.Overview) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {part: (("row", "col"), getattr(found, part)) for part in PARTS}
        store = xr.Dataset(data, attrs={"fingerprint": self.fingerprint, "entry": entry.name})
        files.write_safely(
            self.folder / entry.name,
            "zarr",
            lambda path: store.to_zarr(path, mode="w-", consolidated=False),
            overwrite=True,  # a stale store (another trace's numbers) is replaced
        )

    def _open(self, entry: Entry) -> list | None:
        """The stored arrays of ``entry`` (not read yet), if a complete store of this
        trace's numbers holds them."""
        if self.folder is None:
            return None
        path = self.folder / entry.name
        if not path.is_dir():
            return None
        shape = (
            min(entry.pixels[0], self.ds.sizes["query"]),
            min(entry.pixels[1], self.ds.sizes["key"]),
        )
        try:
            # a store of another's making is screened as any file (a compression bomb ...)
            screening.refuse_unsafe_storage(path, "zarr")
            stored = zarr.open_group(path, mode="r")
            if stored.attrs.get("fingerprint") != self.fingerprint:
                return None
            arrays = [stored[part] for part in PARTS]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable or refused: computed again
        if any(a.shape != shape or a.dtype != np.float32 for a in arrays):
            return None
        return arrays

    def _read(self, entry: Entry) -> tiles.Overview | None:
        arrays = self._open(entry)
        if arrays is None:
            return None
        try:
            return tiles.Overview(*(a[...] for a in arrays))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a damaged chunk: computed again

"""A survey's zarr store: written batch by batch, read whole samples only, resumed.

A write carries the counts before it, so a crash or Ctrl-C mid-append keeps the whole
batches; :meth:`SurveyStore.read` opens the store array by array, lazily, and cuts each to
the whole samples, so a store cut between two arrays is still read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import xarray as xr

from attnpanel.traces import screening

FORMAT = "attnpanel-survey"
VERSION = 2  # 2: the role statistics (attnpanel.kernels.roles)


class SurveyStoreError(ValueError):
    """A survey store of another model, another format or version, or not a survey."""


@dataclass
class SurveyStore:
    """A zarr store of a survey: its data, and how many samples of it are whole."""

    path: Path

    def attrs(self) -> dict | None:
        """The store's attributes, or None where there is no store yet."""
        import zarr

        if not self.path.exists():
            return None
        try:
            return dict(zarr.open_group(str(self.path), mode="r").attrs)
        except Exception as error:  # not a zarr group: not ours to overwrite
            raise SurveyStoreError(f"{self.path} is not a survey store: {error}") from error

    def check(self, attrs: dict, model: str, print_: str) -> None:
        """Refuse a store of another kind, version or model, by name."""
        if attrs.get("format") != FORMAT:
            raise SurveyStoreError(f"{self.path} is not an attnpanel survey store")
        if attrs.get("version") != VERSION:
            raise SurveyStoreError(
                f"{self.path} is a survey of format version {attrs.get('version')}; this "
                f"attnpanel reads version {VERSION}: survey again into a new store"
            )
        if attrs.get("fingerprint") != print_:
            raise SurveyStoreError(
                f"{self.path} holds a survey of another model ({attrs.get('model')}, "
                f"fingerprint {attrs.get('fingerprint')}); this is {model}, fingerprint "
                f"{print_}: survey it into a new store"
            )

    def append(self, part: xr.Dataset, first: bool, before: tuple[int, int]) -> None:
        """Write one batch's statistics, then mark them whole.

        ``before``: the whole samples and batches the store held before it. Writing a part
        replaces the store's attributes with the part's, before its data is written, so the
        part carries these counts: an interrupted write leaves them as they were.
        """
        import zarr

        done, batches = before
        counts = {"samples_done": done, "batches_done": batches}
        part = part.assign_attrs(counts)
        if first:
            part.to_zarr(str(self.path), mode="w", consolidated=False)
        else:
            part.to_zarr(str(self.path), append_dim="sample", consolidated=False)
        group = zarr.open_group(str(self.path), mode="r+")
        group.attrs.update(
            {"samples_done": done + part.sizes["sample"], "batches_done": batches + 1}
        )

    def trim(self, done: int) -> None:
        """Drop the rows an interrupted write left past the whole samples."""
        import zarr

        group = zarr.open_group(str(self.path), mode="r+")
        for _, array in group.arrays():
            dims = _dimensions(array)
            if dims and dims[0] == "sample" and array.shape[0] != done:
                array.resize((done, *array.shape[1:]))

    def read(self) -> xr.Dataset:
        """The whole samples of the store (never a half-written batch)."""
        attrs = self.attrs()
        if attrs is None:
            raise SurveyStoreError(f"no survey store at {self.path}")
        if attrs.get("format") != FORMAT:
            raise SurveyStoreError(f"{self.path} is not an attnpanel survey store")
        screening.refuse_unsafe_storage(self.path, "zarr")  # links, pickle, bombs
        return self._rows(int(attrs.get("samples_done", 0)), attrs)

    def _rows(self, done: int, attrs: dict) -> xr.Dataset:
        """The store's first ``done`` samples, lazily, read array by array: a write under
        way or cut (Ctrl-C) leaves some arrays longer than others, which ``xr.open_zarr``
        refuses as a whole."""
        import dask.array as da
        import zarr

        variables, coords = {}, {}
        for name, array in zarr.open_group(str(self.path), mode="r").arrays():
            dims = _dimensions(array)
            if dims == (name,):  # a coordinate: small, read now
                coords[name] = array[:done] if name == "sample" else array[:]
                continue
            data = da.from_zarr(array)
            if dims[:1] == ("sample",):
                data = data[:done]
            kept = {k: v for k, v in array.attrs.items() if k not in XARRAY_KEYS}
            variables[name] = xr.Variable(dims, data, attrs=kept)
        return xr.Dataset(_in_written_order(variables, attrs), coords=coords, attrs=attrs)


def _in_written_order(variables: dict, attrs: dict) -> dict:
    """``variables`` in the order the survey computed them (its ``statistics`` header, then
    the derived ones by name): a store's directory lists its arrays in whatever order the
    file system keeps, which differs from one machine to the next."""
    order = {name: i for i, name in enumerate(attrs.get("statistics", ()))}
    return dict(
        sorted(variables.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))
    )


XARRAY_KEYS = ("_FillValue", "_ARRAY_DIMENSIONS")  # what xarray keeps in a zarr array's attrs


def _dimensions(array) -> tuple:
    """A zarr array's dimension names: in its metadata (zarr v3), else in the attribute
    xarray writes (zarr v2)."""
    names = getattr(array.metadata, "dimension_names", None)
    return tuple(names or array.attrs.get("_ARRAY_DIMENSIONS", ()))

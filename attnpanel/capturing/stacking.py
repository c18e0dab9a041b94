"""The traces of one model run as one object: layers grouped by kind and shape, stacked.

Layers of one kind and one shape (self-attention of an encoder, a decoder's, the
cross-attention) are stacked along ``layer`` into one Dataset; several kinds make a
DataTree of groups. A large stack keeps each layer's own memory as a dask chunk.
"""

from __future__ import annotations

import math
import re
import uuid

import numpy as np
import torch
import xarray as xr

from attnpanel.capturing.recorder import AttentionCall, CaptureError
from attnpanel.traces import virtual
from attnpanel.traces.build import TraceParts
from attnpanel.traces.schema import ATTENTION_DIMS
from attnpanel.traces.stages import trace_mask
from attnpanel.traces.validate import validate


def _group(name: str, call: AttentionCall) -> str:
    """``encoder.layers.3.self_attn`` -> ``encoder.layers.self_attn``."""
    parts = [p for p in re.sub(r"\[\d+\]$", "", name).split(".") if not p.isdigit()]
    return ".".join(parts) or "attention"


def layer_sizes(parts: TraceParts) -> dict[str, int]:
    sizes = {}
    for dims, values in parts.data_vars.values():
        dims = (dims,) if isinstance(dims, str) else dims
        sizes.update(zip(dims, np.shape(values), strict=True))
    return sizes


def _signature(parts: TraceParts) -> tuple:
    strip = {"source", "note"}
    mask = parts.data_vars.get("mask")
    return (
        tuple(sorted(layer_sizes(parts).items())),
        tuple(sorted((k, str(v)) for k, v in parts.attrs.items() if k not in strip)),
        tuple(sorted(name for name in parts.data_vars if name not in _MASK_TRUTH)),
        np.asarray(mask[1]).tobytes() if mask is not None else b"",
    )


def assemble(traces, names, calls, source, first) -> xr.Dataset | xr.DataTree:
    """Layers that agree in shape, mask and variables stack; each other kind is a group."""
    kinds: dict[tuple, list[int]] = {}
    for index, trace in enumerate(traces):
        kinds.setdefault(_signature(trace), []).append(index)
    datasets: dict[str, xr.Dataset] = {}
    for members in kinds.values():
        labels = list(dict.fromkeys(_group(names[i], calls[i]) for i in members))
        label = labels[0] if len(labels) == 1 else f"{labels[0]}+{len(labels) - 1}"
        while label in datasets:
            label += "'"
        stacked = _stack([traces[i] for i in members], [names[i] for i in members])
        stacked.attrs["source"] = source
        _validate(stacked, {names[i]: traces[i] for i in members}, label)
        datasets[label] = stacked if "token" in stacked.coords else _input_labels(stacked, first)
    if len(datasets) == 1:
        return next(iter(datasets.values()))
    tree = xr.DataTree.from_dict({f"/{label}": ds for label, ds in datasets.items()})
    tree.attrs["source"] = source
    return tree


def _validate(stacked: xr.Dataset, layers: dict[str, TraceParts], label: str) -> None:
    """The stack in memory, or each of its layers where the stack holds them as chunks."""
    if virtual.is_virtual(stacked) or isinstance(stacked["weights"].data, np.ndarray):
        try:
            validate(stacked)
        except ValueError as error:
            raise CaptureError(f"layers {label!r}: {error}") from error
        return
    for name, parts in layers.items():  # in memory either way; torch reads each layer's arrays
        try:
            validate(parts.dataset())
        except ValueError as error:
            raise CaptureError(f"layer {name!r}: {error}") from error


_MASK_TRUTH = ("sample_mask", "bias", "padding")


STACK_COPY_BYTES = 64 * 2**20  # larger stacks of layers are chunked views, not copies


def _layers(arrays: list[np.ndarray]):
    """One array with a leading ``layer`` axis.

    Large ones (every layer's attention maps) become a dask array with one chunk per
    layer, each chunk the layer's own memory: nothing is copied, and a view of one layer
    reads that layer's array.
    """
    if len(arrays) == 1:
        return arrays[0][None]
    if sum(a.nbytes for a in arrays) <= STACK_COPY_BYTES:
        return np.stack(arrays)
    import dask  # here: dask.array costs every `import attnpanel` 0.9 s (the CLI's `info`)
    import dask.array

    token = uuid.uuid4().hex  # dask.array.from_array would copy; a delayed literal does not
    return dask.array.stack(
        [
            dask.array.from_delayed(
                dask.delayed(a, name=f"attnpanel-layer-{index}-{token}"), a.shape, dtype=a.dtype
            )
            for index, a in enumerate(arrays)
        ]
    )


def _stack(traces: list[TraceParts], names: list[str]) -> xr.Dataset:
    """One Dataset with a ``layer`` dim; the mask truth is broadcast to the union of dims."""
    first = traces[0]
    data_vars = {}
    for name, (dims, values) in first.data_vars.items():
        if name in _MASK_TRUTH:
            continue
        if name == "mask":  # the same in every layer: the signature says so
            data_vars[name] = (dims, values)
            continue
        layers = [t.data_vars[name][1] for t in traces]
        data_vars[name] = (
            ("layer", *((dims,) if isinstance(dims, str) else dims)),
            _layers(layers),
        )
    for name in _MASK_TRUTH:
        if any(name in t.data_vars for t in traces):
            data_vars[name] = _stack_truth(traces, name)
    attrs = {
        key: value
        for key, value in first.attrs.items()
        if all(_same(t.attrs.get(key), value) for t in traces[1:])
    }
    coords = {**first.coords, "layer": np.array(names, dtype=str)}
    return virtual.attach(xr.Dataset(data_vars, coords=coords, attrs=attrs))


def _stack_truth(traces: list[TraceParts], name: str) -> tuple:
    """``name`` of every layer over the union of the dims it varies along in any of them.

    A layer without it has none of it: no padding, no bias, or only its shared mask.
    """
    sizes = layer_sizes(traces[0])
    present = {d for t in traces if name in t.data_vars for d in t.data_vars[name][0]}
    shared = {}  # layers without a sample_mask block only their shared (query, key) cells
    if name == "sample_mask":
        shared = {
            i: trace_mask(t.dataset()) for i, t in enumerate(traces) if name not in t.data_vars
        }
        if any(cells is not None and bool(cells.any()) for cells in shared.values()):
            present |= {"query", "key"}
    order = ("batch", "position") if name == "padding" else ATTENTION_DIMS
    dims = tuple(d for d in order if d in present)
    shape = tuple(sizes[d] for d in dims)
    layers = []
    for index, t in enumerate(traces):
        if name in t.data_vars:
            own, values = t.data_vars[name]  # its dims, in the same order as dims
            expand = [i for i, d in enumerate(dims) if d not in own]
            values = np.expand_dims(values, expand) if expand else values
        elif shared.get(index) is not None and bool(shared[index].any()):
            values = (
                shared[index]
                .numpy()
                .reshape(tuple(sizes[d] if d in ("query", "key") else 1 for d in dims))
            )
        else:
            values = np.zeros((), np.float32 if name == "bias" else bool)
        layers.append(np.broadcast_to(values, shape))
    return ("layer", *dims), np.stack(layers)


def _same(a, b) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


def _input_labels(ds: xr.Dataset, first: torch.Tensor | None) -> xr.Dataset:
    """Labels read from the model's input: folded channels, image patches."""
    if first is None or first.dim() < 2:
        return ds
    batch, length = ds.sizes["batch"], ds.sizes["query"]
    inputs = int(first.shape[0])
    if batch != inputs and batch % inputs == 0 and batch // inputs in first.shape[1:]:
        # a channel-independent model (PatchTST) runs each channel as its own sequence,
        # sample-major: attention batch n is sample n // C, channel n % C
        channels = batch // inputs
        index = np.arange(batch)
        ds = ds.assign_coords(
            sample=("batch", index // channels), channel=("batch", index % channels)
        )
        ds.attrs["batch_layout"] = f"{inputs} samples x {channels} channels, sample-major"
    elif first.dim() == 4 and first.is_floating_point() and batch == inputs:
        height, width = int(first.shape[-2]), int(first.shape[-1])
        for special in (0, 1, 2):  # class and distillation tokens before the patches
            rows = math.isqrt(max(length - special, 0) * height // max(width, 1))
            columns = (length - special) // rows if rows else 0
            if rows and rows * columns == length - special and height % rows == 0:
                names = ["[CLS]", "[DIST]"][:special] + [
                    f"patch {r},{c}" for r in range(rows) for c in range(columns)
                ]
                ds = ds.assign_coords(token=(("batch", "position"), np.array([names] * batch)))
                ds.attrs["positions"] = f"{special} special + {rows} x {columns} image patches"
                break
    return ds


# one object

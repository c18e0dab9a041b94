"""Path patching (Wang et al. 2022): a sender head's effect on the score only through the
queries, keys or values of chosen receiver heads.

For a sender set ``S``, receivers ``R`` and ``through`` in ``q``, ``k``, ``v``, with the
target and source runs of :func:`~attnpanel.interventions.effects.patching_effect`:

1. the source run gives the senders' outputs, the target run every head's output;
2. the target inputs run with the senders' outputs from the source and **every other
   head's output frozen** at the target run; the receivers' ``through`` is recorded there
   (it carries the senders' change only by the paths that skip every other head);
3. the target inputs run with only the receivers' ``through`` replaced by what step 2
   recorded, everything else computed freely; its score gives the effect
   ``(score(3) - score(target)) / (score(source) - score(target))``.

Steps 2 and 3 are the two forwards of one sender set and one receiver set; the source and
target runs are shared by every sender set, and step 2 by every receiver set (it records
every receiver's ``through`` at once): ``R`` receiver sets cost ``2 + 1 + R`` forwards per
sender set, ``(3 + R) / R`` per receiver set. What the definition leaves out: MLPs and
normalisations are not frozen in step 2 (only attention heads are), so a sender's effect
through an MLP that feeds the receivers counts as direct; a sender in the receivers' layer
or after it cannot reach their inputs, and its effect is NaN.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.interventions.gate import heads_asked
from attnpanel.interventions.importance import output_tensor
from attnpanel.interventions.patching import (
    HeadPatcher,
    PatchingError,
    score_difference,
    score_of,
)

THROUGH = ("q", "k", "v")


def _record_outputs(model, inputs):
    """Every head's output, and the model's output, from one forward."""
    outputs = HeadPatcher(model, "output")
    y = output_tensor(outputs.record(*inputs[0], **inputs[1]))
    return outputs, y


class PathPatching:
    """The source and target runs of a path patching, recorded once; :meth:`effects` of one
    sender set costs one frozen run (step 2, shared by every receiver set: it records every
    receiver's ``through`` at once) and one forward per receiver set (step 3).

    Parameters
    ----------
    model : torch.nn.Module
    source, target : (tuple, dict)
        Positional and keyword inputs of each run.
    receivers : mapping of str to list of int, or a sequence of them
        One receiver set, or several (each its own effect).
    through : {"q", "k", "v"}
    score : callable or None
    """

    def __init__(self, model: nn.Module, source, target, receivers, through: str, score):
        if through not in THROUGH:
            raise PatchingError(f"through={through!r}: a receiver is reached through {THROUGH}")
        self.model, self.target, self.through, self.measure = model, target, through, score
        given = [receivers] if isinstance(receivers, Mapping) else list(receivers)
        self.receiver_sets = [{k: v for k, v in heads_asked(one).items() if v} for one in given]
        if not self.receiver_sets or not all(self.receiver_sets):
            raise PatchingError(
                "receivers names no head: path patching needs at least one in each set"
            )
        self.source_outputs, y_source = _record_outputs(model, source)
        self.target_outputs, y_target = _record_outputs(model, target)
        self.layers = dict(self.target_outputs.source_heads)
        receiving = {layer for one in self.receiver_sets for layer in one}
        missing = sorted(layer for layer in receiving if layer not in self.layers)
        if missing:
            raise PatchingError(
                f"receivers {missing} computed no attention; the layers that did: "
                f"{', '.join(self.layers) or 'none'}"
            )
        order = list(self.layers)
        self.first_receivers = [
            min(order.index(layer) for layer in one) for one in self.receiver_sets
        ]
        self.source_score = score_of(y_source, score)
        self.target_score = score_of(y_target, score)
        self.difference = score_difference(self.source_score, self.target_score, y_source.dtype)

    @property
    def receivers(self) -> dict[str, list[int]]:
        """Every receiver head of every set, by layer."""
        found: dict[str, set[int]] = {}
        for one in self.receiver_sets:
            for layer, heads in one.items():
                found.setdefault(layer, set()).update(heads)
        return {layer: sorted(heads) for layer, heads in found.items()}

    def reaches(self, layer: str, receivers: int | None = None) -> bool:
        """Whether a head of ``layer`` runs before every receiver of set ``receivers`` (of
        some set: None), so it can reach their inputs."""
        index = list(self.layers).index(layer)
        firsts = self.first_receivers if receivers is None else [self.first_receivers[receivers]]
        return any(index < first for first in firsts)

    def effects(self, senders: Mapping[str, list[int]]) -> np.ndarray:
        """The share of the difference the senders carry through each receiver set's
        inputs, ``(sets,)`` (NaN for a set the senders cannot reach)."""
        senders = {k: v for k, v in heads_asked(senders).items() if v}
        for layer in senders:
            if layer not in self.layers:
                raise PatchingError(f"sender layer {layer!r} computed no attention")
            if not self.reaches(layer):
                raise PatchingError(
                    f"sender layer {layer!r} runs at or after the receivers' first layer: it "
                    "cannot reach their inputs"
                )
        reached = [
            i
            for i in range(len(self.receiver_sets))
            if all(self.reaches(layer, i) for layer in senders)
        ]
        carried = self._carried(senders)  # step 2, once for every set
        found = np.full(len(self.receiver_sets), np.nan)
        for i in reached:  # step 3, one forward per set
            carried.select(self.receiver_sets[i])
            with torch.no_grad(), carried.watching():
                y = output_tensor(self.model(*self.target[0], **self.target[1]))
            found[i] = (score_of(y, self.measure) - self.target_score) / self.difference
        return found

    def _carried(self, senders) -> HeadPatcher:
        """Step 2: the target inputs with the senders' outputs from the source and every
        other head's output frozen at the target run; every receiver's ``through`` kept."""
        frozen = HeadPatcher(self.model, "output")
        for layer, target in self.target_outputs.recorded.items():
            heads = senders.get(layer)
            if heads:  # the senders from the source, every other head as in the target run
                lane = self.target_outputs.lanes[layer]
                chosen = lane.selection(target, heads)
                target = torch.where(chosen, self.source_outputs.recorded[layer], target)
            frozen.recorded[layer] = target
        frozen.select({layer: list(range(h)) for layer, h in self.layers.items()})
        carried = HeadPatcher(self.model, self.through)
        with frozen.watching():
            carried.record(*self.target[0], **self.target[1])
        return carried


def _set_name(receivers: Mapping[str, list[int]]) -> str:
    return "; ".join(f"{k}: {list(v)}" for k, v in receivers.items())


def path_patching(
    model, source, target, score, senders, receivers, through, progress, direction
) -> xr.DataArray:
    """The effect of ``senders`` (or of every head that can reach the receivers, one at a
    time, when ``senders`` is None) through the receivers' ``through``; with several
    receiver sets, a ``receivers`` dimension (one effect per set)."""
    paths = PathPatching(model, source, target, receivers, through, score)
    several = not isinstance(receivers, Mapping)
    sets = len(paths.receiver_sets)
    heads = max(paths.layers.values())
    names = list(paths.layers)
    attrs = {
        "method": "path patching",
        "direction": direction,
        "through": through,
        "receivers": " | ".join(_set_name(one) for one in paths.receiver_sets),
        "score_clean": paths.source_score if direction == "denoising" else paths.target_score,
        "score_corrupted": paths.target_score if direction == "denoising" else paths.source_score,
        "measure": "(score(path patched) - score(target)) / (score(source) - score(target)), "
        "every head but the senders frozen at the target run",
        "long_name": "path patching effect",
    }
    extra = {"receivers": [_set_name(one) for one in paths.receiver_sets]} if several else {}
    if senders is not None:
        values = paths.effects(senders)
        attrs["senders"] = "; ".join(f"{k}: {v}" for k, v in heads_asked(senders).items())
        attrs["forwards"] = 2 + 1 + int(np.isfinite(values).sum())
        if several:
            return xr.DataArray(
                values, dims=("receivers",), coords=extra, name="patching_effect", attrs=attrs
            )
        return xr.DataArray(values[0], name="patching_effect", attrs=attrs)
    tasks = [
        (layer, h) for layer in names if paths.reaches(layer) for h in range(paths.layers[layer])
    ]
    if progress:
        from tqdm.auto import tqdm

        tasks = tqdm(tasks, desc="path patching", unit="sender")
    table = np.full((sets, len(names), heads), np.nan)
    forwards = 2
    for layer, head in tasks:
        values = paths.effects({layer: [head]})
        table[:, names.index(layer), head] = values
        forwards += 1 + int(np.isfinite(values).sum())
    attrs["forwards"] = forwards
    attrs["note"] = "NaN: a head at or after the receivers' first layer cannot reach them"
    coords = {"layer": np.array(names, dtype=str), "head": np.arange(heads)}
    if several:
        return xr.DataArray(
            table,
            dims=("receivers", "layer", "head"),
            coords={**extra, **coords},
            name="patching_effect",
            attrs=attrs,
        )
    return xr.DataArray(
        table[0], dims=("layer", "head"), coords=coords, name="patching_effect", attrs=attrs
    )

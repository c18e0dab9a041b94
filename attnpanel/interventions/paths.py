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

Steps 2 and 3 are the two forwards of one sender set; the source and target runs are
shared by every sender set. What the definition leaves out: MLPs and normalisations are not
frozen in step 2 (only attention heads are), so a sender's effect through an MLP that
feeds the receivers counts as direct; a sender in the receivers' layer or after it cannot
reach their inputs, and its effect is NaN.
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
    """The source and target runs of a path patching, recorded once; :meth:`effect` of one
    sender set costs two forwards.

    Parameters
    ----------
    model : torch.nn.Module
    source, target : (tuple, dict)
        Positional and keyword inputs of each run.
    receivers : mapping of str to list of int
    through : {"q", "k", "v"}
    score : callable or None
    """

    def __init__(self, model: nn.Module, source, target, receivers, through: str, score):
        if through not in THROUGH:
            raise PatchingError(f"through={through!r}: a receiver is reached through {THROUGH}")
        self.model, self.target, self.through, self.measure = model, target, through, score
        self.receivers = {k: v for k, v in heads_asked(receivers).items() if v}
        if not self.receivers:
            raise PatchingError("receivers names no head: path patching needs at least one")
        self.source_outputs, y_source = _record_outputs(model, source)
        self.target_outputs, y_target = _record_outputs(model, target)
        self.layers = dict(self.target_outputs.source_heads)
        missing = [layer for layer in self.receivers if layer not in self.layers]
        if missing:
            raise PatchingError(
                f"receivers {missing} computed no attention; the layers that did: "
                f"{', '.join(self.layers) or 'none'}"
            )
        order = list(self.layers)
        self.first_receiver = min(order.index(layer) for layer in self.receivers)
        self.source_score = score_of(y_source, score)
        self.target_score = score_of(y_target, score)
        self.difference = score_difference(self.source_score, self.target_score)

    def reaches(self, layer: str) -> bool:
        """Whether a head of ``layer`` runs before every receiver (can reach its inputs)."""
        return list(self.layers).index(layer) < self.first_receiver

    def effect(self, senders: Mapping[str, list[int]]) -> float:
        """The share of the difference the senders carry through the receivers' inputs."""
        senders = {k: v for k, v in heads_asked(senders).items() if v}
        for layer in senders:
            if layer not in self.layers:
                raise PatchingError(f"sender layer {layer!r} computed no attention")
            if not self.reaches(layer):
                raise PatchingError(
                    f"sender layer {layer!r} runs at or after the receivers' first layer: it "
                    "cannot reach their inputs"
                )
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
            carried.record(*self.target[0], **self.target[1])  # step 2
        carried.select(self.receivers)
        with torch.no_grad(), carried.watching():  # step 3
            y = output_tensor(self.model(*self.target[0], **self.target[1]))
        return (score_of(y, self.measure) - self.target_score) / self.difference


def path_patching(
    model, source, target, score, senders, receivers, through, progress, direction
) -> xr.DataArray:
    """The effect of ``senders`` (or of every head that can reach the receivers, one at a
    time, when ``senders`` is None) through the receivers' ``through``."""
    paths = PathPatching(model, source, target, receivers, through, score)
    heads = max(paths.layers.values())
    names = list(paths.layers)
    attrs = {
        "method": "path patching",
        "direction": direction,
        "through": through,
        "receivers": "; ".join(f"{k}: {v}" for k, v in paths.receivers.items()),
        "score_clean": paths.source_score if direction == "denoising" else paths.target_score,
        "score_corrupted": paths.target_score if direction == "denoising" else paths.source_score,
        "measure": "(score(path patched) - score(target)) / (score(source) - score(target)), "
        "every head but the senders frozen at the target run",
        "long_name": "path patching effect",
    }
    if senders is not None:
        value = paths.effect(senders)
        attrs["senders"] = "; ".join(f"{k}: {v}" for k, v in heads_asked(senders).items())
        attrs["forwards"] = 4
        return xr.DataArray(value, name="patching_effect", attrs=attrs)
    tasks = [
        (layer, h) for layer in names if paths.reaches(layer) for h in range(paths.layers[layer])
    ]
    attrs["forwards"] = 2 * len(tasks) + 2
    if progress:
        from tqdm.auto import tqdm

        tasks = tqdm(tasks, desc="path patching", unit="sender")
    table = np.full((len(names), heads), np.nan)
    for layer, head in tasks:
        table[names.index(layer), head] = paths.effect({layer: [head]})
    attrs["note"] = "NaN: a head at or after the receivers' first layer cannot reach them"
    return xr.DataArray(
        table,
        dims=("layer", "head"),
        coords={"layer": np.array(names, dtype=str), "head": np.arange(heads)},
        name="patching_effect",
        attrs=attrs,
    )

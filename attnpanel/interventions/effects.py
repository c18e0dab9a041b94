"""Which heads carry the difference between two inputs: the patching effect of every head.

:func:`patching_effect` runs the model on a clean and a corrupted input and measures, for
each head, the share of the difference of a score that patching the head restores:

    effect = (score(patched) - score(target)) / (score(source) - score(target))

``direction="denoising"`` (default) patches the clean run's ``what`` into the corrupted run
(target corrupted, source clean: 1 means the head alone restores the clean score);
``"noising"`` patches the corrupted run's into the clean run (target clean, source
corrupted: 1 means the head alone carries the corruption's whole effect). The target runs
on the same path as the patched forwards (inside the patcher with no head selected).

``method="attribution"`` is attribution patching (Nanda 2023; Syed, Rager, Conmy 2023): the
first-order estimate ``(a_source - a_target) . d score / d a`` at the target run, for every
head at once from one forward on the source and one forward and one backward on the
target, over the same difference.

References: K. Meng et al., "Locating and Editing Factual Associations in GPT", NeurIPS
2022; K. Wang et al., "Interpretability in the Wild", ICLR 2023; A. Syed, C. Rager, A.
Conmy, "Attribution Patching Outperforms Automated Circuit Discovery", 2023.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.modes import evaluating
from attnpanel.interventions.gate import check_written
from attnpanel.interventions.importance import (
    differentiable_score,
    output_tensor,
    probing,
)
from attnpanel.interventions.patching import (
    HeadPatcher,
    PatchingError,
    check_what,
    inputs_of,
    score_difference,
    score_of,
)
from attnpanel.interventions.paths import path_patching
from attnpanel.interventions.replay import Tape

DIRECTIONS = ("denoising", "noising")
EFFECT_METHODS = ("exact", "attribution")
BY = ("head", "head_position")


def patching_effect(
    model: nn.Module,
    clean,
    corrupted,
    score: Callable[[torch.Tensor], torch.Tensor | float] | None = None,
    by: str = "head",
    what: str = "output",
    direction: str = "denoising",
    method: str = "exact",
    client=None,
    progress: bool = True,
    senders: Mapping[str, list[int]] | None = None,
    receivers: Mapping[str, list[int]] | None = None,
    through: str = "q",
) -> xr.DataArray:
    """The share of the clean-corrupted difference of ``score`` each head carries.

    Parameters
    ----------
    model : torch.nn.Module
        Any model :func:`attnpanel.capture` can trace.
    clean, corrupted : tuple, dict or torch.Tensor
        The two inputs, each positional inputs (a tuple), keyword inputs (a dict) or one
        tensor, of the same shapes.
    score : callable, optional
        ``score(y) -> scalar`` of the model's output tensor (a logit difference, a loss, one
        output's total); default ``||y||``.
    by : {"head", "head_position"}
        One effect per head, or per head and position (query positions for ``output``,
        ``q`` and ``weights``; key positions for ``k`` and ``v``).
    what : {"output", "q", "k", "v", "weights"}
        What of a head is patched (:func:`attnpanel.patch`).
    direction : {"denoising", "noising"}
        Clean into the corrupted run, or corrupted into the clean run.
    method : {"exact", "attribution"}
        One patched forward per head (per head and position), or attribution patching: one
        forward and one backward for every head at once (a first-order estimate).
    client : dask.distributed.Client, optional
        Run the exact patched forwards on its workers.
    progress : bool
        A progress bar (tqdm) over the patched forwards.
    senders, receivers : mapping of str to list of int, optional
        Path patching (:mod:`attnpanel.interventions.paths`): with ``receivers``, the
        effect of the ``senders`` (or of every head before the receivers, one at a time,
        when ``senders`` is None) only through the receivers' ``through``, every other
        head frozen at the target run. A 0-d DataArray for given senders, else
        ``(layer, head)``.
    through : {"q", "k", "v"}
        What of the receivers the senders reach them by.

    Returns
    -------
    xarray.DataArray
        ``(layer, head)`` or ``(layer, head, position)`` float64, layers named as a
        capture's ``layer`` coordinate, NaN for heads a layer lacks. Its attrs hold the two
        scores, the definition, the direction, the method and the forwards it cost.

    Raises
    ------
    PatchingError
        Inputs of other shapes, a model that computes no attention, a score that is the
        same on both inputs (no difference to share out).
    """
    for name, value, allowed in (
        ("by", by, BY),
        ("direction", direction, DIRECTIONS),
        ("method", method, EFFECT_METHODS),
    ):
        if value not in allowed:
            raise PatchingError(f"{name}={value!r}: one of {allowed}")
    check_what(what)
    source, target = (clean, corrupted) if direction == "denoising" else (corrupted, clean)
    source, target = inputs_of(source), inputs_of(target)
    if receivers is not None or senders is not None:
        if receivers is None or method != "exact" or by != "head" or what != "output":
            raise PatchingError(
                "path patching takes receivers (and senders, or none to scan every head) "
                "with method='exact', by='head' and what='output' (the senders' output)"
            )
        with evaluating(model):
            return path_patching(
                model, source, target, score, senders, receivers, through, progress, direction
            )
    with evaluating(model):
        run = _exact if method == "exact" else _attribution
        found = run(model, source, target, score, by, what, client, progress)
    return _table(found, by, what, direction, method, score is not None)


@dataclass
class _Found:
    layers: dict[str, int]  # layer -> heads
    values: dict[str, np.ndarray]  # layer -> (H,) or (H, positions)
    source_score: float
    target_score: float
    forwards: int
    groups: dict[str, int]
    backwards: int = 0
    replayed: tuple[str, ...] = ()  # layers whose patched forwards took their start from the tape


def _recorded(model, what: str, source) -> tuple[HeadPatcher, torch.Tensor, dict[str, int]]:
    """A patcher that ran the source once: its ``what`` recorded, the output, the layers."""
    patcher = HeadPatcher(model, what)
    y_source = output_tensor(patcher.record(*source[0], **source[1]))
    layers = dict(patcher.source_heads)
    if not layers:
        raise PatchingError(f"{type(model).__name__} computed no attention: no head to patch")
    return patcher, y_source, layers


def _exact(model, source, target, score, by, what, client, progress) -> _Found:
    patcher, y_source, layers = _recorded(model, what, source)
    patched = PatchedRun(patcher, target, score)
    tape = Tape(model)  # (a cluster's workers run whole forwards: nothing to record)
    recording = tape.recording(patcher) if client is None else contextlib.nullcontext()
    with patched.watching(), recording:
        target_score = patched.score({}, None)
    y_target = patched.last.clone()  # (a model may hand back a buffer it reuses)
    source_score = score_of(y_source, score)
    difference = score_difference(source_score, target_score, y_source.dtype)
    tasks = [
        (layer, head, position)
        for layer, heads in layers.items()
        for head in range(heads)
        for position in ([None] if by == "head" else range(patcher.lengths.get(layer, 0)))
    ]
    checked: list[tuple[str, bool]] = []  # the layers whose replay was checked
    if client is not None:
        scores = _on_cluster(client, patched, tasks, progress)
    else:
        scores, runs = {}, Counter(task[0] for task in tasks)
        with patched.watching(), contextlib.ExitStack() as replayed:
            layer = None
            for task in _bar(tasks, progress):  # a layer's tasks in a row
                if task[0] != layer:
                    replayed.close()
                    layer = task[0]
                    replay = _replaying(tape, layer, patched, y_target, runs[layer], checked)
                    replayed.enter_context(replay)
                scores[task] = patched.score({layer: [task[1]]}, task[2])
    values = {}
    for layer, heads in layers.items():
        if by == "head":
            row = [scores[layer, h, None] for h in range(heads)]
        else:
            row = [
                [scores[layer, h, p] for p in range(patcher.lengths[layer])] for h in range(heads)
            ]
        values[layer] = (np.asarray(row, dtype=float) - target_score) / difference
    forwards = len(tasks) + 2 + len(checked)  # (a replayed one runs part of the model)
    replayed = tuple(layer for layer, same in checked if same)
    return _Found(
        layers, values, source_score, target_score, forwards, dict(patcher.groups), 0, replayed
    )


@contextlib.contextmanager
def _replaying(tape: Tape, layer: str, patched: PatchedRun, y_target, runs: int, checked: list):
    """The ``runs`` patched forwards of ``layer`` take what ends before its attention from
    the tape, once a forward so replayed with nothing patched gives the target's own output
    bit for bit (else they run whole); not where that check would cost more than the
    replays save (a layer near the input). ``checked`` gains ``(layer, passed)``."""
    share = tape.share(layer)
    if runs * share <= 1 - share:
        yield
        return
    with tape.replay(layer):
        same = False
        with contextlib.suppress(Exception):  # a replay the model cannot run: run whole
            patched.score({}, None)
            same = torch.equal(patched.last, y_target)
        checked.append((layer, same))
        if same:
            yield
            return
    yield


@dataclass
class PatchedRun:
    """The target run with a source recorded: what each patched forward needs (shipped
    whole to a cluster's workers)."""

    patcher: HeadPatcher
    target: tuple[tuple, dict]
    measure: Callable | None  # the user's score
    last: torch.Tensor | None = None  # the output of the last forward

    def score(self, heads: dict, position) -> float:
        """The score of the target run with ``heads`` patched; inside :meth:`watching`."""
        self.patcher.select(heads, None if position is None else [position])
        with torch.no_grad():
            y = output_tensor(self.patcher.model(*self.target[0], **self.target[1]))
        check_written(self.patcher, heads, "patching_effect", PatchingError)  # never silent
        self.last = y
        return score_of(y, self.measure)

    def watching(self):
        """The patcher's hooks and mode, set up once for many forwards."""
        return self.patcher.watching()


def _patched_score(run: PatchedRun, task) -> float:
    layer, head, position = task
    with run.watching():
        return run.score({layer: [head]}, position)


def _on_cluster(client, run: PatchedRun, tasks, progress) -> dict:
    from dask.distributed import as_completed

    [shipped] = client.scatter([run], broadcast=True)
    futures = {client.submit(_patched_score, shipped, task, pure=False): task for task in tasks}
    done = as_completed(futures)
    if progress:
        from tqdm.auto import tqdm

        done = tqdm(done, total=len(tasks), desc="patching heads", unit="forward")
    return {futures[future]: future.result() for future in done}


def _bar(tasks, progress: bool):
    if not progress:
        return tasks
    from tqdm.auto import tqdm

    return tqdm(tasks, desc="patching heads", unit="forward")


def _attribution(model, source, target, score, by, what, client, progress) -> _Found:
    patcher, y_source, layers = _recorded(model, what, source)
    patcher.probe()
    with probing(model):
        with patcher.watching():
            y_target = output_tensor(model(*target[0], **target[1]))
        value = differentiable_score(y_target, score)
        probes = list(patcher.probes.items())
        grads = (
            torch.autograd.grad(value, [p for _, (_, p, _) in probes], allow_unused=True)
            if value.requires_grad
            else [None] * len(probes)
        )
    if all(grad is None for grad in grads):
        raise PatchingError(
            f"the score does not depend on any head's {what} here (no gradient reached "
            "them): attribution patching has nothing to estimate"
        )
    source_score, target_score = score_of(y_source, score), float(value.detach())
    difference = score_difference(source_score, target_score, y_source.dtype)
    values = {}
    for (layer, (a_target, probe, lane)), grad in zip(probes, grads, strict=True):
        a_source = patcher.recorded[layer]
        if a_source.shape != a_target.shape:
            raise PatchingError(
                f"layer {layer!r}: the source's {what} is {tuple(a_source.shape)}, the "
                f"target's {tuple(a_target.shape)}: patching needs inputs of the same shape"
            )
        grad = torch.zeros_like(probe) if grad is None else grad
        cells = lane.canonical((a_source.double() - a_target.double()) * grad.double())
        per = cells.sum(dim=0)  # (H, n, ...)
        per = per.reshape(*per.shape[:2], -1).sum(dim=-1)  # (H, n)
        if lane.heads != layers[layer]:  # key/value heads shared by groups of query heads
            per = per.repeat_interleave(layers[layer] // lane.heads, dim=0)
        per = per.cpu().numpy() / difference
        values[layer] = per.sum(axis=1) if by == "head" else per
    missing = [layer for layer in layers if layer not in values]
    if missing:
        raise PatchingError(f"the {what} of layers {missing} was not found in the target run")
    return _Found(layers, values, source_score, target_score, 2, dict(patcher.groups), 1)


def _table(found: _Found, by, what, direction, method, scored: bool) -> xr.DataArray:
    layers = found.layers
    heads = max(layers.values())
    names = np.array(list(layers), dtype=str)
    coords = {"layer": names, "head": np.arange(heads)}
    if by == "head":
        table = np.full((len(layers), heads), np.nan)
        dims = ("layer", "head")
    else:
        positions = max(v.shape[1] for v in found.values.values())
        table = np.full((len(layers), heads, positions), np.nan)
        dims = ("layer", "head", "position")
        coords["position"] = np.arange(positions)
    for row, layer in enumerate(layers):
        value = found.values[layer]
        table[
            (row, slice(0, value.shape[0])) + ((slice(0, value.shape[1]),) if by != "head" else ())
        ] = value
    named = "score" if scored else "||y||"
    target, source = ("corrupted", "clean") if direction == "denoising" else ("clean", "corrupted")
    attrs = {
        "what": what,
        "direction": direction,
        "method": method,
        "by": by,
        "score_clean": found.source_score if direction == "denoising" else found.target_score,
        "score_corrupted": found.target_score if direction == "denoising" else found.source_score,
        "measure": (
            f"({named}(patched) - {named}({target})) / ({named}({source}) - {named}({target}))"
            if method == "exact"
            else f"(a_{source} - a_{target}) . d {named} / d a at the {target} run, "
            f"over {named}({source}) - {named}({target})"
        ),
        "forwards": found.forwards,
        "backwards": found.backwards,
        "replayed": ", ".join(found.replayed),
        "long_name": "patching effect",
    }
    if found.groups:
        shared = ", ".join(f"{layer} ({n})" for layer, n in found.groups.items())
        attrs["note"] = (
            f"k and v are shared by groups of query heads in {shared}: each query head shows "
            "its group's key/value head"
        )
    return xr.DataArray(table, dims=dims, coords=coords, name="patching_effect", attrs=attrs)

"""Which heads a model's prediction needs: each head switched off inside the real model.

:func:`head_importance` ranks every head of every layer by what switching it off alone
(:func:`attnpanel.interventions.gate.ablate`) does to the model's output: by default the
relative change ``||y - y_ablated|| / ||y||`` of the output tensor (float64), or
``score(y) - score(y_ablated)`` for a given ``score``. That costs one forward per head
plus the baseline. ``method="gradient"`` gives Michel et al.'s (2019) first-order estimate
``|d score / d gate|`` at every head's gate of 1, in one forward and one backward pass.

References: P. Michel, O. Levy, G. Neubig, "Are Sixteen Heads Really Better than One?",
NeurIPS 2019.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.modes import evaluating
from attnpanel.interventions.gate import (
    AblationError,
    HeadGate,
    HeadWriter,
    check_how,
    check_written,
)
from attnpanel.util.locks import SharedSetting

METHODS = ("ablation", "gradient")


def output_tensor(output) -> torch.Tensor:
    """The output tensor of a model, or its first tensor (a tuple, a dict, a Hugging Face
    ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        output = list(output.values())
    elif hasattr(output, "to_tuple"):
        output = output.to_tuple()
    if isinstance(output, list | tuple):
        for item in output:
            with contextlib.suppress(TypeError):
                return output_tensor(item)
    raise TypeError(f"the model's output holds no tensor: {type(output).__name__}")


def differentiable_score(y: torch.Tensor, score: Callable | None) -> torch.Tensor:
    """``score(y)`` (default ``||y||`` in float64), refused unless it is a scalar tensor a
    backward pass can start from."""
    value = score(y) if score is not None else torch.linalg.vector_norm(y.double())
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise AblationError("score(y) must return a scalar tensor to be differentiated")
    return value


def relative_change(y: torch.Tensor, ablated: torch.Tensor) -> float:
    """``||y - ablated|| / ||y||`` in float64 (NaN entries, padded outputs say, left out)."""
    y, ablated = y.detach().double(), ablated.detach().double()
    real = torch.isfinite(y) & torch.isfinite(ablated)
    norm = float(torch.linalg.vector_norm(y[real]))
    change = float(torch.linalg.vector_norm((y - ablated)[real]))
    return change / norm if norm > 0 else float("nan")


def _freeze(model: nn.Module) -> list[nn.Parameter]:
    frozen = [p for p in model.parameters() if p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    return frozen


def _unfreeze(frozen: list[nn.Parameter]) -> None:
    for parameter in frozen:
        parameter.requires_grad_(True)


# A served model is shared by every session's threads: the last one out restores it.
_FROZEN = SharedSetting(_freeze, _unfreeze)


@contextlib.contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """Gradients on, for probes only: the model's parameters stop requiring gradients
    while the block runs (restored after the last overlapping user), so autograd records
    only what runs downstream of a probe, not every product of a weight (the probe forward
    and its backward: 8 % faster on a 4-layer TransformerLens model), and no parameter of a
    shared model gathers a gradient."""
    with _FROZEN(model), torch.enable_grad():
        yield


def head_importance(
    model: nn.Module,
    *inputs,
    score: Callable[[torch.Tensor], torch.Tensor | float] | None = None,
    how: str = "zero",
    method: str = "ablation",
    client=None,
    progress: bool = True,
    **kwargs,
) -> xr.DataArray:
    """Rank every attention head of ``model`` by what switching it off does to its output.

    Parameters
    ----------
    model : torch.nn.Module
        Any model :func:`attnpanel.capture` can trace.
    *inputs
        Its positional inputs.
    score : callable, optional
        ``score(y) -> scalar`` of the output tensor ``y`` (a loss, a metric, a logit).
        Without it, ablation measures ``||y - y_ablated|| / ||y||``, and the gradient
        method differentiates ``||y||``.
    how : {"zero", "mean"}
        A head switched off gives zeros, or its output's mean over the query positions.
    method : {"ablation", "gradient"}
        ``"ablation"``: each head switched off alone, one forward each (exact).
        ``"gradient"``: ``|d score / d gate|`` at gates of 1 (Michel et al. 2019), one
        forward and one backward for every head at once (a first-order estimate).
    client : dask.distributed.Client, optional
        Run the ablations on its workers (the model and inputs are sent to each).
    progress : bool
        Show a progress bar (tqdm) over the forward passes.
    **kwargs
        Keyword inputs of ``model`` (``attention_mask`` ...).

    Returns
    -------
    xarray.DataArray
        ``(layer, head)`` float64, layers named as a capture's ``layer`` coordinate; NaN
        for a head a layer does not have (layers with fewer heads). Its attrs say the
        method, ``how``, the measure and the forward passes it cost.

    Examples
    --------
    >>> importance = attnpanel.head_importance(model, x)  # doctest: +SKIP
    >>> importance.to_series().nlargest(5)  # doctest: +SKIP
    """
    if method not in METHODS:
        raise AblationError(f"method={method!r}: head importance is one of {METHODS}")
    check_how(how)
    with evaluating(model):
        if method == "gradient":
            layers, values, forwards = _gradient(model, inputs, kwargs, score, how)
        else:
            layers, values, forwards = _ablation(
                model, inputs, kwargs, score, how, client, progress
            )
    heads = max(layers.values())
    table = np.full((len(layers), heads), np.nan)
    for row, layer in enumerate(layers):
        table[row, : layers[layer]] = values[layer]
    measure = (
        ("score(y) - score(y_ablated)" if score is not None else "||y - y_ablated|| / ||y||")
        if method == "ablation"
        else ("|d score / d gate|" if score is not None else "|d ||y|| / d gate|")
    )
    return xr.DataArray(
        table,
        dims=("layer", "head"),
        coords={"layer": np.array(list(layers), dtype=str), "head": np.arange(heads)},
        name="importance",
        attrs={
            "method": method,
            "how": how,
            "measure": measure,
            "forwards": forwards,
            "long_name": "head importance",
        },
    )


def _ablation(model, inputs, kwargs, score, how, client, progress):
    found_by = HeadWriter(model)  # the discovery: every call watched
    with torch.no_grad(), found_by.watching():
        model(*inputs, **kwargs)
    layers = dict(found_by.seen)
    if not layers:
        raise AblationError(f"{type(model).__name__} computed no attention: no head to rank")
    # every later forward hooks and watches only what ran attention; the baseline takes the
    # ablated forwards' path (a padded nn.TransformerEncoder runs fused and nested outside a
    # mode: its padded rows come out 0 there only, and its sites keep the whole model watched)
    watch = Watch.of(found_by)
    y = watch.run(HeadGate(model, {}, how), inputs, kwargs)
    base = None if score is None else float(score(y))
    tasks = [(layer, head) for layer, count in layers.items() for head in range(count)]
    if client is not None:
        found = _on_cluster(
            client, model, inputs, kwargs, tasks, y, score, base, how, progress, watch
        )
    else:
        found = {}
        for layer, head in _bar(tasks, progress):
            found[layer, head] = _one(
                model, inputs, kwargs, layer, head, how, y, score, base, watch
            )
    values = {layer: [found[layer, h] for h in range(count)] for layer, count in layers.items()}
    return layers, values, len(tasks) + 2  # the heads, the baseline and the discovery


@dataclass(frozen=True)
class Watch:
    """The modules a discovery forward ran attention in: what later forwards of the same
    model hook (``only``) and watch the calls of (``scope``, None: all)."""

    only: frozenset
    scope: frozenset | None

    @classmethod
    def of(cls, found: HeadWriter) -> Watch:
        scope = found.attention_scope()
        return cls(
            frozenset(found.attention_modules()), None if scope is None else frozenset(scope)
        )

    def run(self, gate: HeadGate, inputs, kwargs) -> torch.Tensor:
        """The model's output tensor with ``gate`` watching as narrowed; its switched-off
        heads must have been found (never a silent no-op)."""
        with torch.no_grad(), gate.narrow(self.only, self.scope).watching():
            y = output_tensor(gate.model(*inputs, **kwargs))
        check_written(gate, gate.off, "head_importance")
        return y


def _one(model, inputs, kwargs, layer, head, how, y, score, base, watch: Watch) -> float:
    """The change of one head switched off alone."""
    ablated = watch.run(HeadGate(model, {layer: [head]}, how), inputs, kwargs)
    if score is None:
        return relative_change(y, ablated)
    return base - float(score(ablated))


def _bar(tasks, progress: bool):
    if not progress:
        return tasks
    from tqdm.auto import tqdm

    return tqdm(tasks, desc="switching heads off", unit="forward")


@dataclass
class _Run:
    """What every cluster task needs, shipped to each worker once (pickled whole: dask's
    own torch serialisation would turn the modules' hook dicts into plain dicts)."""

    model: nn.Module
    inputs: tuple
    kwargs: dict
    y: torch.Tensor
    watch: Watch

    def ablated(self, layer, head, how, score, base) -> float:
        return _one(
            self.model, self.inputs, self.kwargs, layer, head, how, self.y, score, base, self.watch
        )


def _ablated(run: _Run, layer, head, how, score, base) -> float:
    return run.ablated(layer, head, how, score, base)


def _on_cluster(client, model, inputs, kwargs, tasks, y, score, base, how, progress, watch):
    from dask.distributed import as_completed

    [shipped] = client.scatter([_Run(model, inputs, kwargs, y, watch)], broadcast=True)
    futures = {
        client.submit(_ablated, shipped, layer, head, how, score, base, pure=False): (layer, head)
        for layer, head in tasks
    }
    found = {}
    done = as_completed(futures)
    if progress:
        from tqdm.auto import tqdm

        done = tqdm(done, total=len(tasks), desc="switching heads off", unit="forward")
    for future in done:
        found[futures[future]] = future.result()
    return found


def _gradient(model, inputs, kwargs, score, how):
    gate = HeadGate(model, how=how, gradient=True)
    with probing(model):
        with gate.watching():
            y = output_tensor(model(*inputs, **kwargs))
        value = differentiable_score(y, score)
        if not gate.gates:
            raise AblationError(f"{type(model).__name__} computed no attention: no head to rank")
        grads = torch.autograd.grad(value, list(gate.gates.values()), allow_unused=True)
    layers = dict(gate.seen)
    values = {
        layer: (np.zeros(layers[layer]) if g is None else g.detach().abs().double().cpu().numpy())
        for layer, g in zip(gate.gates, grads, strict=True)
    }
    return layers, values, 2  # one forward, one backward

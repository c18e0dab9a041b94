"""The gradient of a score with respect to every attention weight, in any model.

Chefer et al.'s (2021) gradient-weighted rollout weighs each layer's attention by
``relu(d score / d a_ij * a_ij)``. Fused kernels (SDPA) never form the weights, so the
gradient is not taken at them: the attention output of head ``h`` is
``o_i = sum_j a_ij v_j``, hence

    d score / d a_ij = (d score / d o_i) . v_j

:class:`ContextProbe` adds a zero that requires gradients to every head's lane of the
attention output, at the same torch calls :func:`attnpanel.ablate` gates (SDPA,
``nn.MultiheadAttention``, softmax paths to ``weights @ v``); one backward pass gives
``d score / d o`` for every layer at once, and the values ``v`` come from a capture of the
same inputs. Adding a zero changes no output bit.

Reference: H. Chefer, S. Gur, L. Wolf, "Generic Attention-model Explainability for
Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.capture import capture as capture_model
from attnpanel.capturing.modes import evaluating
from attnpanel.interventions.gate import AblationError, HeadWriter
from attnpanel.interventions.importance import (
    differentiable_score,
    output_tensor,
    probing,
)
from attnpanel.watching.lanes import Lane
from attnpanel.watching.watcher import Site


class ContextProbe(HeadWriter):
    """A zero requiring gradients added to every head's attention output, per layer.

    Attributes
    ----------
    lanes : dict of str to (torch.Tensor, Lane)
        Each layer's probe of the last forward and where its heads sit, by layer name.
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.lanes: dict[str, tuple[torch.Tensor, Lane]] = {}

    def write_output(self, site: Site, output: torch.Tensor, lane: Lane) -> torch.Tensor:
        probe = torch.zeros_like(output, requires_grad=True)
        self.lanes[site.layer] = (probe, lane)
        return output + probe


def output_gradients(
    model: nn.Module, inputs: tuple, kwargs: dict, score: Callable | None
) -> dict[str, torch.Tensor]:
    """``d score / d o`` of every layer's attention output, ``(B, H, L, E)`` by layer name,
    in one forward and one backward pass (``score``: of the output tensor; default its
    norm)."""
    probe = ContextProbe(model)
    with evaluating(model):
        with probing(model):
            with probe.watching():
                y = output_tensor(model(*inputs, **kwargs))
            value = differentiable_score(y, score)
            if not probe.lanes:
                raise AblationError(f"{type(model).__name__} computed no attention")
            lanes = list(probe.lanes.items())
            probes = [probe for _, (probe, _) in lanes]
            grads = torch.autograd.grad(value, probes, allow_unused=True)
    found = {}
    for (layer, (probe, lane)), grad in zip(lanes, grads, strict=True):
        grad = torch.zeros_like(probe) if grad is None else grad
        found[layer] = lane.canonical(grad.detach())  # (B, H, L, E)
    return found


def attention_gradients(
    model: nn.Module,
    *inputs,
    score: Callable[[torch.Tensor], torch.Tensor] | None = None,
    trace: xr.Dataset | None = None,
    **kwargs,
) -> xr.DataArray:
    """``d score / d a_ij`` of every attention weight of every layer of ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        Any model :func:`attnpanel.capture` can trace.
    *inputs
        Its positional inputs.
    score : callable, optional
        ``score(y) -> scalar tensor`` of the output tensor ``y`` (a logit, a loss, one
        output's total); default ``||y||``.
    trace : xarray.Dataset, optional
        A capture of the same model on the same inputs (its values ``v`` are read); one is
        taken here otherwise.
    **kwargs
        Keyword inputs of ``model``.

    Returns
    -------
    xarray.DataArray
        ``(layer, batch, head, query, key)`` like the capture's weights (no ``layer`` for a
        one-layer capture), ``(d score / d o_i) . v_j``. With the weights, the input of
        :func:`attnpanel.rollout`'s ``gradients=``. Costs one capture, one forward and one
        backward pass.

    Raises
    ------
    ValueError
        A capture of several kinds (an encoder-decoder DataTree), or a layer without
        ``v``.
    """
    if trace is None:
        trace = capture_model(model, *inputs, **kwargs)
    if isinstance(trace, xr.DataTree):
        raise ValueError(
            "attention gradients compose the layers of one sequence; this model's capture "
            "is an encoder-decoder DataTree"
        )
    grads = output_gradients(model, inputs, kwargs, score)
    stacked = "layer" in trace.dims
    names = [str(n) for n in np.atleast_1d(trace["layer"].values)] if "layer" in trace else []
    layers = [trace.isel(layer=i) for i in range(trace.sizes["layer"])] if stacked else [trace]
    if not names:
        names = list(grads)[:1]
    values = []
    for name, layer in zip(names, layers, strict=True):
        if name not in grads:
            raise ValueError(
                f"layer {name!r} of the capture computed no attention output the probe saw; "
                f"it saw {', '.join(grads)}"
            )
        if "v" not in layer:
            raise ValueError(f"layer {name!r}: the capture holds no values 'v'")
        position = "position" if "position" in layer["v"].dims else "key"
        v = torch.from_numpy(
            np.asarray(layer["v"].transpose("batch", "head", position, "head_dim").values)
        )
        g = grads[name].to("cpu", torch.float64)  # the trace's v is on the host
        values.append(torch.einsum("bhie,bhje->bhij", g, v.to(torch.float64)).numpy())
    weights = trace["weights"] if "weights" in trace else None
    dims = (
        ("layer", "batch", "head", "query", "key") if stacked else ("batch", "head", "query", "key")
    )
    coords = {d: trace[d] for d in dims if d in trace.coords}
    data = np.stack(values) if stacked else values[0]
    return xr.DataArray(
        data.astype(np.float32 if weights is None else weights.dtype, copy=False),
        dims=dims,
        coords=coords,
        name="attention_gradient",
        attrs={
            "long_name": "d score / d attention weight",
            "score": "score(y)" if score is not None else "||y||",
        },
    )

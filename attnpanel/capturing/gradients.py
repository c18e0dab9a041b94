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
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.ablation import AblationError, HeadGate
from attnpanel.capturing.capture import capture as capture_model
from attnpanel.capturing.importance import differentiable_score, evaluating, output_tensor
from attnpanel.capturing.intercept import fused_path_off


@dataclass(frozen=True)
class _Lane:
    """Where a layer's attention output sits in the tensor the probe was added to."""

    probe: torch.Tensor  # zeros shaped like the output, requiring gradients
    lead: torch.Size  # the attention's leading dims; flattened, (B, H)
    lead_axes: tuple[int, ...]
    query_axis: int
    batch: int

    def per_head(self, grad: torch.Tensor) -> torch.Tensor:
        """The output's gradient as ``(B, H, L, E)``."""
        rest = [a for a in range(grad.dim()) if a not in (*self.lead_axes, self.query_axis)]
        ordered = grad.permute(*self.lead_axes, self.query_axis, *rest)
        return ordered.reshape(self.batch, -1, ordered.shape[len(self.lead)], ordered.shape[-1])


class ContextProbe(HeadGate):
    """A zero requiring gradients added to every head's attention output, per layer.

    Attributes
    ----------
    lanes : dict of str to _Lane
        Each layer's probe of the last forward, by layer name.
    """

    def __init__(self, model: nn.Module):
        super().__init__(model, gradient=True)
        self.lanes: dict[str, _Lane] = {}

    def apply_gate(self, layer, gate, context, lead_shape, lead_axes, query_axis, batch):
        probe = torch.zeros_like(context, requires_grad=True)
        self.lanes[layer] = _Lane(probe, lead_shape, tuple(lead_axes), query_axis, batch)
        self.gated.add(layer)
        return context + probe


def output_gradients(
    model: nn.Module, inputs: tuple, kwargs: dict, score: Callable | None
) -> dict[str, torch.Tensor]:
    """``d score / d o`` of every layer's attention output, ``(B, H, L, E)`` by layer name,
    in one forward and one backward pass (``score``: of the output tensor; default its
    norm)."""
    probe = ContextProbe(model)
    with evaluating(model), fused_path_off():
        with torch.enable_grad():
            with probe.watching(), probe:
                y = output_tensor(model(*inputs, **kwargs))
            value = differentiable_score(y, score)
            if not probe.lanes:
                raise AblationError(f"{type(model).__name__} computed no attention")
            lanes = list(probe.lanes.items())
            probes = [lane.probe for _, lane in lanes]
            grads = torch.autograd.grad(value, probes, allow_unused=True)
    found = {}
    for (layer, lane), grad in zip(lanes, grads, strict=True):
        grad = torch.zeros_like(lane.probe) if grad is None else grad
        found[layer] = lane.per_head(grad.detach())
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
        g = grads[name].to(torch.float64)
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

"""What flows through attention, beyond the raw weights: value-weighted maps and rollout.

A weight alone does not say what a head carries. Kobayashi et al. (2020) weigh each
weight by the norm of what the key position contributes to the layer's output:

    value_weighted[b, h, i, j] = a[b, h, i, j] * || v[b, h, j] W_o^h ||

with ``W_o^h`` the head's block of columns of the output projection ``w_o`` (the head's
lane of the merged heads), or ``|| v[b, h, j] ||`` where ``w_o`` is unknown (the attrs say
which). Abnar & Zuidema (2020) compose attention across layers, the residual stream
counted in:

    A'_l = residual * I + (1 - residual) * mean_h A_l     (rows renormalised)
    R = A'_L ... A'_2 A'_1

Chefer et al. (2021) weigh each weight by the score's gradient first: with ``gradients``
(``d score / d a_ij``, :func:`attnpanel.interventions.gradients.attention_gradients`), a layer's
``A`` is ``mean_h relu(d score / d a_ij * a_ij)``, its rows normalised to sum to 1 (a row
with no positive part keeps its position: ``A_ii = 1``), then composed as above. Chefer et
al. add ``A R`` to ``R`` unnormalised; normalising the rows keeps ``residual`` the share of
the residual stream and makes every row of ``R`` sum to 1 as in the plain rollout.

References: G. Kobayashi, T. Kuribayashi, S. Yokoi, K. Inui, "Attention is Not Only a
Weight: Analyzing Transformers with Vector Norms", EMNLP 2020. S. Abnar, W. Zuidema,
"Quantifying Attention Flow in Transformers", ACL 2020. H. Chefer, S. Gur, L. Wolf,
"Generic Attention-model Explainability for Interpreting Bi-Modal and Encoder-Decoder
Transformers", ICCV 2021.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from attnpanel.traces import virtual
from attnpanel.traces.stages import attention_stage

HEAD_REDUCTIONS = ("mean", "max", "min")


def value_weighted(
    ds: xr.Dataset,
    mask=None,
    batch: int | None = None,
    head: int | None = None,
) -> xr.DataArray:
    """Kobayashi et al.'s value-weighted attention ``a_ij * || v_j W_o^h ||``.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace (dense or virtual; one layer, or a capture with a ``layer`` dim).
    mask : str, optional
        The mask the weights are recomputed under; the trace's own by default (its
        weights as the model computed them).
    batch, head : int, optional
        One sample and/or head (by position).

    Returns
    -------
    xarray.DataArray
        ``(batch, head, query, key)`` less the selected ones, with ``layer`` first for a
        stacked capture; lazy (dask) for a virtual trace, whose weights are recomputed
        tile by tile. ``attrs["measure"]`` says which norm weighs the weights.
    """
    if "layer" in ds.dims:
        layers = [
            value_weighted(ds.isel(layer=i), mask, batch, head) for i in range(ds.sizes["layer"])
        ]
        return xr.concat(layers, dim="layer").assign_coords(layer=ds["layer"])
    weighted = attention_stage(ds, "value_weighted", mask=mask, batch=batch, head=head)
    return weighted.rename("value_weighted").assign_attrs(
        long_name="value-weighted attention", lazy=virtual.is_virtual(ds)
    )


def _head_reduced(weights: np.ndarray, head) -> np.ndarray:
    """``(B, H, L, S)`` -> ``(B, L, S)``: the mean (max, min) over heads, or one head."""
    if isinstance(head, str):
        if head not in HEAD_REDUCTIONS:
            raise ValueError(f"head={head!r}: one of {HEAD_REDUCTIONS}, or a head's index")
        return getattr(np, head)(weights, axis=1)
    return weights[:, int(head)]


def _gradient_weighted(weights: np.ndarray, gradient: np.ndarray, head) -> np.ndarray:
    """``relu(grad * A)`` reduced over heads, rows normalised (an empty row: identity)."""
    positive = _head_reduced(np.maximum(np.nan_to_num(gradient * weights), 0.0), head)
    sums = positive.sum(axis=-1, keepdims=True)
    identity = np.broadcast_to(np.eye(positive.shape[-1]), positive.shape)
    return np.divide(positive, sums, out=identity.copy(), where=sums > 0)


def _layer_gradients(capture: xr.Dataset, gradients: xr.DataArray, count: int) -> list:
    """The gradients of each layer of ``capture``, checked against its shape and names."""
    if "layer" in capture.dims:
        if "layer" not in gradients.dims or gradients.sizes["layer"] != count:
            raise ValueError(
                f"gradients hold {gradients.sizes.get('layer', 1)} layers; the capture {count}"
            )
        names = [str(n) for n in capture["layer"].values]
        theirs = (
            [str(n) for n in gradients["layer"].values] if "layer" in gradients.coords else names
        )
        if names != theirs:
            raise ValueError(f"gradients of layers {theirs}, not the capture's {names}")
        found = [gradients.isel(layer=i) for i in range(count)]
    else:
        found = [gradients]
    shape = tuple(capture.sizes[d] for d in ("batch", "head", "query", "key"))
    for layer in found:
        if tuple(layer.sizes.get(d) for d in ("batch", "head", "query", "key")) != shape:
            raise ValueError(
                f"gradients of shape {dict(layer.sizes)} for a capture of "
                f"(batch, head, query, key) {shape}: not of the same inputs"
            )
    return found


def rollout(
    capture: xr.Dataset | xr.DataTree,
    residual: float = 0.5,
    head="mean",
    gradients: xr.DataArray | None = None,
) -> xr.DataArray:
    """Attention rollout (Abnar & Zuidema 2020): how much each input position feeds each
    position after the last layer, every layer's attention and its residual composed.

    Parameters
    ----------
    capture : xarray.Dataset
        A capture with a ``layer`` dim of self-attention layers of one length (in the
        order they ran: the ``layer`` coordinate's).
    residual : float
        The share of the residual stream: ``A' = residual * I + (1 - residual) * A``.
    head : {"mean", "max", "min"} or int
        How the heads of a layer make its ``A``.
    gradients : xarray.DataArray, optional
        ``d score / d a_ij`` of the same inputs, ``(layer, batch, head, query, key)``
        (:func:`attnpanel.interventions.gradients.attention_gradients`): Chefer et al.'s
        gradient-weighted rollout, each layer's ``A`` made of ``relu(grad * a)``.

    Returns
    -------
    xarray.DataArray
        ``(batch, query, key)`` float64: row ``i`` holds how much each input position
        ``j`` flows into position ``i`` of the last layer's output; each row sums to 1.

    Raises
    ------
    ValueError
        For a DataTree or a layer whose queries are not its keys (cross-attention, or
        layers of different lengths): rollout composes square maps of one sequence.
    """
    if isinstance(capture, xr.DataTree):
        groups = [node.path for node in capture.subtree if node.has_data]
        raise ValueError(
            "rollout composes the layers of one sequence; this capture has groups "
            f"{', '.join(groups)} (an encoder-decoder): roll out one of them, such as "
            f"rollout(tree[{groups[0]!r}].to_dataset())"
        )
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual={residual}: a share between 0 and 1")
    if capture.sizes.get("query") != capture.sizes.get("key"):
        raise ValueError(
            f"rollout composes square maps; these layers have {capture.sizes.get('query')} "
            f"queries and {capture.sizes.get('key')} keys (cross-attention)"
        )
    layers = (
        [capture.isel(layer=i) for i in range(capture.sizes["layer"])]
        if ("layer" in capture.dims)
        else [capture]
    )
    length = capture.sizes["query"]
    identity = np.eye(length)
    weighted = None if gradients is None else _layer_gradients(capture, gradients, len(layers))
    flow = None
    for index, layer in enumerate(layers):
        weights = np.asarray(attention_stage(layer, "softmax").values, dtype=np.float64)
        if weighted is None:
            heads = _head_reduced(np.nan_to_num(weights), head)
        else:
            order = weighted[index].transpose("batch", "head", "query", "key")
            grad = np.asarray(order.values, dtype=np.float64)
            heads = _gradient_weighted(weights, grad, head)
        mixed = residual * identity + (1.0 - residual) * heads
        sums = mixed.sum(axis=-1, keepdims=True)
        mixed = np.divide(
            mixed, sums, out=np.broadcast_to(identity, mixed.shape).copy(), where=sums > 0
        )
        flow = mixed if flow is None else mixed @ flow  # later layers on the left
    coords = {d: capture[d] for d in ("batch", "query", "key") if d in capture.coords}
    return xr.DataArray(
        flow,
        dims=("batch", "query", "key"),
        coords=coords,
        name="rollout",
        attrs={
            "residual": residual,
            "head": str(head),
            "layers": len(layers),
            "long_name": "attention rollout",
            "weighted": "plain" if gradients is None else "relu(d score / d a * a)",
        },
    )

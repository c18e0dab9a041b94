"""Which earlier parts of the model wrote a cell's score: the score split over the
components whose outputs were added into the layer's input (the embedding, each earlier
head, each MLP), the query side by the key side.

Where a layer's q and k are linear in its input ``x`` (``q_i = W_q x_i + b_q``: a capture
keeps ``w_q`` and ``w_k`` only where they reproduce the model's q and k), and ``x`` is a
sum of parts ``x = sum_n c_n``, the score is bilinear:

    s_ij = q_i . k_j * scale = sum_n sum_m (W_q c_n,i) . (W_k c_m,j) * scale

(with the biases as a part of their own on either side). The table ``T[n, m]`` adds up to
``q_i . k_j * scale`` exactly; its row sums are each part's share through the query, its
column sums through the key. The parts are found as the model runs, by following the torch
calls that made ``x`` (:class:`StreamProbe`: the same watching as capture): an addition is
followed into both terms, a ``layer_norm`` is frozen at the run's own statistics (linear
in its input: each part centred and divided by the run's standard deviation, scaled by its
weight; its bias a part of its own), a dropout (evaluation: the identity) is followed
through. What no addition made is a part named by the outermost module that returned it;
an attention layer's output is split into its heads (``context_h W_o,h``, from a capture of
the same sample) and the rest (its output bias). As TransformerLens' attribution does, the
LayerNorms are frozen: the split is exact for this input, not a statement about others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.modes import evaluating
from attnpanel.interventions.attribution import (
    AttributionError,
    CellProbe,
    Path,
    blocked_cell,
    is_blocked,
    one_sample,
)
from attnpanel.traces.layers import layers as capture_layers
from attnpanel.traces.layers import select
from attnpanel.watching.watcher import Site

ADDS = {"add", "__add__", "__radd__"}
PASSING_CALLS = {"dropout", "contiguous", "clone"}
PARTS_TOLERANCE = 1e-4  # of the input's largest value: the parts must add up to it


class StreamProbe(CellProbe):
    """A :class:`CellProbe` that also keeps how each tensor was made (additions, layer
    norms, dropouts) and which modules returned it, to split the layer's input."""

    def __init__(self, layer: str, head: int, query: int, key: int):
        super().__init__(layer, head, query, key)
        self.made: dict[int, tuple] = {}
        self.returned: dict[int, list[str]] = {}  # the modules that returned it, inner first
        # a Linear's output: (its name, weight, bias, input): a projection after a layer
        self.projected: dict[int, tuple] = {}
        self.kept: list = []  # every tensor named above, alive (an id is never reused)
        self.site: Site | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if isinstance(result, torch.Tensor) and (
            name in ADDS | PASSING_CALLS or name == "layer_norm"
        ):
            if not any(result is a for a in args):  # in place: no earlier value to follow
                self.made[id(result)] = (name, args, kwargs or {}, self.module)
                self.kept.append(result)
        return result

    def left(self, running, output) -> None:
        passing = isinstance(running.module, nn.Dropout | nn.Identity)  # (names no part)
        if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
            output = output[0]  # (hidden states, weights ...): Hugging Face's layers
        if isinstance(output, torch.Tensor) and not passing:
            self.returned.setdefault(id(output), []).append(running.name)
            if isinstance(running.module, nn.Linear) and running.args:
                lin = running.module
                self.projected[id(output)] = (running.name, lin.weight, lin.bias, running.args[0])
                self.kept.append(running.args[0])
            self.kept.append(output)

    def softmax(self, site: Site, func, args, kwargs):
        self.site = site
        return super().softmax(site, func, args, kwargs)

    def attention(self, site: Site, func, args, kwargs):
        self.site = site
        return super().attention(site, func, args, kwargs)


class Parts:
    """The parts a tensor of the run is a sum of, found by following how it was made."""

    def __init__(self, probe: StreamProbe, heads: dict[str, tuple[np.ndarray, np.ndarray]]):
        self.probe = probe
        self.heads = heads  # an attention layer's (context (H, L, E), w_o (D, H E))
        self.found: dict[str, torch.Tensor] = {}

    def split(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{part name: (L, D) tensor}`` adding up to ``t[0]``."""
        self.found = {}
        self._walk(t.detach().double(), t, lambda c: c, "the model")
        return self.found

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.found[name] = self.found.get(name, 0) + value

    def _walk(self, value, t, linear, where: str) -> None:
        """Add ``linear(part)`` for every part of ``t`` (whose value is ``value``)."""
        made = self.probe.made.get(id(t)) if isinstance(t, torch.Tensor) else None
        if made is None:
            self._leaf(value, t, linear, where)
            return
        name, args, kwargs, module = made
        if name in ADDS:
            a, b = args[0], args[1]
            alpha = kwargs.get("alpha", 1)
            for term, factor in ((a, 1), (b, alpha)):
                if isinstance(term, torch.Tensor):  # (its value unscaled: linear scales it)
                    self._walk(term.detach().double(), term,
                               lambda c, f=factor: linear(c * f), module)  # fmt: skip
                else:
                    self._add(f"constant added in {module or 'the model'}",
                              linear(torch.full_like(value, float(term) * factor)))  # fmt: skip
        elif name in PASSING_CALLS:
            self._walk(value, args[0], linear, module)
        else:  # layer_norm(input, shape, weight, bias, eps): frozen at this run's statistics
            source = args[0]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            bias = args[3] if len(args) > 3 else kwargs.get("bias")
            eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
            x = source.detach().double()
            std = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
            scale = weight.detach().double() if weight is not None else 1.0

            def frozen(c, std=std, scale=scale):
                return linear((c - c.mean(-1, keepdim=True)) / std * scale)

            self._walk(x, source, frozen, module)
            if bias is not None:
                self._add(f"{module} bias (LayerNorm)",
                          linear(torch.zeros_like(x) + bias.detach().double()))  # fmt: skip

    def _leaf(self, value, t, linear, where: str) -> None:
        names = self.probe.returned.get(id(t), []) if isinstance(t, torch.Tensor) else []
        layer = next((n for n in reversed(names) if n in self.heads), None)
        if layer is None and self._projected_heads(t, linear):
            return
        if layer is not None:
            context, w_o = self.heads[layer]
            width = context.shape[-1]
            rest = value[0].clone()
            for h in range(context.shape[0]):
                lane = slice(h * width, (h + 1) * width)
                part = torch.from_numpy(context[h] @ w_o[:, lane].T).double()[None]
                self._add(f"{layer} head {h}", linear(part))
                rest = rest - part[0]
            self._add(f"{layer} output bias (and rest)", linear(rest[None]))
            return
        name = names[-1] if names else f"the input of {where}"
        self._add(name or "the model's input", linear(value))

    def _projected_heads(self, t, linear) -> bool:
        """Split ``t`` into heads where it is a Linear's output of an attention layer's
        output (the merged heads: Hugging Face's ``attention.output.dense`` after
        ``attention.self``); True where it did."""
        found = self.probe.projected.get(id(t)) if isinstance(t, torch.Tensor) else None
        if found is None:
            return False
        name, weight, bias, source = found
        before = self.probe.returned.get(id(source), [])
        layer = next((n for n in reversed(before) if n in self.heads), None)
        if layer is None:
            return False
        context = self.heads[layer][0]
        width = context.shape[-1]
        w = weight.detach().double()
        if w.shape[1] != context.shape[0] * width:
            return False
        for h in range(context.shape[0]):
            lane = slice(h * width, (h + 1) * width)
            self._add(
                f"{layer} head {h}",
                linear(torch.from_numpy(context[h]).double()[None] @ w[:, lane].T),
            )
        if bias is not None:
            self._add(
                f"{name} bias",
                linear(torch.zeros_like(t.detach().double()) + bias.detach().double()),
            )
        return True


def component_attribution(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    layer: str,
    head: int,
    query: int,
    key: int,
    sample: int = 0,
) -> xr.DataArray:
    """Split one cell's score over the earlier components that wrote the layer's input,
    the query side by the key side (see the module's docstring).

    Parameters
    ----------
    model, inputs, layer, head, query, key, sample
        As :func:`attnpanel.score_attribution`.

    Returns
    -------
    xarray.DataArray
        ``(query_part, key_part)``: ``(W_q c_n,i) . (W_k c_m,j) * scale`` of every pair of
        parts; it adds up to ``q_i . k_j * scale`` (attrs ``product``; ``score`` the model's
        own cell, ``additive_bias`` the difference: a mask's or a position bias's).

    Raises
    ------
    AttributionError
        A cell the model does not have or does not use (as :func:`score_attribution`); a
        layer whose q or k is not linear in its input (no ``w_q``/``w_k`` in its capture);
        an input whose parts could not be followed (they miss it).
    """
    from attnpanel.capturing.capture import capture

    names, ones = one_sample(inputs, sample)
    probe = StreamProbe(layer, head, query, key)
    with evaluating(model), torch.no_grad():
        path = Path(model, probe, ones, [], names)
        path.run([])
        args = dict(zip(names, ones, strict=True)) if names is not None else {}
        traced = capture(model, **args) if names is not None else capture(model, *ones)
    layers = {entry.name: select(traced, entry.name) for entry in capture_layers(traced)}
    if layer not in layers:
        raise AttributionError(f"{layer} is not in a capture of the model: {', '.join(layers)}")
    own = layers[layer]
    missing = [name for name in ("w_q", "w_k")
               if name not in own or not bool(np.isfinite(own[name]).all())]  # fmt: skip
    if missing:
        raise AttributionError(
            f"the q or k of {layer} is not linear in its input (its capture has no "
            f"{', '.join(missing)}: a rotary embedding, or a linear attention's feature map): "
            "its score cannot be split "
            "over earlier components"
        )
    if own.sizes["query"] != own.sizes["key"] or own.attrs.get("attention") == "cross":
        raise AttributionError(
            f"{layer} is cross-attention: its keys come from another sequence than the "
            "input its queries read, and only that input's parts are followed"
        )
    scores, q_i, k_j, scale = probe.found  # a cell: (B, 1, 1), (B, 1, E), (B, 1, E)
    scores, q_i, k_j = scores[:, 0, 0], q_i[:, 0], k_j[:, 0]
    if is_blocked(scores[0]):
        raise blocked_cell(layer, head, query, key)
    x = _layer_input(probe.site, own)
    heads = {name: (ds["context"].values[0], ds["w_o"].values) for name, ds in layers.items()
             if "context" in ds and "w_o" in ds and name != layer}  # fmt: skip
    parts = Parts(probe, heads).split(x)
    missed = float((sum(parts.values())[0] - x.detach().double()[0]).abs().max())
    if not np.isfinite(missed) or missed > PARTS_TOLERANCE * max(float(x.abs().max()), 1.0):
        raise AttributionError(
            f"the additions into {layer}'s input could not be followed: its parts miss it by "
            f"{missed:.2g} (a computation other than additions, layer norms and dropouts)"
        )
    return _table(parts, own, (q_i, k_j, scale, scores), (head, query, key)).assign_attrs(
        layer=layer, sample=sample, parts_error=missed,
        method="bilinear split of q . k over the parts of the layer's input, layer norms "
        "frozen at this run's statistics",
    )  # fmt: skip


def _layer_input(site: Site, own: xr.Dataset) -> torch.Tensor:
    """The tensor the layer's module was called with: its first input of the width of
    ``w_q``'s input."""
    width = own.sizes["feature_in"]
    running = site.running
    for value in (*running.args, *running.kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[-1] == width:
            return value
    raise AttributionError(f"{site.layer} was called with no (batch, position, {width}) input")


def _table(parts: dict, own: xr.Dataset, found, cell) -> xr.DataArray:
    q_i, k_j, scale, scores = found
    head, query, key = cell
    heads, kv_heads = int(own.sizes["head"]), int(own.attrs.get("kv_heads", own.sizes["head"]))
    width = q_i.shape[-1]
    group = heads // kv_heads
    w_q = torch.from_numpy(own["w_q"].values).double()[head * width : (head + 1) * width]
    kv = head // group
    w_k = torch.from_numpy(own["w_k"].values).double()[kv * width : (kv + 1) * width]
    names = list(parts)
    queries = [parts[n][0, query] @ w_q.T for n in names]
    keys = [parts[n][0, key] @ w_k.T for n in names]
    q_own, k_own = q_i[0].detach().double(), k_j[0].detach().double()
    queries.append(q_own - sum(queries))  # the projection's bias (0 without one)
    keys.append(k_own - sum(keys))
    names_q = [*names, "q bias"]
    names_k = [*names, "k bias"]
    table = (torch.stack(queries) @ torch.stack(keys).T * scale).numpy()
    product = float(q_own @ k_own * scale)
    score = float(scores[0])
    return xr.DataArray(
        table,
        dims=("query_part", "key_part"),
        coords={"query_part": names_q, "key_part": names_k},
        name="component_attribution",
        attrs=dict(head=head, query=query, key=key, product=product, score=score,
                   additive_bias=score - product, scale=float(scale),
                   completeness_error=float(table.sum()) - product),
    )  # fmt: skip

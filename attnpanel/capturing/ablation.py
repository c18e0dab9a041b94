"""Switch attention heads off inside a real model, through the torch calls capture watches.

:func:`ablate` is a context manager: inside it the model runs with the given heads switched
off, found the way :func:`attnpanel.capture` finds attention (no adapter, no rewritten
model): a :class:`HeadGate`, a :class:`torch.overrides.TorchFunctionMode`, sees each
``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``, attnpanel's own
bounded attention and every ``softmax`` over a ``q . k`` product followed to its
``weights @ v``. The head's lane of that attention output (its ``weights @ v``, before the
heads are merged and projected) is multiplied by a gate: 0 switches the head off
(``how="zero"``); with ``how="mean"`` the lane is replaced by its mean over the query
positions. The other heads' lanes are multiplied by exactly 1, so they are bit-identical.

Layers are named as a capture's ``layer`` coordinate names them: the innermost module
running the call (the model's class name for the model itself), ``name[1]``, ``name[2]``
... for its later calls in one forward.

The same gates, kept at 1 and made to require gradients, give Michel et al.'s (2019)
head-importance estimate in one backward pass (:mod:`attnpanel.capturing.importance`).

Shapes use ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys and ``E`` head dim.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attnpanel.capturing.intercept import (
    KEEPS,
    MASKING,
    PRODUCTS,
    SCALES,
    SOFTMAX,
    VIEWS,
    Lineage,
    einsum_parts,
    fused_path_off,
    product_operands,
)
from attnpanel.kernels import tiles

HOWS = ("zero", "mean")
_MHA = inspect.signature(F.multi_head_attention_forward)
_INDEXED = re.compile(r"^(.*)\[(\d+)\]$")


class AblationError(ValueError):
    """A layer or head that the model does not have, or an attention whose heads cannot be
    switched off."""


def check_how(how: str) -> None:
    """Raise :class:`AblationError` unless ``how`` is a way to switch a head off."""
    if how not in HOWS:
        raise AblationError(f"how={how!r}: a head is switched off by one of {HOWS}")


@dataclass(frozen=True)
class _Scores:
    """A tensor computed from a ``q . k`` product, on its way to a softmax."""


@dataclass(frozen=True)
class _Weights:
    """A softmax output on its way to ``weights @ v``."""

    layer: str
    lead: torch.Size  # the weights' leading dims, (B, H) or a flattening of them
    batch: int  # B: lead flattened is (B, H)
    heads: int


_SCORES = _Scores()


class HeadGate(TorchFunctionMode):
    """Multiply each head's lane of the attention output by a gate, in any model.

    Parameters
    ----------
    model : torch.nn.Module
        The model whose modules name the layers.
    off : mapping of str to list of int, optional
        The heads to switch off, by layer name.
    how : {"zero", "mean"}
        A switched-off lane becomes 0, or its mean over the query positions.
    gradient : bool
        Gate every head of every layer with a 1 that requires gradients (:attr:`gates`),
        for the gradient estimate of head importance.

    Attributes
    ----------
    seen : dict of str to int
        Every layer that computed attention while the gate was on, with its head count.
    gates : dict of str to torch.Tensor
        With ``gradient``: each layer's ``(H,)`` gates of the last forward.
    """

    def __init__(
        self,
        model: nn.Module,
        off: Mapping[str, list[int]] | None = None,
        how: str = "zero",
        gradient: bool = False,
    ):
        super().__init__()
        check_how(how)
        self.model, self.how, self.gradient = model, how, gradient
        self.off = {} if off is None else dict(off)
        self.seen: dict[str, int] = {}
        self.gated: set[str] = set()
        self.gates: dict[str, torch.Tensor] = {}
        self._root = type(model).__name__
        self._stack: list[tuple[str, nn.Module, int | None]] = []
        self._counts: dict[str, int] = {}
        self._known = Lineage()
        self._hooks: list = []

    # the running module, as capture attributes a call

    @contextlib.contextmanager
    def watching(self) -> Iterator[HeadGate]:
        """Hook every module of the model while open (the layer names come from them).

        The hooks follow only this thread's forwards, as the mode itself gates only them:
        other threads may run the same model at the same time, switched off or not.
        """

        thread = threading.get_ident()

        def enter(module, args, kwargs, name):
            if threading.get_ident() != thread:
                return  # another thread's forward of the same model (it is not gated)
            if not self._stack:
                self._counts.clear()  # a new forward: layer names count from 0 again
            first = next(
                (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None
            )
            batch = int(first.shape[0]) if first is not None and first.dim() >= 2 else None
            self._stack.append((name, module, batch))

        def leave(module, args, kwargs, output):
            if threading.get_ident() != thread:
                return
            while self._stack:
                if self._stack.pop()[1] is module:
                    break

        for name, module in self.model.named_modules():
            self._hooks.append(
                module.register_forward_pre_hook(
                    lambda m, a, k, name=name: enter(m, a, k, name), with_kwargs=True
                )
            )
            self._hooks.append(
                module.register_forward_hook(leave, with_kwargs=True, always_call=True)
            )
        try:
            yield self
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._stack.clear()

    def _layer(self) -> str:
        base = (self._stack[-1][0] if self._stack else "") or self._root
        count = self._counts.get(base, 0)
        self._counts[base] = count + 1
        return base if count == 0 else f"{base}[{count}]"

    def _batch(self, lead: torch.Size) -> tuple[int, int]:
        """``(B, H)`` of leading dims, as capture reads them (``(B, H)``, or ``(B * H)``
        split by the batch of the module's first input)."""
        if len(lead) == 2:
            return int(lead[0]), int(lead[1])
        count = 1
        for size in lead:
            count *= int(size)
        hint = self._stack[-1][2] if self._stack else None
        if hint and len(lead) == 1 and count % hint == 0:
            return hint, count // hint
        if lead:
            return int(lead[0]), count // int(lead[0])
        return 1, 1

    # the gate

    def _gate(self, layer: str, heads: int, like: torch.Tensor) -> torch.Tensor | None:
        """The layer's ``(H,)`` gate, or None when every head stays as it is."""
        self.seen[layer] = heads
        if self.gradient:
            gate = torch.ones(heads, device=like.device, requires_grad=True)
            self.gates[layer] = gate
            return gate
        off = self.off.get(layer)
        if not off:
            return None
        wrong = [h for h in off if not 0 <= h < heads]
        if wrong:
            raise AblationError(
                f"layer {layer!r} has {heads} heads (0 to {heads - 1}); there is no head "
                f"{', '.join(map(str, wrong))}"
            )
        gate = torch.ones(heads, device=like.device)
        gate[list(off)] = 0.0
        return gate

    def apply_gate(self, layer, gate, context, lead_shape, lead_axes, query_axis, batch):
        """``context`` with each head's lane times its gate (or, for ``how="mean"``,
        moved towards its mean over the queries by ``1 - gate``).

        ``lead_shape``: the attention's leading dims, found at ``lead_axes`` of ``context``
        (their flattening is ``(B, H)``).
        """
        full = gate.to(context.dtype).repeat(batch).reshape(lead_shape)
        shape = [1] * context.dim()
        for axis, size in zip(lead_axes, lead_shape, strict=True):
            shape[axis] = size
        full = full.reshape(shape)
        self.gated.add(layer)
        if self.how == "zero":
            return context * full
        mean = context.mean(dim=query_axis, keepdim=True)
        return context * full + (1 - full) * mean

    def _gate_lead_first(self, layer: str, context: torch.Tensor, lead: torch.Size):
        """Gate a ``(*lead, L, E)`` context (SDPA, bounded attention, ``weights @ v``)."""
        batch, heads = self._batch(lead)
        gate = self._gate(layer, heads, context)
        if gate is None:
            return context
        axes = list(range(len(lead)))
        return self.apply_gate(layer, gate, context, lead, axes, context.dim() - 2, batch)

    # torch calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention":
            result = func(*args, **kwargs)
            query = args[0] if args else kwargs["query"]
            return self._gate_lead_first(self._layer(), result, query.shape[:-2])
        if name == "multi_head_attention_forward":
            return self._mha(func, args, kwargs)
        if name == "attention" and func is tiles.attention:
            context, lse = func(*args, **kwargs)
            return self._gate_lead_first(self._layer(), context, context.shape[:-2]), lse
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor) or not result.is_floating_point():
            return result
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        known = next(((t, info) for t in tensors if (info := self._known.of(t)) is not None), None)
        if known is None:
            if name in PRODUCTS and product_operands(name, args) is not None:
                self._known.follow(result, _SCORES)
            return result
        source, info = known
        if isinstance(info, _Scores):
            return self._after_scores(name, args, kwargs, source, result)
        return self._after_weights(name, args, source, info, result)

    def _after_scores(self, name, args, kwargs, source, result):
        if name in SOFTMAX:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim in (-1, source.dim() - 1):
                lead = source.shape[:-2]
                batch, heads = self._batch(lead)
                self._known.follow(result, _Weights(self._layer(), lead, batch, heads))
            return result
        same_cells = result.shape[-2:] == source.shape[-2:]
        if same_cells and name in SCALES | MASKING | KEEPS | VIEWS:
            self._known.follow(result, _SCORES)
        return result

    def _after_weights(self, name, args, source, info: _Weights, result):
        if name in KEEPS or (name in VIEWS and result.shape[-2:] == source.shape[-2:]):
            self._known.follow(result, info)
            return result
        if name not in PRODUCTS:
            return result
        if name in ("matmul", "bmm"):
            if args[0] is not source:
                return result
            gate = self._gate(info.layer, info.heads, result)
            if gate is None:
                return result
            axes = list(range(result.dim() - 2 - len(info.lead), result.dim() - 2))
            return self.apply_gate(
                info.layer, gate, result, info.lead, axes, result.dim() - 2, info.batch
            )
        parts = einsum_parts(args)
        if parts is None:
            return result
        (sub_a, sub_b), out, (a, b) = parts
        sub_w = sub_a if a is source else sub_b if b is source else None
        if sub_w is None or len(sub_w) != len(info.lead) + 2:
            return result
        gate = self._gate(info.layer, info.heads, result)
        if gate is None:
            return result
        axes = [out.index(c) for c in sub_w[:-2]]
        query_axis = out.index(sub_w[-2])
        return self.apply_gate(info.layer, gate, result, info.lead, axes, query_axis, info.batch)

    def _mha(self, func, args, kwargs):
        """``nn.MultiheadAttention``'s function: the heads are merged and projected inside
        it, so it runs with an identity output projection (exact: each output is one
        product by 1), the merged lanes are gated, then projected by the layer's own."""
        layer = self._layer()
        bound = _MHA.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        query, heads = a["query"], a["num_heads"]
        gate = self._gate(layer, heads, query)
        if gate is None:
            return func(*args, **kwargs)
        w_o, b_o = a["out_proj_weight"], a["out_proj_bias"]
        width = w_o.shape[1]
        a["out_proj_weight"] = torch.eye(width, dtype=w_o.dtype, device=w_o.device)
        a["out_proj_bias"] = None if b_o is None else torch.zeros_like(b_o)
        merged, weights = func(*bound.args, **bound.kwargs)  # (L, B, D) or (L, D)
        lanes = merged.reshape(*merged.shape[:-1], heads, width // heads)  # (L, B, H, E)
        batch = 1 if merged.dim() == 2 else merged.shape[1]
        lead_axes = [lanes.dim() - 2] if merged.dim() == 2 else [1, 2]
        lead = torch.Size([heads] if merged.dim() == 2 else [batch, heads])
        gated = self.apply_gate(layer, gate, lanes, lead, lead_axes, 0, batch)
        return F.linear(gated.reshape(merged.shape), w_o, b_o), weights


def _heads_asked(heads: Mapping[str, int | list[int]]) -> dict[str, list[int]]:
    if not isinstance(heads, Mapping):
        raise AblationError(
            f"heads must map layer names to head indices, such as {{'layers.0.attn': [3]}}; "
            f"got {type(heads).__name__}"
        )
    asked = {}
    for layer, found in heads.items():
        found = [found] if isinstance(found, int) else list(found)
        if not all(isinstance(h, int) and not isinstance(h, bool) for h in found):
            raise AblationError(f"layer {layer!r}: heads are integers, got {found!r}")
        asked[str(layer)] = found
    return asked


def _check_layers(model: nn.Module, layers) -> None:
    """Every asked layer names a module of the model (or the model itself)."""
    modules = {name for name, _ in model.named_modules() if name}
    root = type(model).__name__
    for layer in layers:
        match = _INDEXED.match(layer)
        base = match.group(1) if match else layer
        if base in modules or base == root:
            continue
        looks = [
            name
            for name, module in model.named_modules()
            if name and re.search("attn|attention", type(module).__name__ + name, flags=re.I)
        ]
        hint = f"; its attention-like modules: {', '.join(looks[:12])}" if looks else ""
        raise AblationError(f"{root} has no layer {layer!r}{hint}")


@contextlib.contextmanager
def ablate(
    model: nn.Module, heads: Mapping[str, int | list[int]], how: str = "zero"
) -> Iterator[HeadGate]:
    """Run ``model`` with the given attention heads switched off, inside a ``with`` block.

    The head's lane of the attention output (its ``weights @ v``, before the head merge and
    the output projection) is set to zero (``how="zero"``) or to its mean over the query
    positions (``how="mean"``), in whichever torch call computes it: SDPA (fused QKV,
    ``is_causal``, grouped-query), ``nn.MultiheadAttention``, an einsum or matmul softmax
    path (eager Hugging Face, NILMFormer). Nothing of the model is changed: on exit it
    computes bit-identically to before.

    Parameters
    ----------
    model : torch.nn.Module
        Any model.
    heads : mapping of str to int or list of int
        Layer names, as a capture's ``layer`` coordinate names them (the module running the
        attention; ``name[1]`` for its second call in one forward), to the heads to switch
        off.
    how : {"zero", "mean"}
        What a switched-off head's lane becomes.

    Yields
    ------
    HeadGate
        Its ``seen`` says which layers computed attention, and their head counts.

    Raises
    ------
    AblationError
        A layer that is no module of the model; a head index the layer does not have
        (raised by the forward that meets it); on exit, a layer that never computed
        attention inside the block while others did, or whose head lanes could not be
        found, naming the layers that did.

    Examples
    --------
    >>> with attnpanel.ablate(model, heads={"layers.1.attn": [3, 5]}):  # doctest: +SKIP
    ...     y = model(x)
    """
    asked = _heads_asked(heads)
    _check_layers(model, asked)
    gate = HeadGate(model, asked, how)
    with fused_path_off(), gate.watching(), gate:  # the fused encoder skips the MHA call
        yield gate
    if gate.seen:
        _check_done(gate, asked)


def _check_done(gate: HeadGate, asked: Mapping[str, list[int]]) -> None:
    ran = ", ".join(f"{name} ({heads} heads)" for name, heads in gate.seen.items())
    for layer, heads in asked.items():
        if layer not in gate.seen:
            raise AblationError(
                f"layer {layer!r} computed no attention inside ablate(); the layers that did: {ran}"
            )
        if heads and layer not in gate.gated:
            raise AblationError(
                f"layer {layer!r}: its attention ran, but the heads' lanes of its output "
                "(weights @ v) were not found, so no head was switched off"
            )


def attention_heads(model: nn.Module, *inputs, **kwargs) -> dict[str, int]:
    """Every layer that computes attention in one forward of ``model``, with its heads.

    Layer names are a capture's ``layer`` coordinate values. The forward runs without
    gradients and changes nothing.
    """
    gate = HeadGate(model)
    with fused_path_off(), gate.watching(), gate, torch.no_grad():
        model(*inputs, **kwargs)
    return dict(gate.seen)

"""Capture exact attention traces from any PyTorch model, with no adapter.

:func:`capture` runs a model once (eval mode, no gradients) inside an
:class:`~attnpanel.capturing.recorder.AttentionRecorder`, which sees every attention computation
itself: ``F.scaled_dot_product_attention`` calls, ``F.multi_head_attention_forward``
(``nn.MultiheadAttention``) and softmaxes over a ``q . k`` product, however the module
around them is written. Each one becomes a trace (see :mod:`attnpanel.trace`) with q and k
as they entered the product, the scale, every blocked cell and additive bias per sample
and head, and the weights.

What only a module knows is read from the module that ran the call: its input ``x``, its
``output`` and its projection matrices. Readers of projections register themselves with
:func:`~attnpanel.capturing.projections.projection_reader`; a matrix is kept only when it
reproduces the captured q, k or v (or the output), so a model that rotates q and k after
the projection (rotary embeddings) gets no ``w_q`` rather than a wrong one.

One capture gives one object: a Dataset whose ``layer`` dim stacks the calls, or, when the
model has several kinds (encoder self-attention, decoder self-attention, cross-attention),
an ``xarray.DataTree`` with one group per kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing import readers  # noqa: F401 - registers the attention readers
from attnpanel.capturing.modes import evaluating
from attnpanel.capturing.projections import call_tensors, read_projections
from attnpanel.capturing.recorder import AttentionCall, AttentionRecorder, CaptureError
from attnpanel.capturing.stacking import assemble, layer_sizes
from attnpanel.kernels.masks import cached_mask
from attnpanel.traces.build import TraceParts, trace_parts
from attnpanel.traces.positions import Layout
from attnpanel.watching.linear import FEATURES
from attnpanel.watching.modules import own_name


@dataclass(frozen=True)
class FusedQKV:
    """A hint about a module whose one projection produces q, k and v together.

    Capture needs no hint; one that is given is checked against what the module really
    computed, and a hint that does not hold (a mask or scale the module does not apply)
    is refused with a message.
    """

    qkv: str = "qkv"  # child nn.Linear(d_model, 3 * d_model) whose output is [q | k | v]
    n_heads: int | None = None  # None: whatever the module's attention call uses
    out: str | None = None  # child Linear after the head merge
    mask: str | torch.Tensor | None = None  # the mask the caller expects the module to apply
    scale: float | None = None  # the score multiplier the caller expects


def capture(
    model: nn.Module,
    *inputs,
    fused: Mapping[str, str | FusedQKV] | None = None,
    tokens=None,
    time=None,
    layout: Layout | None = None,
    dense: bool | None = None,
    **kwargs,
) -> xr.Dataset | xr.DataTree:
    """Run ``model`` once and return an exact trace of every attention it computes.

    Parameters
    ----------
    model : torch.nn.Module
        Any model: its attention is found by watching the computation, not by class.
    *inputs
        Positional inputs of ``model``.
    fused : mapping of str to str or FusedQKV, optional
        Hints to check (module name to its fused projection, or a :class:`FusedQKV`); a
        hint that does not match what the module computes raises :class:`CaptureError`.
    tokens : tokenizer, list of str or list of list of str, optional
        Token labels of the positions: a Hugging Face tokenizer (the tokens are read from
        ``input_ids``), one sequence of strings, or one sequence per batch item.
    time : array-like, optional
        Timestamps of the positions, ``(position,)`` or ``(batch, position)``; with
        ``layout``, the input's own (``T`` steps), laid out over the positions.
    layout : attnpanel.Layout, optional
        What the positions are beyond one per time step: named tokens before or after the
        steps (NILMFormer's ``Layout(after=("statistics",))``), spans of steps (PatchTST's
        ``Layout(patch=16, stride=8)``); see :mod:`attnpanel.traces.positions`. By
        default what a Hugging Face config says (PatchTST's patches and CLS token).
    dense : bool, optional
        Record each attention's weights (True), or each row's log-sum-exp instead, from
        which every cell is recomputed on demand (False: a virtual trace, see
        ``docs/tiles.md``). By default an attention is recorded with its weights when they
        fit :func:`attnpanel.traces.virtual.wants_dense`, else virtually; a virtual trace needs a
        mask of a mode (none, diagonal, causal) and padded keys, and no additive bias.
    **kwargs
        Keyword inputs of ``model`` (``attention_mask``, ...).

    Returns
    -------
    xarray.Dataset or xarray.DataTree
        A Dataset with a leading ``layer`` dim whose coordinate holds the module names (a
        repeated call of one module gets ``name[1]``, ``name[2]`` ...), or, when the model
        computes attention of several kinds or shapes, a DataTree with one such Dataset
        per group (``encoder.layers.self_attn``, ``decoder.layers.encoder_attn`` ...).
        What the model blocked per sample and head is in ``sample_mask``, its additive
        biases in ``bias`` and its padded positions in ``padding`` (see ``docs/trace.md``).

    Raises
    ------
    CaptureError
        When the model computes no attention, when an attention cannot be reproduced
        exactly from its q, k and mask (the message names the module and why), or when a
        ``fused`` hint does not hold.

    Examples
    --------
    >>> traces = capture(model, x)  # doctest: +SKIP
    >>> encoded = tokenizer(text, return_tensors="pt")  # doctest: +SKIP
    >>> traces = capture(bert, **encoded, tokens=tokenizer)  # doctest: +SKIP
    """
    hints = _hints(model, fused or {}) if isinstance(model, nn.Module) else {}
    recorder, names = record_calls(model, inputs, kwargs, dense)
    calls = recorder.calls
    _check_hints(hints, calls, names)
    labels = _token_labels(tokens, inputs, kwargs)
    layout = layout or Layout.of_model(model)
    first = next((t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    source = _describe(model)
    traces = []
    for call, name in zip(calls, names, strict=True):
        module_call = recorder.module_calls.get(id(call))
        try:
            with torch.no_grad():
                consumer = recorder.consumers.get(id(call))
                parts = _trace(
                    call, module_call, labels, (time, layout), f"{source}: {name}", consumer
                )
                traces.append(parts)
        except ValueError as error:
            raise CaptureError(f"module {name!r}: {error}") from error
    if labels is not None and not any("token" in t.coords for t in traces):
        sizes = layer_sizes(traces[0])
        raise CaptureError(
            f"module {names[0]!r}: tokens are {len(labels)} x {len(labels[0])} labels, but "
            f"its attention has {sizes['batch']} x {sizes['query']} positions"
        )
    return assemble(traces, names, calls, source, first)


def record_calls(
    model: nn.Module,
    inputs: tuple,
    kwargs: dict,
    dense: bool | None = None,
    recorder: AttentionRecorder | None = None,
) -> tuple[AttentionRecorder, list[str]]:
    """Run ``model`` once (eval mode, no gradients) and return the recorder of every
    attention it computed, with each call's layer name (a capture's ``layer`` values).

    The torch tensors of each call, before any trace is built: for readers that need
    only some numbers of each attention (a survey's statistics), not a trace. A
    ``recorder`` of one's own (an :class:`AttentionRecorder` subclass) may act on each
    call as it is recorded.

    Raises
    ------
    CaptureError
        Not a module; no attention; an attention that cannot be reproduced exactly.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    recorder = AttentionRecorder(dense) if recorder is None else recorder
    # eval mode, each module's restored after the last overlapping user (capturing.modes);
    # nn.TransformerEncoderLayer's fused kernel skips multi_head_attention_forward
    with evaluating(model), recorder.watching(model), torch.no_grad():
        model(*inputs, **kwargs)
    calls = recorder.calls
    if not calls:
        raise CaptureError(_nothing_found(model))
    for call in calls:
        if call.unsupported:
            raise CaptureError(
                f"module {_label(call.module)} ({_kind(model, call.module)}): its attention "
                f"cannot be reproduced exactly: {call.unsupported}"
            )
    return recorder, [call.layer for call in calls]


def _label(name: str) -> str:
    return repr(name) if name else "(the model itself)"


def _kind(model: nn.Module, name: str) -> str:
    return type(model.get_submodule(name)).__name__


def _describe(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
    return f"{type(model).__name__} ({name})" if name else type(model).__name__


def _nothing_found(model: nn.Module) -> str:
    looks = [
        f"{name or '(the model)'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if "attn" in type(m).__name__.lower() or "attention" in type(m).__name__.lower()
    ]
    message = (
        f"{type(model).__name__} ran, but computed no attention: no "
        "scaled_dot_product_attention call, no nn.MultiheadAttention and no softmax over a "
        "q.k product (matmul, bmm or einsum)"
    )
    if looks:
        message += f"; attention-like modules that computed none: {', '.join(looks[:8])}"
    return message


def _hints(model: nn.Module, fused: Mapping[str, str | FusedQKV]) -> dict[str, FusedQKV]:
    modules = dict(model.named_modules())
    for own in set(fused) - set(modules):  # a layer's own name: the module it names
        wrapped = [name for name in modules if own_name(name) == own]
        if wrapped:
            modules[own] = modules[wrapped[-1]]
    hints = {}
    for name, spec in fused.items():
        spec = FusedQKV(qkv=spec) if isinstance(spec, str) else spec
        if not isinstance(spec, FusedQKV):
            raise CaptureError(
                f"fused[{name!r}] must be the name of the fused projection or a FusedQKV, "
                f"got {type(spec).__name__}"
            )
        if name not in modules:
            raise CaptureError(f"fused names module {name!r}, which {type(model).__name__} lacks")
        module = modules[name]
        if not isinstance(getattr(module, spec.qkv, None), nn.Module):
            children = ", ".join(n for n, _ in module.named_children()) or "none"
            raise CaptureError(
                f"module {name!r} ({type(module).__name__}) has no child {spec.qkv!r}; "
                f"its children are {children}"
            )
        hints[name] = spec
    return hints


def _check_hints(hints: dict[str, FusedQKV], calls, names) -> None:
    for name, spec in hints.items():
        inside = [
            c
            for c in calls
            if any(m == name or m.startswith(f"{name}.") for m in (c.module, own_name(c.module)))
        ]
        if not inside:
            raise CaptureError(f"fused names module {name!r}, which computed no attention")
        for call in inside:
            heads = call.q.shape[-3] if call.q.dim() >= 3 else 1
            if spec.n_heads is not None and spec.n_heads != heads:
                raise CaptureError(
                    f"fused hint for {name!r} says {spec.n_heads} heads; "
                    f"the module computes {heads}"
                )
            if spec.scale is not None and not math.isclose(spec.scale, call.scale, rel_tol=1e-6):
                raise CaptureError(
                    f"fused hint for {name!r} says scale {spec.scale:.4g}; the module uses "
                    f"{call.scale:.4g}"
                )
            if spec.mask is not None and call.virtual is not None:
                said = spec.mask if isinstance(spec.mask, str) else _mode_of(spec.mask.bool())
                if said != call.virtual.mode:
                    raise CaptureError(
                        f"fused hint for {name!r} says mask {said!r}, but the module blocks "
                        f"{call.virtual.mode!r}: the hint does not reproduce its attention"
                    )
            elif spec.mask is not None:
                expected = _blocked_by(spec.mask, call.q.shape[-2], call.k.shape[-2])
                actual = _shared_blocked(call)
                if not torch.equal(expected, actual):
                    said = spec.mask if isinstance(spec.mask, str) else "custom"
                    raise CaptureError(
                        f"fused hint for {name!r} says mask {said!r}, but the module blocks "
                        f"{int(actual.sum())} cells of {actual.numel()} "
                        f"({_mode_of(actual)}): the hint does not reproduce its attention"
                    )


def _blocked_by(mask, length: int, n_keys: int) -> torch.Tensor:
    if isinstance(mask, torch.Tensor):
        return mask.bool().cpu()
    blocked = None if mask == "none" else cached_mask(mask, length)
    return torch.zeros(length, n_keys, dtype=torch.bool) if blocked is None else blocked


def _shared_blocked(call: AttentionCall) -> torch.Tensor:
    length, n_keys = call.q.shape[-2], call.k.shape[-2]
    if call.blocked is None:
        return torch.zeros(length, n_keys, dtype=torch.bool)
    full = call.blocked.expand(*call.weights.shape).reshape(-1, length, n_keys)
    return full.all(dim=0).cpu()


def _mode_of(blocked: torch.Tensor) -> str:
    if not bool(blocked.any()):
        return "none"
    length = blocked.shape[0]
    if blocked.shape[0] == blocked.shape[1]:
        if torch.equal(blocked, torch.eye(length, dtype=torch.bool)):
            return "diagonal"
        if torch.equal(blocked, torch.ones(length, length, dtype=torch.bool).triu(1)):
            return "causal"
    return "custom"


def _token_labels(tokens, inputs, kwargs) -> list[list[str]] | None:
    if tokens is None:
        return None
    if hasattr(tokens, "convert_ids_to_tokens"):
        ids = kwargs.get("input_ids", inputs[0] if inputs else None)
        if not isinstance(ids, torch.Tensor):
            raise CaptureError("tokens is a tokenizer, but no input_ids tensor was given")
        ids = ids if ids.dim() == 2 else ids[None]
        return [tokens.convert_ids_to_tokens(row) for row in ids.tolist()]
    if isinstance(tokens, str):
        raise CaptureError(
            "tokens must be a list of token strings (or a tokenizer), not one string"
        )
    tokens = list(tokens)
    if tokens and all(isinstance(t, str) for t in tokens):
        return [tokens]
    return [list(row) for row in tokens]


# projections: what only the module knows


def _four_dims(call: AttentionCall, batch_hint: int | None) -> AttentionCall:
    """The call with every tensor as ``(B, H, ...)``."""
    lead = call.q.shape[:-2]
    if len(lead) == 2:
        return call
    count = math.prod(lead)
    batch = batch_hint if batch_hint and len(lead) == 1 and count % batch_hint == 0 else None
    shape = (batch, count // batch) if batch else ((lead[0], count // lead[0]) if lead else (1, 1))

    def four(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.expand(*lead, *t.shape[-2:])  # masks may broadcast over the leading dims
        return t.reshape(*shape, *t.shape[-2:])

    call.q, call.k, call.v = four(call.q), four(call.k), four(call.v)
    call.weights, call.context = four(call.weights), four(call.context)
    call.blocked, call.bias = four(call.blocked), four(call.bias)
    if call.virtual is not None:  # (*lead, n) -> (B, H, n)
        lse, padding = (
            None if t is None else t.expand(*lead, t.shape[-1]).reshape(*shape, t.shape[-1])
            for t in (call.virtual.lse, call.virtual.padding)
        )
        call.virtual = replace(call.virtual, lse=lse, padding=padding)
    return call


def _trace(
    call: AttentionCall, module_call, tokens, clock, source: str, consumer=None
) -> TraceParts:
    """One call's trace parts; ``clock``: the caller's ``(time, layout)``."""
    time, layout = clock
    hint = None
    if module_call is not None:
        first = next(iter(call_tensors(module_call[1], module_call[2])), None)
        hint = int(first.shape[0]) if first is not None and first.dim() >= 2 else None
    call = _four_dims(call, hint)
    projections = read_projections(call, module_call, consumer)
    call.cross = call.cross or bool(projections.get("cross"))
    batch, _, length, _ = call.q.shape
    note = []
    if tokens is not None and np.shape(tokens) != (batch, length):
        note.append(f"tokens left out: {np.shape(tokens)} labels for {batch} x {length} positions")
        tokens = None
    steps = None if time is None else np.shape(time)[-1]
    if steps is not None and (layout or Layout()).length(steps) != length:
        note.append(
            f"time left out: {steps} timestamps for {length} positions"
            + ("" if layout else "; say what the other positions are with layout=")
        )
        time = None
    if projections.get("projected_by"):
        note.append(
            "w_o and output read from the Linear that takes the module's merged heads "
            f"({type(module_call[0]).__name__}'s output projection is not its own)"
        )
    if projections.get("residual"):
        note.append(
            "output is what the module adds to its input (it adds its input back itself: "
            "a residual inside the layer)"
        )
    missing = [f"w_{r}" for r in "qkv" if f"w_{r}" not in projections]
    if call.normaliser != "softmax":
        missing = [name for name in missing if name == "w_v"]  # phi(q), phi(k) are no projection
    if missing and call.via != "multi_head_attention_forward":
        note.append(
            f"{', '.join(missing)} left out: no projection of the module's input reproduces "
            "the captured values (rotary embeddings, say)"
        )
    arrays = {k: v for k, v in projections.items() if k in ("x", "output") or k.startswith("w_")}
    note.extend(_one_width(arrays))
    kv_heads = projections.get("kv_heads")
    form = call.virtual
    maps = dict(weights=call.weights) if form is None else dict(lse=form.lse, mask=form.mode)
    parts = trace_parts(
        **maps,
        q=call.q,
        k=call.k,
        v=call.v,
        context=call.context,
        **arrays,
        blocked=call.blocked,
        bias=call.bias,
        scale=call.scale,
        time=time,
        layout=layout,
        tokens=tokens,
        source=source,
        cross=call.cross,
    )  # validated once per stack of layers
    if form is not None and form.padding is not None:
        parts.data_vars["padding"] = (("batch", "position"), _sample_padding(form, call.cross))
    for name in ("b_q", "b_k", "b_v", "b_o"):
        if projections.get(name) is not None:
            bias = projections[name].detach().float().cpu().numpy()
            parts.data_vars[name] = ("feature_out", bias)
    attrs = parts.attrs
    attrs["captured_via"] = call.via
    if call.normaliser != "softmax":
        attrs["normaliser"] = call.normaliser
        attrs["weights_formed"] = (
            f"{FEATURES} / {call.normaliser}: a linear attention's implicit weights, from the "
            "features it multiplied (q and k hold phi(q) and phi(k)); their context is the "
            "model's, to float32 rounding"
        )
        named = projections.get("phi_q")  # of the layer's projections z = x W^T + b
        if named is not None and named == projections.get("phi_k"):
            attrs["feature_map"] = named
    if kv_heads:
        attrs["kv_heads"] = int(kv_heads)  # w_k, w_v, k and v are repeated per query head
    attrs["dtype"] = str(call.dtype).removeprefix("torch.")
    if call.fill:
        attrs["mask_fill"] = call.fill  # how the model blocked cells (the same in every layer)
    if call.cross:
        attrs["attention"] = "cross"
    if note:
        attrs["note"] = "; ".join(note)
    return parts


def _one_width(arrays: dict) -> list[str]:
    """Keep ``x`` and ``output`` only where they are as wide (a trace's ``feature``): a
    module whose input is not what its heads project (a whole model's raw channels, say)
    keeps its output; one whose projections read its input keeps that. Returns the notes."""
    x, output = arrays.get("x"), arrays.get("output")
    if x is None or output is None or x.shape[-1] == output.shape[-1]:
        return []
    read = any(f"w_{role}" in arrays for role in "qkv")
    dropped = ("output", "w_o") if read else ("x",)
    for name in dropped:
        arrays.pop(name, None)
    return [
        f"{' and '.join(dropped)} left out: the module's input is {x.shape[-1]} wide and its "
        f"output {output.shape[-1]} (a trace's x and output share their features)"
    ]


def _sample_padding(form, cross: bool) -> np.ndarray:
    """A virtual call's padded keys per sample ``(B, S)``: the same in every head."""
    padding = form.padding  # (B, H, S)
    if cross:
        raise ValueError(
            "a cross-attention too large to record its weights cannot hold padded keys "
            "(its keys are another sequence's positions): capture it with dense=True"
        )
    if not bool((padding == padding[:, :1]).all()):
        raise ValueError(
            "its padded keys differ between heads, which a trace too large to record its "
            "weights cannot hold: capture a shorter input with dense=True"
        )
    return padding[:, 0].cpu().numpy()


__all__ = ["CaptureError", "FusedQKV", "capture"]

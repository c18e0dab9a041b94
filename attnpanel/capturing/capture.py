"""Capture exact attention traces from any PyTorch model, with no adapter.

:func:`capture` runs a model once (eval mode, no gradients) inside an
:class:`~attnpanel.capturing.intercept.AttentionRecorder`, which sees every attention computation
itself: ``F.scaled_dot_product_attention`` calls, ``F.multi_head_attention_forward``
(``nn.MultiheadAttention``) and softmaxes over a ``q . k`` product, however the module
around them is written. Each one becomes a trace (see :mod:`attnpanel.trace`) with q and k
as they entered the product, the scale, every blocked cell and additive bias per sample
and head, and the weights.

What only a module knows is read from the module that ran the call: its input ``x``, its
``output`` and its projection matrices. Readers of projections register themselves with
:func:`projection_reader`; a matrix is kept only when it reproduces the captured q, k or
v (or the output), so a model that rotates q and k after the projection (rotary
embeddings) gets no ``w_q`` rather than a wrong one.

One capture gives one object: a Dataset whose ``layer`` dim stacks the calls, or, when the
model has several kinds (encoder self-attention, decoder self-attention, cross-attention),
an ``xarray.DataTree`` with one group per kind.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr
from torch import nn

from attnpanel.capturing.intercept import AttentionCall, AttentionRecorder, spread_rows, tolerance
from attnpanel.kernels.masks import cached_mask
from attnpanel.traces import virtual
from attnpanel.traces.build import TraceParts, trace_parts
from attnpanel.traces.schema import ATTENTION_DIMS
from attnpanel.traces.stages import trace_mask
from attnpanel.traces.validate import validate


class CaptureError(ValueError):
    """A model, module or input that :func:`capture` cannot trace exactly."""


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
        Timestamps of the positions, ``(position,)`` or ``(batch, position)``.
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
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    hints = _hints(model, fused or {})
    recorder = AttentionRecorder(dense)
    training = [m for m in model.modules() if m.training]  # each restored as it was
    fastpath = torch.backends.mha.get_fastpath_enabled()
    try:
        if training:
            model.eval()
        # nn.TransformerEncoderLayer's fused kernel skips multi_head_attention_forward
        torch.backends.mha.set_fastpath_enabled(False)
        with recorder.watch(model), recorder, torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for module in training:  # exactly the modules that were training, as they were
            module.training = True
        torch.backends.mha.set_fastpath_enabled(fastpath)

    calls = recorder.calls
    if not calls:
        raise CaptureError(_nothing_found(model))
    for call in calls:
        if call.unsupported:
            raise CaptureError(
                f"module {_label(call.module)} ({_kind(model, call.module)}): its attention "
                f"cannot be reproduced exactly: {call.unsupported}"
            )
    names = _call_names(calls, type(model).__name__)  # the model itself may be the layer
    _check_hints(hints, calls, names)
    labels = _token_labels(tokens, inputs, kwargs)
    first = next((t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    source = _describe(model)
    traces = []
    for call, name in zip(calls, names, strict=True):
        module_call = recorder.module_calls.get(id(call))
        try:
            with torch.no_grad():
                traces.append(_trace(call, module_call, labels, time, f"{source}: {name}"))
        except ValueError as error:
            raise CaptureError(f"module {name!r}: {error}") from error
    if labels is not None and not any("token" in t.coords for t in traces):
        sizes = _sizes(traces[0])
        raise CaptureError(
            f"module {names[0]!r}: tokens are {len(labels)} x {len(labels[0])} labels, but "
            f"its attention has {sizes['batch']} x {sizes['query']} positions"
        )
    return _assemble(traces, names, calls, source, first)


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


def _call_names(calls: list[AttentionCall], root: str) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for call in calls:
        name = call.module or root
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(name if count == 0 else f"{name}[{count}]")
    return names


def _hints(model: nn.Module, fused: Mapping[str, str | FusedQKV]) -> dict[str, FusedQKV]:
    modules = dict(model.named_modules())
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
        inside = [c for c in calls if c.module == name or c.module.startswith(f"{name}.")]
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

ProjectionReader = Callable[[nn.Module], dict[str, torch.Tensor | None] | None]
_PROJECTION_READERS: list[ProjectionReader] = []


def projection_reader(reader: ProjectionReader) -> ProjectionReader:
    """Register a reader ``module -> {"w_q": ..., "b_q": ..., "w_o": ...}`` (or None).

    Weights follow ``nn.Linear.weight`` (``(out, in)``). What a reader returns is kept only
    where it reproduces the captured q, k, v or output.
    """
    _PROJECTION_READERS.append(reader)
    return reader


SEPARATE = (
    ("wq", "wk", "wv"),  # attnpanel, NILMFormer
    ("query", "key", "value"),  # BERT, RoBERTa, MiniLM, ViT
    ("q_proj", "k_proj", "v_proj"),  # BART, Llama, Mistral, Qwen2, PatchTST
    ("q_lin", "k_lin", "v_lin"),  # DistilBERT
    ("q", "k", "v"),  # T5
)
FUSED = ("c_attn", "qkv", "Wqkv", "qkv_proj", "query_key_value", "in_proj")
OUTPUTS = ("wo", "o_proj", "out_proj", "out_lin", "o", "c_proj", "proj", "out")
# Rows (spread over samples and positions, both ends included) on which a projection
# matrix must reproduce q, k or v: a wrong matrix, or a position-dependent step such as
# rotary embeddings, fails on any row but position 0.
PROJECTION_ROWS = 16


def _linear(module: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight (out, in), bias)`` of a Linear, or of a GPT-2 ``Conv1D`` (``(in, out)``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    if type(module).__name__ == "Conv1D":
        return weight.t(), bias
    return (weight, bias) if isinstance(module, nn.Linear) else None


@projection_reader
def _separate_projections(module: nn.Module):
    for names in SEPARATE:
        found = [_linear(getattr(module, n, None)) for n in names]
        if all(found):
            return {
                key: value
                for role, (weight, bias) in zip("qkv", found, strict=True)
                for key, value in ((f"w_{role}", weight), (f"b_{role}", bias))
            }
    return None


@projection_reader
def _fused_projection(module: nn.Module):
    for name in FUSED:
        found = _linear(getattr(module, name, None))
        if found and found[0].shape[0] % 3 == 0:
            weight, bias = found
            parts = {f"w_{r}": w for r, w in zip("qkv", weight.chunk(3), strict=True)}
            if bias is not None:
                parts.update({f"b_{r}": b for r, b in zip("qkv", bias.chunk(3), strict=True)})
            return parts
    return None


@projection_reader
def _output_projection(module: nn.Module):
    for name in OUTPUTS:
        found = _linear(getattr(module, name, None))
        if found:
            return {"w_o": found[0], "b_o": found[1]}
    return None


def _per_head(weight: torch.Tensor, width: int, groups: int) -> torch.Tensor:
    """``(H' E, ...)`` rows repeated for each of the ``groups`` query heads a head serves."""
    if groups == 1:
        return weight
    rows = weight.reshape(-1, width, *weight.shape[1:])  # (H', E, ...)
    return rows.repeat_interleave(groups, dim=0).reshape(-1, *weight.shape[1:])  # (H E, ...)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    if a.shape != b.shape:
        return False
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return float((a.float() - b.float()).abs().max()) <= tolerance(dtype) * scale * 4


def _tensors(args, kwargs) -> list[torch.Tensor]:
    values = list(args) + list(kwargs.values())
    return [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _batch_first(t: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """``t`` as ``(B, L, D)`` when it is that or ``(L, B, D)``; else None."""
    if t is None or t.dim() != 3:
        return None
    if t.shape[:2] == (batch, length):
        return t
    if t.shape[:2] == (length, batch):
        return t.transpose(0, 1)
    return None


def _flat_rows(t: torch.Tensor, rows: torch.Tensor, position_dim: int = 1) -> torch.Tensor:
    """Rows of ``t`` ``(B, ..., L, ...)`` numbered sample-major, ``(len(rows), ...)``.

    ``(B, L, D)`` gives ``(n, D)``; ``(B, H, L, E)`` with ``position_dim=2`` gives
    ``(n, H, E)``; nothing but the chosen rows is read.
    """
    length = t.shape[position_dim]
    index = (rows // length, *[slice(None)] * (position_dim - 1), rows % length)
    return t[index]


def _projections(call: AttentionCall, module_call) -> dict[str, torch.Tensor]:
    """x, output and the projection matrices that reproduce the call's q, k, v, output."""
    found = dict(call.projections)
    batch, heads, length, _ = call.q.shape
    n_keys = call.k.shape[-2]
    if module_call is None:
        return {k: v for k, v in found.items() if v is not None}
    module, args, kwargs, *rest = module_call
    output = rest[0] if rest else None
    inputs = _tensors(args, kwargs)
    if "x" not in found:
        found["x"] = next(
            (t for t in map(lambda t: _batch_first(t, batch, length), inputs) if t is not None),
            None,
        )
    if "output" not in found:
        first = output[0] if isinstance(output, tuple | list) and output else output
        found["output"] = _batch_first(
            first if isinstance(first, torch.Tensor) else None, batch, length
        )
    if not call.projections:
        for reader in _PROJECTION_READERS:
            found.update(reader(module) or {})
    keys = [t for t in map(lambda t: _batch_first(t, batch, n_keys), inputs) if t is not None]
    kept = {name: found[name] for name in ("x", "output") if found.get(name) is not None}
    x = kept.get("x")
    # checked on an even spread of (sample, position) rows, as the softmax is
    queries = spread_rows(batch * length, PROJECTION_ROWS)
    key_rows = spread_rows(batch * n_keys, PROJECTION_ROWS)
    targets = {"q": call.q, "k": call.k, "v": call.v}
    for role, target in targets.items():
        weight, bias = found.get(f"w_{role}"), found.get(f"b_{role}")
        if weight is None or target is None:
            continue
        sources = (
            [x] if role == "q" else ([] if call.cross else [x]) + [t for t in keys if t is not x]
        )
        for source in (s for s in sources if s is not None):
            width = target.shape[-1]
            if source.shape[-1] != weight.shape[1] or weight.shape[0] % width:
                continue
            if source.shape[:2] != (target.shape[0], target.shape[2]):
                continue  # another sequence's length: it cannot be this one's source
            rows = queries if role == "q" else key_rows
            projected = F.linear(_flat_rows(source, rows), weight, bias)  # (n, H' E)
            split = projected.unflatten(-1, (-1, width))  # (n, H', E)
            groups = heads // split.shape[1] if heads % split.shape[1] == 0 else 1
            if groups > 1:  # grouped-query attention: one k/v head serves `groups` q heads
                split = split.repeat_interleave(groups, dim=1)  # (n, H, E)
            if _close(split, _flat_rows(target, rows, position_dim=2), call.dtype):
                if role == "k" and source is not x:
                    kept["cross"] = True  # keys projected from another sequence
                # as k itself, the matrix is given per query head: (H E, D)
                kept[f"w_{role}"] = _per_head(weight, width, groups)
                if bias is not None:
                    kept[f"b_{role}"] = _per_head(bias, width, groups)
                if groups > 1:
                    kept["kv_heads"] = split.shape[1] // groups
                break
    weight, bias = found.get("w_o"), found.get("b_o")
    if weight is not None and call.context is not None and kept.get("output") is not None:
        merged = _flat_rows(call.context, queries, position_dim=2).flatten(1)  # (n, H E)
        if merged.shape[-1] == weight.shape[1]:
            projected = F.linear(merged.to(weight.dtype), weight, bias)  # (n, D)
            if _close(projected, _flat_rows(kept["output"], queries), call.dtype):
                kept["w_o"] = weight
                if bias is not None:
                    kept["b_o"] = bias
    return kept


# from a call to a trace


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


def _trace(call: AttentionCall, module_call, tokens, time, source: str) -> TraceParts:
    hint = None
    if module_call is not None:
        first = next(iter(_tensors(module_call[1], module_call[2])), None)
        hint = int(first.shape[0]) if first is not None and first.dim() >= 2 else None
    call = _four_dims(call, hint)
    projections = _projections(call, module_call)
    call.cross = call.cross or bool(projections.get("cross"))
    batch, _, length, _ = call.q.shape
    note = []
    if tokens is not None and np.shape(tokens) != (batch, length):
        note.append(f"tokens left out: {np.shape(tokens)} labels for {batch} x {length} positions")
        tokens = None
    if time is not None and np.shape(time)[-1] != length:
        note.append(f"time left out: {np.shape(time)[-1]} timestamps for {length} positions")
        time = None
    missing = [f"w_{r}" for r in "qkv" if f"w_{r}" not in projections]
    if missing and call.via != "multi_head_attention_forward":
        note.append(
            f"{', '.join(missing)} left out: no projection of the module's input reproduces "
            "the captured values (rotary embeddings, say)"
        )
    arrays = {k: v for k, v in projections.items() if k in ("x", "output") or k.startswith("w_")}
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
    if kv_heads:
        attrs["kv_heads"] = int(kv_heads)  # w_k, w_v, k and v are repeated per query head
    attrs["dtype"] = str(call.dtype).removeprefix("torch.")
    if call.cross:
        attrs["attention"] = "cross"
    if note:
        attrs["note"] = "; ".join(note)
    return parts


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


def _input_labels(ds: xr.Dataset, first: torch.Tensor | None) -> xr.Dataset:
    """Labels read from the model's input: folded channels, image patches."""
    if first is None or first.dim() < 2:
        return ds
    batch, length = ds.sizes["batch"], ds.sizes["query"]
    inputs = int(first.shape[0])
    if batch != inputs and batch % inputs == 0 and batch // inputs in first.shape[1:]:
        # a channel-independent model (PatchTST) runs each channel as its own sequence,
        # sample-major: attention batch n is sample n // C, channel n % C
        channels = batch // inputs
        index = np.arange(batch)
        ds = ds.assign_coords(
            sample=("batch", index // channels), channel=("batch", index % channels)
        )
        ds.attrs["batch_layout"] = f"{inputs} samples x {channels} channels, sample-major"
    elif first.dim() == 4 and first.is_floating_point() and batch == inputs:
        height, width = int(first.shape[-2]), int(first.shape[-1])
        for special in (0, 1, 2):  # class and distillation tokens before the patches
            rows = math.isqrt(max(length - special, 0) * height // max(width, 1))
            columns = (length - special) // rows if rows else 0
            if rows and rows * columns == length - special and height % rows == 0:
                names = ["[CLS]", "[DIST]"][:special] + [
                    f"patch {r},{c}" for r in range(rows) for c in range(columns)
                ]
                ds = ds.assign_coords(token=(("batch", "position"), np.array([names] * batch)))
                ds.attrs["positions"] = f"{special} special + {rows} x {columns} image patches"
                break
    return ds


# one object


def _group(name: str, call: AttentionCall) -> str:
    """``encoder.layers.3.self_attn`` -> ``encoder.layers.self_attn``."""
    parts = [p for p in re.sub(r"\[\d+\]$", "", name).split(".") if not p.isdigit()]
    return ".".join(parts) or "attention"


def _sizes(parts: TraceParts) -> dict[str, int]:
    sizes = {}
    for dims, values in parts.data_vars.values():
        dims = (dims,) if isinstance(dims, str) else dims
        sizes.update(zip(dims, np.shape(values), strict=True))
    return sizes


def _signature(parts: TraceParts) -> tuple:
    strip = {"source", "note"}
    mask = parts.data_vars.get("mask")
    return (
        tuple(sorted(_sizes(parts).items())),
        tuple(sorted((k, str(v)) for k, v in parts.attrs.items() if k not in strip)),
        tuple(sorted(name for name in parts.data_vars if name not in _MASK_TRUTH)),
        np.asarray(mask[1]).tobytes() if mask is not None else b"",
    )


def _assemble(traces, names, calls, source, first) -> xr.Dataset | xr.DataTree:
    """Layers that agree in shape, mask and variables stack; each other kind is a group."""
    kinds: dict[tuple, list[int]] = {}
    for index, trace in enumerate(traces):
        kinds.setdefault(_signature(trace), []).append(index)
    datasets: dict[str, xr.Dataset] = {}
    for members in kinds.values():
        labels = list(dict.fromkeys(_group(names[i], calls[i]) for i in members))
        label = labels[0] if len(labels) == 1 else f"{labels[0]}+{len(labels) - 1}"
        while label in datasets:
            label += "'"
        stacked = _stack([traces[i] for i in members], [names[i] for i in members])
        stacked.attrs["source"] = source
        _validate(stacked, {names[i]: traces[i] for i in members}, label)
        datasets[label] = stacked if "token" in stacked.coords else _input_labels(stacked, first)
    if len(datasets) == 1:
        return next(iter(datasets.values()))
    tree = xr.DataTree.from_dict({f"/{label}": ds for label, ds in datasets.items()})
    tree.attrs["source"] = source
    return tree


def _validate(stacked: xr.Dataset, layers: dict[str, TraceParts], label: str) -> None:
    """The stack in memory, or each of its layers where the stack holds them as chunks."""
    if virtual.is_virtual(stacked) or isinstance(stacked["weights"].data, np.ndarray):
        try:
            validate(stacked)
        except ValueError as error:
            raise CaptureError(f"layers {label!r}: {error}") from error
        return
    for name, parts in layers.items():  # in memory either way; torch reads each layer's arrays
        try:
            validate(parts.dataset())
        except ValueError as error:
            raise CaptureError(f"layer {name!r}: {error}") from error


_MASK_TRUTH = ("sample_mask", "bias", "padding")
STACK_COPY_BYTES = 64 * 2**20  # larger stacks of layers are chunked views, not copies


def _layers(arrays: list[np.ndarray]):
    """One array with a leading ``layer`` axis.

    Large ones (every layer's attention maps) become a dask array with one chunk per
    layer, each chunk the layer's own memory: nothing is copied, and a view of one layer
    reads that layer's array.
    """
    if len(arrays) == 1:
        return arrays[0][None]
    if sum(a.nbytes for a in arrays) <= STACK_COPY_BYTES:
        return np.stack(arrays)
    import dask  # here: dask.array costs every `import attnpanel` 0.9 s (the CLI's `info`)
    import dask.array

    token = uuid.uuid4().hex  # dask.array.from_array would copy; a delayed literal does not
    return dask.array.stack(
        [
            dask.array.from_delayed(
                dask.delayed(a, name=f"attnpanel-layer-{index}-{token}"), a.shape, dtype=a.dtype
            )
            for index, a in enumerate(arrays)
        ]
    )


def _stack(traces: list[TraceParts], names: list[str]) -> xr.Dataset:
    """One Dataset with a ``layer`` dim; the mask truth is broadcast to the union of dims."""
    first = traces[0]
    data_vars = {}
    for name, (dims, values) in first.data_vars.items():
        if name in _MASK_TRUTH:
            continue
        if name == "mask":  # the same in every layer: the signature says so
            data_vars[name] = (dims, values)
            continue
        layers = [t.data_vars[name][1] for t in traces]
        data_vars[name] = (
            ("layer", *((dims,) if isinstance(dims, str) else dims)),
            _layers(layers),
        )
    for name in _MASK_TRUTH:
        if any(name in t.data_vars for t in traces):
            data_vars[name] = _stack_truth(traces, name)
    attrs = {
        key: value
        for key, value in first.attrs.items()
        if all(_same(t.attrs.get(key), value) for t in traces[1:])
    }
    coords = {**first.coords, "layer": np.array(names, dtype=str)}
    return virtual.attach(xr.Dataset(data_vars, coords=coords, attrs=attrs))


def _stack_truth(traces: list[TraceParts], name: str) -> tuple:
    """``name`` of every layer over the union of the dims it varies along in any of them.

    A layer without it has none of it: no padding, no bias, or only its shared mask.
    """
    sizes = _sizes(traces[0])
    present = {d for t in traces if name in t.data_vars for d in t.data_vars[name][0]}
    shared = {}  # layers without a sample_mask block only their shared (query, key) cells
    if name == "sample_mask":
        shared = {
            i: trace_mask(t.dataset()) for i, t in enumerate(traces) if name not in t.data_vars
        }
        if any(cells is not None and bool(cells.any()) for cells in shared.values()):
            present |= {"query", "key"}
    order = ("batch", "position") if name == "padding" else ATTENTION_DIMS
    dims = tuple(d for d in order if d in present)
    shape = tuple(sizes[d] for d in dims)
    layers = []
    for index, t in enumerate(traces):
        if name in t.data_vars:
            own, values = t.data_vars[name]  # its dims, in the same order as dims
            expand = [i for i, d in enumerate(dims) if d not in own]
            values = np.expand_dims(values, expand) if expand else values
        elif shared.get(index) is not None and bool(shared[index].any()):
            values = (
                shared[index]
                .numpy()
                .reshape(tuple(sizes[d] if d in ("query", "key") else 1 for d in dims))
            )
        else:
            values = np.zeros((), np.float32 if name == "bias" else bool)
        layers.append(np.broadcast_to(values, shape))
    return ("layer", *dims), np.stack(layers)


def _same(a, b) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


__all__ = ["CaptureError", "FusedQKV", "capture", "projection_reader"]

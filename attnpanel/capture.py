"""Capture attention traces from real PyTorch and Hugging Face models with forward hooks.

:func:`capture` runs a model once (eval mode, no gradients) with hooks on its attention
layers and turns every call into a trace (see :mod:`attnpanel.trace`). It understands:

* attnpanel's own :class:`~attnpanel.attention.MultiHeadSelfAttention`: every
  intermediate, through :func:`attnpanel.trace`;
* :class:`torch.nn.MultiheadAttention` used as self-attention (``query is key is value``),
  either ``batch_first`` setting: q, k, v are recomputed from ``in_proj_weight`` and
  ``in_proj_bias``, the per-head weights from them with the call's ``attn_mask`` and
  ``key_padding_mask`` (the module itself returns the head average by default);
* a module with one fused projection ``Linear(d, 3 d)`` whose output is ``[q | k | v]``
  (nanoGPT's ``c_attn``, many tutorials' ``qkv``), named by the caller through
  ``fused=`` (see :class:`FusedQKV`);
* Hugging Face ``transformers`` models: the weights are the model's own
  ``output_attentions``; q, k, v come from the layer's ``query/key/value`` (BERT),
  ``q_proj/k_proj/v_proj`` (BART, Llama, ...), ``q_lin/k_lin/v_lin`` (DistilBERT) or
  ``c_attn`` (GPT-2) projections and are kept only when they reproduce the weights
  (rotary position embeddings, for one, change q and k after the projection).

The hooks are removed and the model's training mode, attention implementation and the
``nn.MultiheadAttention`` fast path are restored afterwards, also when the forward fails.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.attention import MultiHeadSelfAttention, attend, build_mask
from attnpanel.trace import build_trace, trace

SUPPORTED = (
    "attnpanel.MultiHeadSelfAttention",
    "torch.nn.MultiheadAttention (self-attention)",
    "a fused-QKV module named in fused= (FusedQKV)",
    "Hugging Face transformers models (output_attentions=True)",
)
HF_PROJECTIONS = (
    ("query", "key", "value"),  # BERT, RoBERTa, MiniLM, ...
    ("q_proj", "k_proj", "v_proj"),  # BART, OPT, Llama, Mistral, ...
    ("q_lin", "k_lin", "v_lin"),  # DistilBERT
    ("q", "k", "v"),  # T5
)
HF_FUSED = ("c_attn",)  # GPT-2: one projection giving [q | k | v]
HEAD_COUNT_ATTRIBUTES = ("n_heads", "num_heads", "n_head", "nhead", "num_attention_heads")
QK_TOLERANCE = 1e-4  # max |weights - softmax(q k^T scale + mask)| for q and k to be kept


class CaptureError(ValueError):
    """A model, module or input that :func:`capture` cannot trace."""


@dataclass(frozen=True)
class FusedQKV:
    """How to read a module whose one projection produces q, k and v together.

    The module is expected to compute ``q, k, v = qkv(x).split(d_model, dim=-1)``, split
    each into heads and apply ``softmax(q k^T * scale + mask)``, as nanoGPT's
    ``CausalSelfAttention`` and most tutorials do.
    """

    qkv: str = "qkv"  # child nn.Linear(d_model, 3 * d_model) whose output is [q | k | v]
    n_heads: int | None = None  # None reads the module's n_heads / num_heads / n_head attribute
    out: str | None = None  # child Linear after the head merge; when given, checks the capture
    mask: str | torch.Tensor = "none"  # what the module applies: a mode name or bool (L, L)
    scale: float | None = None  # score multiplier; None means head_dim ** -0.5


@dataclass
class _Call:
    """One forward call of an attention module, as the hooks saw it."""

    name: str
    module: nn.Module
    kind: str  # "own", "mha", "fused" or "hf"
    spec: FusedQKV | None = None  # for kind "fused"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: object = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # projection role -> input
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # projection role -> output
    weights: torch.Tensor | None = None  # (B, H, L, S) the model's own, for kind "hf"


def capture(
    model: nn.Module,
    *inputs,
    fused: Mapping[str, str | FusedQKV] | None = None,
    tokens=None,
    time=None,
    **kwargs,
) -> xr.Dataset | list[xr.Dataset]:
    """Run ``model`` once and return a trace of every attention layer it calls.

    Parameters
    ----------
    model : torch.nn.Module
        Any model holding supported attention layers (see the module docstring), or a
        supported layer itself.
    *inputs
        Positional inputs of ``model``.
    fused : mapping of str to str or FusedQKV, optional
        Fused-QKV modules to trace: module name (as in ``model.named_modules()``) to the
        name of its fused projection child, or to a :class:`FusedQKV` spec, e.g.
        ``{"blocks.0.attn": FusedQKV("c_attn", mask="causal", out="c_proj")}``.
    tokens : tokenizer, list of str or list of list of str, optional
        Token labels of the positions: a Hugging Face tokenizer (the tokens are read from
        ``input_ids``), one sequence of strings, or one sequence per batch item.
    time : array-like, optional
        Timestamps of the positions, ``(position,)`` or ``(batch, position)``.
    **kwargs
        Keyword inputs of ``model`` (``attention_mask``, ...). For Hugging Face models
        ``output_attentions=True`` is added.

    Returns
    -------
    xarray.Dataset or list of xarray.Dataset
        One Dataset with a leading ``layer`` dim whose coordinate holds the module names
        (a repeated call of one module gets ``name[1]``, ``name[2]`` ...) when every layer
        has the same variables, sizes, attributes and mask; otherwise one Dataset per
        layer, each with a scalar ``layer`` coordinate. When the mask differs between
        samples or heads (padding, per-head masks), ``mask`` holds the cells blocked in all
        of them and the variable ``sample_mask`` ``(batch, head, query, key)`` each one.

    Raises
    ------
    CaptureError
        When the model holds no supported attention layer, a ``fused`` name does not
        fit the model, or a layer is called in a way the capture cannot trace (cross
        attention, ``add_bias_kv`` ...); the message names the module.

    Examples
    --------
    >>> traces = capture(model, x)  # doctest: +SKIP
    >>> encoded = tokenizer(text, return_tensors="pt")  # doctest: +SKIP
    >>> traces = capture(bert, **encoded, tokens=tokenizer)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    specs = _fused_specs(model, fused or {})
    hf = _is_transformers(model)
    targets = _targets(model, specs, hf)
    if not targets and not hf:
        raise CaptureError(_nothing_found(model))
    if hf:
        kwargs.setdefault("output_attentions", True)

    calls: list[_Call] = []
    active: dict[int, _Call] = {}
    owners: dict[int, tuple[weakref.ref, str, nn.Module]] = {}
    handles: list = []
    was_training = model.training
    fastpath = torch.backends.mha.get_fastpath_enabled()
    implementation = None
    try:
        _register(model, targets, specs, hf, calls, active, owners, handles)
        implementation = _eager(model) if hf else None
        model.eval()
        # nn.TransformerEncoderLayer's fused kernel skips the MultiheadAttention forward
        # (and so its hooks) in eval mode.
        torch.backends.mha.set_fastpath_enabled(False)
        with torch.no_grad():
            result = model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
        torch.backends.mha.set_fastpath_enabled(fastpath)
        if implementation is not None:
            model.set_attn_implementation(implementation)

    if hf:
        calls = _match_attentions(model, result, calls, owners)
    if not calls:
        raise CaptureError(
            f"{type(model).__name__} ran, but none of its attention layers "
            f"({', '.join(name or '(the model)' for name in targets)}) was called"
        )
    labels = _token_labels(tokens, inputs, kwargs)
    source = _describe(model)
    names = _call_names(calls)
    traces = [
        _trace_call(call, labels, time, f"{source}: {name}")
        for call, name in zip(calls, names, strict=True)
    ]
    return _stack(traces, names, source)


def _is_transformers(model: nn.Module) -> bool:
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__
    )


def _describe(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
    return f"{type(model).__name__} ({name})" if name else type(model).__name__


def _children(module: nn.Module, names: Sequence[str]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in names)


def _hf_projections(module: nn.Module) -> tuple[str, ...] | None:
    for names in HF_PROJECTIONS:
        if _children(module, names) and all(
            isinstance(getattr(getattr(module, n), "weight", None), torch.Tensor) for n in names
        ):
            return names
    for name in HF_FUSED:
        if isinstance(getattr(getattr(module, name, None), "weight", None), torch.Tensor):
            return (name,)
    return None


def _fused_specs(model: nn.Module, fused: Mapping[str, str | FusedQKV]) -> dict[str, FusedQKV]:
    modules = dict(model.named_modules())
    specs = {}
    for name, spec in fused.items():
        if isinstance(spec, str):
            spec = FusedQKV(qkv=spec)
        if not isinstance(spec, FusedQKV):
            raise CaptureError(
                f"fused[{name!r}] must be the name of the fused projection or a FusedQKV, "
                f"got {type(spec).__name__}"
            )
        if name not in modules:
            raise CaptureError(
                f"fused names module {name!r}, which {type(model).__name__} does not have; "
                f"fused-projection candidates: {_fused_candidates(model)}"
            )
        module = modules[name]
        qkv = getattr(module, spec.qkv, None)
        if not isinstance(qkv, nn.Linear):
            raise CaptureError(
                f"module {name!r} ({type(module).__name__}) has no nn.Linear child {spec.qkv!r}; "
                f"its children are {', '.join(n for n, _ in module.named_children()) or 'none'}"
            )
        if qkv.out_features % 3:
            raise CaptureError(
                f"{name}.{spec.qkv} has {qkv.out_features} outputs, not 3 x d_model: "
                "it cannot be split into q, k and v"
            )
        d_model = qkv.out_features // 3
        n_heads = spec.n_heads or _head_count(module)
        if n_heads is None:
            raise CaptureError(
                f"module {name!r} ({type(module).__name__}) has none of the attributes "
                f"{', '.join(HEAD_COUNT_ATTRIBUTES)}; give FusedQKV(n_heads=...)"
            )
        if d_model % n_heads:
            raise CaptureError(
                f"module {name!r}: d_model {d_model} is not divisible by n_heads {n_heads}"
            )
        if spec.out is not None and not isinstance(getattr(module, spec.out, None), nn.Module):
            raise CaptureError(
                f"module {name!r} ({type(module).__name__}) has no child {spec.out!r}"
            )
        specs[name] = FusedQKV(spec.qkv, n_heads, spec.out, spec.mask, spec.scale)
    return specs


def _fused_candidates(model: nn.Module) -> str:
    found = [
        f"{name}.{child_name}"
        for name, module in model.named_modules()
        for child_name, child in module.named_children()
        if isinstance(child, nn.Linear) and child.out_features == 3 * child.in_features
    ]
    return ", ".join(found) or "none"


def _head_count(module: nn.Module) -> int | None:
    for attribute in HEAD_COUNT_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _targets(model: nn.Module, specs: dict[str, FusedQKV], hf: bool) -> dict[str, str]:
    """Module name -> kind, for every module that gets hooks."""
    targets = {}
    for name, module in model.named_modules():
        if name in specs:
            targets[name] = "fused"
        elif isinstance(module, MultiHeadSelfAttention):
            targets[name] = "own"
        elif isinstance(module, nn.MultiheadAttention):
            targets[name] = "mha"
        elif hf and _hf_projections(module) is not None:
            targets[name] = "hf"
    if not hf:
        skipped = _look_alikes(model, targets)
        if targets and skipped:
            warnings.warn(
                f"capture skips {skipped}: not a supported attention module; "
                f"name a fused-QKV module in fused= to trace it",
                stacklevel=3,
            )
    return targets


def _look_alikes(model: nn.Module, targets: dict[str, str]) -> str:
    """Modules whose class name says attention but that capture does not understand."""
    found = []
    for name, module in model.named_modules():
        label = type(module).__name__.lower()
        if name in targets or not ("attention" in label or "attn" in label):
            continue
        related = any(
            t == name or t.startswith(f"{name}.") or name.startswith(f"{t}.") or not t
            for t in targets
        )
        if not related:
            found.append(f"{name or '(the model)'} ({type(module).__name__})")
    return ", ".join(found)


def _nothing_found(model: nn.Module) -> str:
    look_alikes = _look_alikes(model, {})
    message = f"found no supported attention layer in {type(model).__name__}"
    if look_alikes:
        message += f"; unsupported attention-like modules: {look_alikes}"
    message += f". Supported: {'; '.join(SUPPORTED)}."
    inner = next((name for name, m in model.named_modules() if name and _is_transformers(m)), None)
    if inner is not None:
        message += f" Capture the transformers model {inner!r} itself (output_attentions)."
    candidates = _fused_candidates(model)
    if candidates != "none":
        example = candidates.split(", ")[0].rsplit(".", 1)
        message += (
            f" For a module with one fused q/k/v projection pass "
            f"fused={{{example[0]!r}: {example[1]!r}}} (candidates: {candidates})."
        )
    return message


def _register(model, targets, specs, hf, calls, active, owners, handles: list) -> None:
    """Add the hooks to ``handles`` as they are made, so that a failure leaves none behind."""
    modules = dict(model.named_modules())

    def opener(name, kind):
        def hook(module, args, kwargs):
            call = _Call(name, module, kind, specs.get(name), args, dict(kwargs))
            calls.append(call)
            active[id(module)] = call

        return hook

    def closer(module, args, kwargs, output):
        call = active.pop(id(module), None)
        if call is not None:
            call.output = output

    def projection(parent, role):
        def hook(module, args, output):
            call = active.get(id(parent))
            if call is not None:
                call.inputs[role] = args[0]
                call.outputs[role] = output

        return hook

    for name, kind in targets.items():
        module = modules[name]
        handles.append(module.register_forward_pre_hook(opener(name, kind), with_kwargs=True))
        handles.append(module.register_forward_hook(closer, with_kwargs=True))
        if kind == "fused":
            roles = (specs[name].qkv,)
        elif kind == "hf":
            roles = _hf_projections(module)
        else:
            roles = ()
        for role in roles:
            hook = projection(module, role)
            handles.append(getattr(module, role).register_forward_hook(hook))

    if hf:

        def owner(name):
            def hook(module, args, output):
                outputs = output if isinstance(output, tuple) else (output,)
                for t in outputs:
                    if isinstance(t, torch.Tensor) and t.dim() == 4:
                        known = owners.get(id(t))
                        if known is None or known[0]() is None:
                            owners[id(t)] = (weakref.ref(t), name, module)

            return hook

        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(owner(name)))


def _eager(model: nn.Module) -> str | None:
    """Switch a transformers model to eager attention; returns the implementation to restore."""
    current = getattr(model.config, "_attn_implementation", None)
    if current in (None, "eager"):
        return None
    if not hasattr(model, "set_attn_implementation"):
        raise CaptureError(
            f"{type(model).__name__} uses {current!r} attention, which returns no weights; "
            'load it with attn_implementation="eager"'
        )
    model.set_attn_implementation("eager")
    return current


def _match_attentions(model, result, calls: list[_Call], owners) -> list[_Call]:
    """One call per tensor of the model's ``attentions``, in layer order."""
    attentions = getattr(result, "attentions", None)
    if attentions is None and isinstance(result, tuple):
        attentions = next((r for r in result[::-1] if _is_attention_tuple(r)), None)
    if not attentions:
        raise CaptureError(
            f"{type(model).__name__} returned no attentions with output_attentions=True; "
            f"supported: {'; '.join(SUPPORTED)}"
        )
    matched = []
    for index, weights in enumerate(attentions):
        call = next((c for c in calls if _returns(c.output, weights)), None)
        if call is None:
            ref, name, module = owners.get(id(weights), (None, f"attentions[{index}]", model))
            if ref is None or ref() is not weights:
                name, module = f"attentions[{index}]", model
            call = _Call(name, module, "hf")
        call.weights = weights
        matched.append(call)
    return matched


def _is_attention_tuple(value) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in value)
    )


def _returns(output, tensor: torch.Tensor) -> bool:
    outputs = output if isinstance(output, tuple) else (output,)
    return any(t is tensor for t in outputs)


def _call_names(calls: list[_Call]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for call in calls:
        name = call.name or type(call.module).__name__  # the model itself is an attention layer
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(name if count == 0 else f"{name}[{count}]")
    return names


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


def _trace_call(call: _Call, tokens, time, source: str) -> xr.Dataset:
    try:
        if call.kind == "own":
            x = call.args[0] if call.args else next(iter(call.kwargs.values()))
            return trace(call.module, x, time=time, tokens=tokens, source=source)
        if call.kind == "mha":
            return _trace_mha(call, tokens, time, source)
        if call.kind == "fused":
            return _trace_fused(call, tokens, time, source)
        return _trace_hf(call, tokens, time, source)
    except CaptureError:
        raise
    except ValueError as error:
        raise CaptureError(
            f"module {call.name!r} ({type(call.module).__name__}): {error}"
        ) from error


def _split_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    batch, length, width = t.shape
    return t.reshape(batch, length, n_heads, width // n_heads).transpose(1, 2)  # (B, H, L, E)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, blocked_value: bool) -> torch.Tensor:
    """A float bias from a mask that is either additive or bool (``blocked_value`` = blocked)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        blocked = mask if blocked_value else ~mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            blocked, -math.inf
        )
    return mask.to(dtype)


def _blocked(bias: torch.Tensor | None) -> torch.Tensor | None:
    if bias is None:
        return None
    return bias <= torch.finfo(bias.dtype).min / 2


def _mask_fields(blocked: torch.Tensor | None, shape) -> tuple[object, np.ndarray | None]:
    """The trace's ``mask`` argument and, where it differs per sample or head, ``sample_mask``."""
    if blocked is None or not bool(blocked.any()):
        return "none", None
    blocked = blocked.expand(shape)  # (B, H, L, S)
    shared = blocked.all(dim=1).all(dim=0)  # (L, S)
    per_sample = None if bool((blocked == shared).all()) else blocked.cpu().numpy()
    length = shape[-1]
    for mode in ("causal", "diagonal"):
        if torch.equal(shared, build_mask(mode, length, device=shared.device)):
            return mode, per_sample
    if not bool(shared.any()):
        return "none", per_sample
    return shared.cpu().numpy(), per_sample


def _with_sample_mask(ds: xr.Dataset, per_sample: np.ndarray | None) -> xr.Dataset:
    if per_sample is not None:
        ds["sample_mask"] = (("batch", "head", "query", "key"), per_sample)
        ds["sample_mask"].attrs["description"] = "True = blocked, for each sample and head"
    return ds


def _first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _trace_mha(call: _Call, tokens, time, source: str) -> xr.Dataset:
    module: nn.MultiheadAttention = call.module
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    bound = dict(zip(names, call.args, strict=False)) | call.kwargs
    query, key, value = bound["query"], bound.get("key"), bound.get("value")
    same = all(
        t is query
        or (isinstance(t, torch.Tensor) and t.shape == query.shape and torch.equal(t, query))
        for t in (key, value)
    )
    if not same:
        raise CaptureError(
            f"module {call.name!r} (nn.MultiheadAttention) was called with different query, "
            "key and value: capture supports self-attention only (query is key is value)"
        )
    if not module._qkv_same_embed_dim:
        raise CaptureError(
            f"module {call.name!r} (nn.MultiheadAttention) has kdim/vdim different from "
            "embed_dim, which only cross-attention uses: capture supports self-attention only"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise CaptureError(
            f"module {call.name!r} (nn.MultiheadAttention) uses add_bias_kv or add_zero_attn, "
            "which add keys beyond the sequence: not supported"
        )
    unbatched = query.dim() == 2
    x = query[:, None] if unbatched else query  # (L, B, D) or (B, L, D)
    if not module.batch_first or unbatched:
        x = x.transpose(0, 1)  # (B, L, D)
    batch, length, d_model = x.shape
    heads = module.num_heads
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = (None,) * 3 if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
    q = _split_heads(nn.functional.linear(x, w_q, b_q), heads)  # (B, H, L, E)
    k = _split_heads(nn.functional.linear(x, w_k, b_k), heads)  # (B, H, S, E)
    v = _split_heads(nn.functional.linear(x, w_v, b_v), heads)  # (B, H, S, E)
    scale = module.head_dim**-0.5
    bias = torch.zeros(1, 1, length, length, dtype=x.dtype, device=x.device)  # (1, 1, L, S)
    attn_mask = _additive(bound.get("attn_mask"), x.dtype, blocked_value=True)
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.view(batch, heads, length, length)
        bias = bias + attn_mask
    padding = _additive(bound.get("key_padding_mask"), x.dtype, blocked_value=True)
    if padding is not None:
        padding = padding[None] if unbatched else padding
        bias = bias + padding[:, None, None, :]  # (B, 1, 1, S)
    scores = q @ k.transpose(-2, -1)  # (B, H, L, S)
    weights = torch.softmax(scores * scale + bias, dim=-1)  # (B, H, L, S)
    context = weights @ v  # (B, H, L, E)
    output = _first_tensor(call.output)
    output = output[:, None] if unbatched else output
    if not module.batch_first or unbatched:
        output = output.transpose(0, 1)  # (B, L, D)
    mask, per_sample = _mask_fields(_blocked(bias), weights.shape)
    ds = _build(
        call,
        x=x,
        q=q,
        k=k,
        v=v,
        scores=scores,
        weights=weights,
        context=context,
        output=output,
        w_q=w_q,
        w_k=w_k,
        w_v=w_v,
        w_o=module.out_proj.weight,
        mask=mask,
        scale=scale,
        time=time,
        tokens=tokens,
        source=source,
    )
    return _with_sample_mask(ds, per_sample)


def _build(call: _Call, **arrays) -> xr.Dataset:
    try:
        return build_trace(**arrays)
    except ValueError as error:
        raise CaptureError(
            f"module {call.name!r} ({type(call.module).__name__}): {error}"
        ) from error


def _trace_fused(call: _Call, tokens, time, source: str) -> xr.Dataset:
    module = call.module
    spec = call.spec
    x = call.inputs.get(spec.qkv)
    qkv = call.outputs.get(spec.qkv)
    if qkv is None:
        raise CaptureError(
            f"module {call.name!r} ran without calling its fused projection {spec.qkv!r}"
        )
    if qkv.dim() != 3:
        raise CaptureError(
            f"module {call.name!r}: {spec.qkv} output has shape {tuple(qkv.shape)}, "
            "expected (batch, length, 3 * d_model)"
        )
    q, k, v = (_split_heads(t, spec.n_heads) for t in qkv.chunk(3, dim=-1))  # (B, H, L, E)
    length, head_dim = q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if spec.scale is None else spec.scale
    blocked = build_mask(spec.mask, length, device=q.device)
    scores, weights = attend(q, k, blocked, scale)  # (B, H, L, S)
    context = weights @ v  # (B, H, L, E)
    projection = getattr(module, spec.qkv).weight
    arrays = dict(x=x, q=q, k=k, v=v, scores=scores, weights=weights, context=context)
    arrays.update(zip(("w_q", "w_k", "w_v"), projection.chunk(3), strict=True))
    if spec.out is not None:
        out = getattr(module, spec.out)
        merged = context.transpose(1, 2).reshape(q.shape[0], length, -1)  # (B, L, D)
        output = out(merged)  # (B, L, D)
        actual = _first_tensor(call.output)
        if actual.shape != output.shape or not torch.allclose(output, actual, atol=1e-4):
            raise CaptureError(
                f"module {call.name!r}: the weights computed from {spec.qkv} (mask "
                f"{spec.mask if isinstance(spec.mask, str) else 'custom'!r}, scale {scale:.4g}, "
                f"{spec.n_heads} heads) do not reproduce the module's output; check the "
                "FusedQKV mask, scale and n_heads"
            )
        arrays.update(output=actual, w_o=getattr(out, "weight", None))
    mask = spec.mask if isinstance(spec.mask, str) else spec.mask.cpu().numpy()
    return _build(call, **arrays, mask=mask, scale=scale, time=time, tokens=tokens, source=source)


def _trace_hf(call: _Call, tokens, time, source: str) -> xr.Dataset:
    weights = call.weights  # (B, H, L, S)
    heads, length = weights.shape[1], weights.shape[2]
    arrays = {"weights": weights}
    attrs = {}
    scale = None
    roles = _hf_projections(call.module) if call.outputs else None
    if roles:
        outputs = [call.outputs.get(r) for r in roles]
        x = call.inputs[roles[0]]
        if len(roles) == 1:
            outputs = list(outputs[0].chunk(3, dim=-1))
        head_dim = outputs[0].shape[-1] // heads
        q = _split_heads(outputs[0], heads)  # (B, H, L, E)
        k, v = (_split_heads(t, t.shape[-1] // head_dim) for t in outputs[1:])  # (B, Hkv, S, E)
        if heads % k.shape[1] == 0:
            # grouped-query attention: each key/value head serves heads // Hkv query heads
            k = k.repeat_interleave(heads // k.shape[1], dim=1)  # (B, H, S, E)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)  # (B, H, S, E)
        scale = getattr(call.module, "scaling", None)
        scale = float(scale) if isinstance(scale, int | float) else head_dim**-0.5
        mask = call.kwargs.get("attention_mask", call.args[1] if len(call.args) > 1 else None)
        bias = _additive(mask, q.dtype, blocked_value=False)
        if bias is not None and bias.shape[-1] != length:
            bias = bias[..., :length]
        scores = q @ k.transpose(-2, -1)  # (B, H, L, S)
        logits = scores * scale if bias is None else scores * scale + bias
        error = float((torch.softmax(logits, dim=-1) - weights).abs().max())
        arrays.update(x=x, v=v, context=weights @ v)
        if error <= QK_TOLERANCE:
            arrays.update(q=q, k=k, scores=scores)
        else:
            attrs["note"] = (
                f"q and k from {', '.join(roles)} do not reproduce the weights (max error "
                f"{error:.2g}): the model changes them after the projection (rotary or "
                "relative position embeddings, for one), so they are left out"
            )
        if len(roles) == 3:
            matrices = [getattr(call.module, r).weight for r in roles]
            if len({tuple(m.shape) for m in matrices}) == 1:
                arrays.update(zip(("w_q", "w_k", "w_v"), matrices, strict=True))
        blocked = _blocked(bias)
    else:
        # softmax gives exact zeros only where a mask blocked the key
        blocked = weights == 0
        attrs["note"] = "only the weights are known: no q/k/v projections were found"
    mask, per_sample = _mask_fields(blocked, weights.shape)
    ds = _build(call, **arrays, mask=mask, scale=scale, time=time, tokens=tokens, source=source)
    ds.attrs.update(attrs)
    return _with_sample_mask(ds, per_sample)


def _stack(traces: list[xr.Dataset], names: list[str], source: str) -> xr.Dataset | list:
    """One Dataset with a ``layer`` dim when the layers agree, else a list."""

    def same(a: xr.Dataset, b: xr.Dataset) -> bool:
        strip = {"source"}
        return (
            set(a.data_vars) == set(b.data_vars)
            and dict(a.sizes) == dict(b.sizes)
            and {k: v for k, v in a.attrs.items() if k not in strip}
            == {k: v for k, v in b.attrs.items() if k not in strip}
            and ("mask" not in a or a["mask"].equals(b["mask"]))
            and a.coords.to_dataset().equals(b.coords.to_dataset())
        )

    if all(same(traces[0], t) for t in traces[1:]):
        stacked = xr.concat(
            traces,
            dim=xr.DataArray(np.array(names, dtype=str), dims="layer", name="layer"),
            data_vars=[v for v in traces[0].data_vars if v != "mask"],
            coords="minimal",
            compat="equals",
            join="exact",
            combine_attrs="drop_conflicts",
        )
        stacked.attrs["source"] = source
        return stacked
    return [t.assign_coords(layer=name) for t, name in zip(traces, names, strict=True)]

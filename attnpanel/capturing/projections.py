"""A module's own projection matrices, where they reproduce what its attention received.

Readers registered with :func:`projection_reader` know the weight names of a kind of module
(``wq/wk/wv``, ``query/key/value``, ``q_proj/k_proj/v_proj``, fused ``c_attn``/``qkv``/
``Wqkv``, the output projection); a matrix is kept only when it reproduces the captured q, k,
v (or the module's output) from the module's input on spread rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnpanel.capturing.recorder import AttentionCall, spread_rows, tolerance

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
    ("to_q", "to_k", "to_v"),  # lucidrains' (performer-pytorch, x-transformers)
)


FUSED = ("c_attn", "qkv", "Wqkv", "qkv_proj", "query_key_value", "in_proj")


OUTPUTS = ("wo", "o_proj", "out_proj", "out_lin", "o", "c_proj", "proj", "out", "to_out")


# A linear attention's feature maps that are named where they reproduce its q and k from
# the layer's own projection ``z = x W^T + b``, up to a constant added (elu + 1, relu + eps):
# the trace names the map; it keeps no w_q or w_k, whose products its scores are not.
FEATURE_MAPS = {
    "elu(z)": F.elu,
    "relu(z)": F.relu,
    "softplus(z)": F.softplus,
    "exp(z)": torch.exp,
    "sigmoid(z)": torch.sigmoid,
}


def feature_map(projected: torch.Tensor, features: torch.Tensor, dtype: torch.dtype) -> str | None:
    """The map that turns a linear attention's projected rows into its features.

    Parameters
    ----------
    projected : torch.Tensor
        Rows of the layer's projection ``z = x W^T + b``, split by head ``(n, H, E)``.
    features : torch.Tensor
        The same rows of the features the model multiplied, ``(n, H, E)``.
    dtype : torch.dtype
        The model's dtype (its rounding: :func:`tolerance`).

    Returns
    -------
    str or None
        The map of :data:`FEATURE_MAPS` plus a constant (``"elu(z) + 1"``, ``"sigmoid(z) −
        0.5"``), the first that reproduces them; None where none does (random features, a
        map of its own).
    """
    if projected.shape != features.shape:
        return None
    for name, f in FEATURE_MAPS.items():
        mapped = f(projected.float())
        added = float((features.float() - mapped).mean())
        if _close(mapped + added, features, dtype):
            if abs(added) <= tolerance(dtype):
                return name
            return f"{name} {'+' if added > 0 else '−'} {abs(added):.3g}"
    return None


# Rows (spread over samples and positions, both ends included) on which a projection
# matrix must reproduce q, k or v: a wrong matrix, or a position-dependent step such as
# rotary embeddings, fails on any row but position 0.
PROJECTION_ROWS = 16


def _linear(module: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight (out, in), bias)`` of a Linear, of a GPT-2 ``Conv1D`` (``(in, out)``), or
    of the one Linear a wrapper without weights of its own holds (TransformerLens 4's
    ``LinearBridge``: its hooks around the model's own Linear)."""
    if isinstance(module, nn.Module) and not isinstance(module, nn.Linear):
        inner = [m for m in module.modules() if m is not module and isinstance(m, nn.Linear)]
        if len(inner) == 1 and not list(module.parameters(recurse=False)):
            module = inner[0]
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


def read_projections(call: AttentionCall, module_call, consumer=None) -> dict:
    """x, output and the projection matrices that reproduce the call's q, k, v, output
    (and, for a linear attention, ``phi_q`` and ``phi_k``: its feature maps' names).

    ``consumer``: ``[module, input, output, name]`` of a Linear that took the module's output as
    its input. Where the module's output is its merged heads (BERT's self-attention, whose
    output projection is its sibling ``attention.output.dense``), that Linear is the
    output projection: ``w_o`` and ``output`` are read from it.
    """
    found = dict(call.projections)
    batch, heads, length, _ = call.q.shape
    n_keys = call.k.shape[-2]
    if module_call is None:
        return {k: v for k, v in found.items() if v is not None}
    module, args, kwargs, *rest = module_call
    output = rest[0] if rest else None
    inputs = call_tensors(args, kwargs)
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
    queries = spread_rows(batch * length, PROJECTION_ROWS, call.q.device)
    key_rows = spread_rows(batch * n_keys, PROJECTION_ROWS, call.q.device)
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
            wanted = _flat_rows(target, rows, position_dim=2)
            same = _close(split, wanted, call.dtype)
            # a linear attention's q and k are features: of the projection (their map named),
            # or the projection itself (its matrix kept, as any q's)
            if not same and call.normaliser != "softmax" and role in ("q", "k"):
                named = feature_map(split, wanted, call.dtype)
                if named is not None:
                    kept[f"phi_{role}"] = named
                    break
            if same:
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
            output = kept["output"]
            if not _close(projected, _flat_rows(output, queries), call.dtype) and _adds_input(
                projected, output, x, queries, call.dtype
            ):
                # the module adds its input back itself (a residual inside the layer): its
                # attention's output is what it adds
                kept["output"] = output = output - x
                kept["residual"] = True
            if _close(projected, _flat_rows(output, queries), call.dtype):
                kept["w_o"] = weight
                if bias is not None:
                    kept["b_o"] = bias
    if "w_o" not in kept and consumer is not None and consumer[2] is not None:
        kept.update(_consumer_projection(call, kept.get("output"), consumer, queries))
    return kept


def _adds_input(projected, output, x, queries, dtype) -> bool:
    """Whether a module's ``output`` is its input ``x`` plus the ``projected`` heads."""
    if x is None or x.shape != output.shape:
        return False
    return _close(projected, _flat_rows(output - x, queries), dtype)


def _consumer_projection(call: AttentionCall, output, consumer, queries) -> dict:
    """``w_o``, ``b_o`` and the projected ``output`` from the Linear that took the merged
    heads, when the module's output is them and the Linear reproduces its own output."""
    module, _, projected_output, name = consumer
    found = _linear(module)
    batch, _, length, _ = call.q.shape
    projected_output = _batch_first(projected_output, batch, length)
    if found is None or call.context is None or output is None or projected_output is None:
        return {}
    weight, bias = found
    merged = _flat_rows(call.context, queries, position_dim=2).flatten(1)  # (n, H E)
    if merged.shape[-1] != weight.shape[1] or output.shape[-1] != merged.shape[-1]:
        return {}
    if not _close(merged, _flat_rows(output, queries), call.dtype):
        return {}  # the module's output is not its merged heads
    projected = F.linear(merged.to(weight.dtype), weight, bias)
    if not _close(projected, _flat_rows(projected_output, queries), call.dtype):
        return {}
    found = {"w_o": weight, "output": projected_output, "projected_by": name}
    if bias is not None:
        found["b_o"] = bias
    return found


def call_tensors(args, kwargs) -> list[torch.Tensor]:
    values = list(args) + list(kwargs.values())
    return [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]


# from a call to a trace

"""Linear attention, read as the attention matrix it never forms.

A linear attention (Katharopoulos et al. 2020; Performer's random features; Energformer's
kernel) never forms ``(L, S)`` weights: it multiplies the keys' features by the values
first, ``KV = phi(K)^T V`` (a product that contracts over the positions), then the queries'
features by that, ``phi(Q) KV``, and divides each row by ``phi(q_i) . sum_j phi(k_j)``. That
is attention with the weights ``w_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')``.

The watcher follows the first product as :class:`~attnpanel.watching.lineage.Scores` (as it
follows every product of two tensors it does not know). :func:`read_linear` reads a product
that takes such a ``KV`` with a third tensor as ``phi(Q) KV``: it forms the implicit weights
from the very features the model multiplied, checks that they are non-negative (a kernel's
features are), and compares the model's own result with the weights' context ``W V``. The
result is either that context (the normaliser inside the product, as
``einsum("nlhd,nhmd,nlh->nlhm", Q, KV, Z)`` does) or ``phi(Q) KV`` before it; then
:func:`normalised` recognises the division or product by the row normaliser that follows.
Nothing is taken on trust: the weights are the model's only where its own result equals
their context.

Shapes use ``L`` queries, ``S`` keys, ``D`` the features and ``E`` the value width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnpanel.watching.lineage import PRODUCTS, SCALES, Scores, einsum_parts

FEATURES = "phi(q) . phi(k)"  # how a linear attention's weights are formed, in words
NORMALISER = "row sum"  # each row divided by its sum (a softmax trace: "softmax")
MATCH = 1e-5  # of the context's largest value: a difference below it is float32 rounding


@dataclass
class LinearForm:
    """A linear attention's implicit attention, in the model's own features."""

    q: torch.Tensor  # phi(q) (*lead, L, D), as the model multiplied it (in its graph)
    k: torch.Tensor  # phi(k) (*lead, S, D), likewise
    v: torch.Tensor  # (*lead, S, E), likewise
    weights: torch.Tensor  # (*lead, L, S) float32, each row phi(q_i) . phi(k_j) / its sum
    context: torch.Tensor  # (*lead, L, E) weights @ v, float32
    canonical: Callable[[torch.Tensor], torch.Tensor]  # a result's layout -> (*lead, L, E)
    restore: Callable[[torch.Tensor], torch.Tensor]  # (*lead, L, E) -> the result's layout


@dataclass
class Unnormalised:
    """``phi(Q) (phi(K)^T V)`` on its way to its row normaliser."""

    form: LinearForm


def read_linear(name: str, args, source: torch.Tensor, info: Scores, result) -> tuple | None:
    """``(form, done)`` where ``result`` of the product ``name`` is ``phi(Q) KV`` with
    ``source`` the ``KV`` (``info``): ``done`` where the row normaliser is in it. None where
    the product is not one (its features negative, its result not their context)."""
    if name not in PRODUCTS or info.unsupported or info.bias is not None or info.scale != 1.0:
        return None
    if info.blocked is not None or not isinstance(result, torch.Tensor):
        return None
    found = _operands(name, args, source, info)
    if found is None:
        return None
    phi_q, phi_k, v, canonical, restore = found
    with torch.no_grad():
        if not (bool((phi_q >= 0).all()) and bool((phi_k >= 0).all())):
            return None
        products = phi_q.double() @ phi_k.double().transpose(-2, -1)  # (*lead, L, S)
        sums = products.sum(-1, keepdim=True)
        if not bool((sums > 0).all()):
            return None
        weights = products / sums
        context = weights @ v.double()
        try:
            got = canonical(result.detach()).double()
        except RuntimeError:
            return None
        if got.shape != context.shape:
            return None
        form = LinearForm(
            phi_q,
            phi_k,
            v,
            weights.float(),
            context.float(),
            canonical,
            restore,
        )
        if _matches(got, context):
            return form, True
        if _matches(got, products @ v.double()):
            return form, False
    return None


def normalised(name: str, args, source: torch.Tensor, form: LinearForm, result) -> bool:
    """Whether ``result`` of ``name`` on ``phi(Q) KV`` (``source``) is the rows divided by
    their normaliser: the context of the implicit weights."""
    if name not in SCALES and name not in PRODUCTS:
        return False
    if not isinstance(result, torch.Tensor) or result.shape != source.shape:
        return False
    with torch.no_grad():
        try:
            got = form.canonical(result.detach()).double()
        except RuntimeError:
            return False
        return got.shape == form.context.shape and _matches(got, form.context.double())


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to rounding of float32 (relative to the context's size)."""
    if not got.numel():
        return True
    return float((got - want).abs().max()) <= max(MATCH * float(want.abs().max()), 1e-7)


def _operands(name: str, args, source: torch.Tensor, info: Scores) -> tuple | None:
    """``(phi_q, phi_k, v, canonical, restore)`` of ``phi(Q) KV``, ``source`` the ``KV``.

    ``info`` holds the ``KV`` product's operands as ``(*lead, m, n)`` and ``(*lead, p, n)``
    (``n`` the positions it contracted); ``source`` is laid out ``(*lead, m, p)``. The side
    the queries' features contract with is ``phi(K)``, the other ``V``."""
    if name in ("matmul", "bmm"):
        a, b = args[0], args[1]
        if b is not source or not isinstance(a, torch.Tensor) or a.dim() < 3:
            return None
        lead = torch.broadcast_shapes(a.shape[:-2], source.shape[:-2])
        phi_q = a.expand(*lead, *a.shape[-2:])
        phi_k, v = info.q.transpose(-2, -1), info.k.transpose(-2, -1)

        def canonical(t, lead=lead):
            return t.expand(*lead, *t.shape[-2:])

        def restore(t, shape=source.shape[:-2]):
            return t.reshape(*shape, *t.shape[-2:]) if shape == t.shape[:-2] else t

        return _lead(phi_q, phi_k, v, lead, canonical, restore)
    for count in (2, 3):
        parts = einsum_parts(args, count)
        if parts is not None:
            return _einsum_operands(*parts, source, info)
    return None


def _einsum_operands(inputs, output, operands, source, info) -> tuple | None:
    at = next((i for i, t in enumerate(operands) if t is source), None)
    if at is None or len(inputs[at]) < 3:
        return None
    sub_kv = inputs[at]
    lead, m, p = sub_kv[:-2], sub_kv[-2], sub_kv[-1]
    if (m in output) == (p in output):
        return None
    contracted, width = (m, p) if p in output else (p, m)
    others = [(s, t) for i, (s, t) in enumerate(zip(inputs, operands, strict=True)) if i != at]
    queries = [(s, t) for s, t in others if contracted in s]
    if len(queries) != 1:
        return None
    sub_q, q = queries[0]
    query = [c for c in sub_q if c not in sub_kv]
    if len(query) != 1 or set(output) != {*lead, query[0], width}:
        return None
    (l_,) = query
    if any(not set(s) <= {*lead, l_} for s, _ in others if s != sub_q):
        return None  # a third operand is anything but a per-row normaliser
    if not set(sub_q) <= {*lead, l_, contracted}:
        return None
    target = f"{lead}{l_}{contracted}"
    phi_q = torch.einsum(f"{sub_q}->{''.join(c for c in target if c in sub_q)}", q)
    phi_q = phi_q.reshape([q.shape[sub_q.index(c)] if c in sub_q else 1 for c in target])
    if contracted == m:
        phi_k, v = info.q.transpose(-2, -1), info.k.transpose(-2, -1)
    else:
        phi_k, v = info.k.transpose(-2, -1), info.q.transpose(-2, -1)
    shape = source.shape[:-2]
    phi_q = phi_q.expand(*shape, *phi_q.shape[-2:])

    def canonical(t, spec=f"{output}->{lead}{l_}{width}"):
        return torch.einsum(spec, t)

    def restore(t, spec=f"{lead}{l_}{width}->{output}"):
        return torch.einsum(spec, t)

    return _lead(phi_q, phi_k, v, shape, canonical, restore)


def _lead(phi_q, phi_k, v, lead, canonical, restore) -> tuple | None:
    try:
        phi_k = phi_k.expand(*lead, *phi_k.shape[-2:])
        v = v.expand(*lead, *v.shape[-2:])
    except RuntimeError:
        return None
    if phi_q.shape[-1] != phi_k.shape[-1] or phi_k.shape[-2] != v.shape[-2]:
        return None
    if phi_k.shape[-2] < 2:
        return None  # one position: nothing attends
    return phi_q, phi_k, v, canonical, restore


__all__ = ["FEATURES", "NORMALISER", "LinearForm", "Unnormalised", "normalised", "read_linear"]

"""Where a tensor came from, followed from a ``q . k`` product to its softmax and on to
``weights @ v``, by identity, through an allow-list of operations.

A product's result is :class:`Scores` (its q and k, and the scale, additive terms and
blocked cells met on the way); a softmax over scores is an attention site; its result is
:class:`Weights` until the product that takes it with the values. An operation that is not
a scale, a bias or a mask between ``q . k`` and the softmax (``tanh`` soft-capping, say)
marks the scores :attr:`Scores.unsupported` instead of silently wrong.

Shapes use ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys and ``E`` head dim.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from attnpanel.kernels.masks import BLOCKING_BIAS

PRODUCTS = {"matmul", "bmm", "einsum"}
SOFTMAX = {"softmax", "_softmax"}
SCALES = {"mul", "mul_", "div", "div_", "multiply", "true_divide", "divide"}
MASKING = {"add", "add_", "sub", "sub_", "masked_fill", "masked_fill_", "where"}
KEEPS = {
    "to",
    "float",
    "double",
    "half",
    "bfloat16",
    "type",
    "type_as",
    "contiguous",
    "clone",
    "detach",
    "dropout",
    "dropout_",
}
VIEWS = {"view", "reshape", "view_as", "reshape_as", "unsqueeze", "squeeze", "flatten"}
ZERO_FILLS = {"masked_fill", "masked_fill_", "where"}  # weights set to 0 where already 0


@dataclass
class Scores:
    """What is known of a tensor computed from a ``q . k`` product."""

    q: torch.Tensor  # (*lead, L, E)
    k: torch.Tensor  # (*lead, S, E)
    module: str
    scale: float = 1.0
    bias: torch.Tensor | None = None  # added terms, in units of the current logits
    blocked: torch.Tensor | None = None  # cells filled with a blocking value
    unsupported: str = ""
    fills: tuple = ()  # the mask tensors given to those fills, as given (by identity)
    fill_values: tuple = ()  # the values those fills (masked_fill, where) wrote
    calls: tuple = ()  # the module calls running when q . k was made, outermost first


@dataclass
class Weights:
    """A softmax output on its way to ``weights @ v``; ``site`` is the attention site."""

    site: object


class Lineage:
    """Where tensors came from, by identity, for as long as each tensor lives.

    Entries of freed tensors are swept when the table grows (no weakref callback: Python
    runs signal handlers inside one and drops the exception they raise, so a Ctrl-C that
    landed there was lost); a new tensor that took a freed one's id is told apart by its
    weak reference.
    """

    SWEEP = 256  # entries before the freed ones are swept

    def __init__(self):
        self._known: dict[int, tuple[weakref.ref, object]] = {}
        self._sweep_at = self.SWEEP

    def __bool__(self) -> bool:
        return bool(self._known)

    def __getstate__(self) -> dict:
        return {}  # what a run's tensors came from means nothing to another process

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def of(self, t) -> object:
        """What was noted of ``t`` (None for anything else, or a tensor noted before whose
        id a new tensor took)."""
        if not isinstance(t, torch.Tensor):
            return None
        entry = self._known.get(id(t))
        if entry is None:
            return None
        ref, info = entry
        if ref() is not t:
            del self._known[id(t)]
            return None
        return info

    def follow(self, t: torch.Tensor, info) -> None:
        """Note where ``t`` came from."""
        self._known[id(t)] = (weakref.ref(t), info)
        if len(self._known) >= self._sweep_at:
            self._known = {k: e for k, e in self._known.items() if e[0]() is not None}
            self._sweep_at = max(self.SWEEP, 2 * len(self._known))

    def first_known(self, args, kwargs) -> tuple[torch.Tensor, object] | None:
        """The first tensor argument whose origin is known, with what is known of it."""
        if not self._known:
            return None
        for t in (*args, *kwargs.values()):
            info = self.of(t)
            if info is not None:
                return t, info
        return None


def scalar(value) -> float | None:
    """A Python number of a number or a one-element tensor (None otherwise)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return None


def einsum_parts(args, count: int = 2) -> tuple[list[str], str, list[torch.Tensor]] | None:
    """``(input subscripts, output subscripts, operands)`` of an einsum of ``count``
    operands, with an ellipsis written out as letters of its own."""
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = list(operands[0])
    if not isinstance(equation, str) or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    inputs = inputs.split(",")
    if len(inputs) != count or len(operands) != count:
        return None
    if "..." in equation:
        return _without_ellipsis(inputs, output, operands)
    return inputs, output, operands


def _without_ellipsis(inputs: list[str], output: str, operands) -> tuple | None:
    """An einsum's subscripts with ``...`` replaced by capital letters (its broadcast
    dims, aligned from the right as einsum aligns them)."""
    if not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    widths = [t.dim() - len(s.replace("...", "")) for s, t in zip(inputs, operands, strict=True)]
    width = max(widths)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:width]
    if width > 26 or any(w < 0 for w in widths) or any(c.isupper() for c in "".join(inputs)):
        return None
    inputs = [s.replace("...", letters[width - w :]) for s, w in zip(inputs, widths, strict=True)]
    return inputs, output.replace("...", letters), operands


def product_operands(name: str, args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, k)`` as ``(*lead, L, E)`` and ``(*lead, S, E)`` from a ``q . k`` product."""
    if name in ("matmul", "bmm"):
        a, b = args[0], args[1]
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (a, b)):
            return None
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        q = a.expand(*lead, *a.shape[-2:])  # (*lead, L, E)
        k = b.expand(*lead, *b.shape[-2:]).transpose(-2, -1)  # (*lead, S, E)
        return q, k
    parts = einsum_parts(args)
    if parts is None:
        return None
    (sub_a, sub_b), out, (a, b) = parts
    if len(out) < 3:
        return None
    query, key, lead = out[-2], out[-1], out[:-2]
    if query in sub_b and key in sub_a:
        (sub_a, a), (sub_b, b) = (sub_b, b), (sub_a, a)
    contracted = [c for c in sub_a if c in sub_b and c not in out]
    if (
        len(contracted) != 1
        or query not in sub_a
        or key not in sub_b
        or any(c not in sub_a or c not in sub_b for c in lead)
    ):
        return None
    e = contracted[0]
    q = torch.einsum(f"{sub_a}->{lead}{query}{e}", a)  # (*lead, L, E)
    k = torch.einsum(f"{sub_b}->{lead}{key}{e}", b)  # (*lead, S, E)
    return q, k


def follow_scores(name: str, args, source: torch.Tensor, info: Scores, result) -> Scores | None:
    """What ``result`` of ``name`` applied to scores ``source`` is (None: not scores)."""
    same_cells = result.shape[-2:] == source.shape[-2:]
    if name in SOFTMAX or not same_cells:
        return None  # a reduction or other shape: it does not carry the scores on
    if name in SCALES:
        factor = scalar(args[1] if args[0] is source else args[0])
        if factor is None:
            return replace(info, unsupported=f"{name} by a tensor between q.k and softmax")
        factor = 1 / factor if name.startswith(("div", "true_divide", "divide")) else factor
        bias = None if info.bias is None else info.bias * factor
        return replace(info, scale=info.scale * factor, bias=bias)
    if name in MASKING:
        return _masking(name, args, source, info)
    if name in KEEPS:
        return info
    if name in VIEWS:
        return info if result.numel() == source.numel() else None
    return replace(info, unsupported=f"{name} between q.k and softmax")


def keeps_weights(
    name: str, args, source: torch.Tensor, result: torch.Tensor, scores: Scores | None = None
) -> bool:
    """Whether ``result`` holds the same weights as ``source``: a copy, a view of the same
    cells, or cells set to 0 that were 0 (or NaN: a row blocked from every key) already,
    as TransformerLens' native attention does after its softmax. A fill by the very mask
    tensor that blocked the scores (``scores.fills``) is known to be one without reading
    the weights."""
    if name in KEEPS:
        return True
    if name in VIEWS:
        return result.shape[-2:] == source.shape[-2:]
    if name not in ZERO_FILLS or result.shape != source.shape:
        return False
    if name.startswith("masked_fill"):
        if args[0] is not source or scalar(args[2]) != 0.0:
            return False
        if scores is not None and any(args[1] is mask for mask in scores.fills):
            return True  # the cells the scores were blocked at: 0 after the softmax
        filled = args[1].bool().expand_as(source)
    else:
        condition, first, second = args[0], args[1], args[2]
        if first is source and scalar(second) == 0.0:
            filled = ~condition.bool().expand_as(source)
        elif second is source and scalar(first) == 0.0:
            filled = condition.bool().expand_as(source)
        else:
            return False
    was = source.masked_select(filled)
    return bool(((was == 0) | was.isnan()).all())


def _masking(name: str, args, source: torch.Tensor, info: Scores) -> Scores:
    """The scores after an add, sub, masked_fill or where: what it added or blocked."""
    if name.startswith(("add", "sub")):
        other = args[1] if args[0] is source else args[0]
        if args[0] is not source and name.startswith("sub"):
            return replace(info, unsupported="scores subtracted from a tensor")
        if scalar(other) is not None:
            return info  # a constant on every cell: the softmax does not see it
        if not isinstance(other, torch.Tensor):
            return replace(info, unsupported=f"{name} of a {type(other).__name__}")
        other = -other if name.startswith("sub") else other
        return replace(info, bias=other if info.bias is None else info.bias + other)
    if name.startswith("masked_fill"):
        mask, value = args[1], scalar(args[2])
        if value is None or value > BLOCKING_BIAS:
            return replace(info, unsupported=f"masked_fill with {args[2]!r}, not a block")
        return replace(
            info,
            blocked=union(info.blocked, mask.bool()),
            fills=(*info.fills, mask),
            fill_values=(*info.fill_values, value),
        )
    condition, first, second = args[0], args[1], args[2]
    fill = second if first is source else first
    value = scalar(fill)
    if value is None or value > BLOCKING_BIAS or (first is not source and second is not source):
        return replace(info, unsupported="where() that does not block cells")
    keep = condition.bool()
    return replace(
        info,
        blocked=union(info.blocked, ~keep if first is source else keep),
        fill_values=(*info.fill_values, value),
    )


def split_bias(additive: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(blocked, bias)`` from an additive mask: terms at or below -5000 block their cell."""
    additive = additive.float()
    blocked = additive <= BLOCKING_BIAS
    bias = additive.masked_fill(blocked, 0.0)
    return (blocked if bool(blocked.any()) else None), (bias if bool(bias.any()) else None)


def union(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The cells either mask blocks (None: nothing blocked)."""
    if a is None:
        return b
    return a if b is None else a | b

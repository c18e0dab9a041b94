"""Watch a model's attention computations as they run, whatever module computes them.

Every attention, however written, ends in one of a few torch calls:

* ``F.scaled_dot_product_attention`` (fused kernels, Hugging Face ``sdpa``, nanoGPT);
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` and the layers built on it);
* a ``softmax`` over a ``q . k`` product (``matmul``, ``bmm`` or ``einsum``), with a scale,
  additive biases and mask fills in between (eager Hugging Face code, NILMFormer,
  tutorials).

:class:`AttentionRecorder` is a :class:`torch.overrides.TorchFunctionMode`: while a model
runs inside it, each of those calls is recorded as an :class:`AttentionCall` holding q and
k exactly as they entered the product (after rotary embeddings, after grouped-query
expansion), v, the scale, every cell the model blocked and every additive bias, per sample
and head, and the weights. A reader per kind of call registers itself with
:func:`reads`; the softmax path follows a product's result through an allow-list of
operations, so an operation that is not a scale, a bias or a mask (``tanh`` soft-capping,
say) makes the call :attr:`AttentionCall.unsupported` instead of silently wrong.

Module hooks (:meth:`AttentionRecorder.watch`) attribute each call to the innermost
module running it. Nothing here changes what the model computes: every intercepted
function is called with its own arguments and its result is returned untouched.

Shapes use ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys and ``E`` head dim.
"""

from __future__ import annotations

import inspect
import itertools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attnpanel.kernels import masks as masks_module
from attnpanel.kernels import precision, tiles
from attnpanel.kernels.attention import attention_weights
from attnpanel.traces import virtual

BLOCKING_BIAS = -5e3  # an additive term at or below this blocks its cell (exp underflows to 0)
CHECKED_ROWS = 64  # rows on which a captured softmax or projection is checked
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}
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
STRUCTURE_ROWS = 1024  # rows of a model's mask compared with a mode at a time


class UnsupportedAttention(ValueError):
    """An attention computation that cannot be reproduced exactly from q, k and a mask."""


def tolerance(dtype: torch.dtype) -> float:
    """Largest difference of two weights or outputs computed in ``dtype`` that is rounding."""
    return TOLERANCE.get(dtype, 1e-5)


@dataclass
class AttentionCall:
    """One attention computation, as the model ran it."""

    module: str  # the innermost named module running it ("" = the model itself)
    via: str  # "sdpa", "multi_head_attention_forward" or "softmax"
    q: torch.Tensor  # (B, H, L, E) as it entered the product
    k: torch.Tensor  # (B, H, S, E) likewise, after grouped-query expansion
    scale: float  # multiplier of q . k
    weights: torch.Tensor | None  # (*lead, L, S) the model's own, or recomputed where never
    # formed; None in the virtual form, which holds each row's lse instead (see `virtual`)
    blocked: torch.Tensor | None = None  # bool, broadcastable to (B, H, L, S)
    bias: torch.Tensor | None = None  # float, broadcastable to (B, H, L, S)
    v: torch.Tensor | None = None  # (B, H, S, E)
    context: torch.Tensor | None = None  # (B, H, L, E) weights @ v
    dtype: torch.dtype = torch.float32  # what the model computed in
    projections: dict[str, torch.Tensor] = field(default_factory=dict)  # w_q ... b_o, x, output
    cross: bool = False  # q and k come from different sequences
    unsupported: str = ""  # why the call cannot be reproduced; empty when it can
    virtual: VirtualForm | None = None  # the rows' lse and the mask as a mode and padded keys


@dataclass(frozen=True)
class VirtualForm:
    """An attention too large to record as weights: each row's log-sum-exp and the mask as
    a mode plus padded keys, from which every cell is recomputed exactly
    (:mod:`attnpanel.traces.virtual`)."""

    lse: torch.Tensor  # (*lead, L) float32
    mode: str  # "none", "diagonal" or "causal"
    padding: torch.Tensor | None  # (*lead, S) bool: keys blocked for every query


@dataclass
class _Scores:
    """What is known of a tensor computed from a ``q . k`` product."""

    q: torch.Tensor  # (*lead, L, E)
    k: torch.Tensor  # (*lead, S, E)
    module: str
    scale: float = 1.0
    bias: torch.Tensor | None = None  # added terms, in units of the current logits
    blocked: torch.Tensor | None = None  # cells filled with a blocking value
    unsupported: str = ""


@dataclass
class _Weights:
    """A softmax output on its way to ``weights @ v``."""

    call: AttentionCall


_READERS: dict[str, Callable] = {}


def reads(name: str):
    """Register a reader for the torch function called ``name``.

    A reader is ``reader(recorder, func, args, kwargs) -> result``: it must call ``func``
    with the arguments it was given and return that result unchanged.
    """

    def register(reader):
        _READERS[name] = reader
        return reader

    return register


class AttentionRecorder(TorchFunctionMode):
    """Record every attention computation run inside ``with recorder:``.

    Examples
    --------
    >>> recorder = AttentionRecorder()  # doctest: +SKIP
    >>> with recorder.watch(model), recorder, torch.no_grad():  # doctest: +SKIP
    ...     model(x)
    >>> recorder.calls  # doctest: +SKIP

    Parameters
    ----------
    dense : bool, optional
        Record each call's weights (True), or its rows' log-sum-exp and its mask as a mode
        plus padded keys (False: :class:`VirtualForm`, computed in bounded memory). By
        default a call is recorded with its weights when they would fit
        (:func:`attnpanel.traces.virtual.wants_dense`).
    """

    def __init__(self, dense: bool | None = None):
        super().__init__()
        self.dense = dense
        self.calls: list[AttentionCall] = []
        self.stack: list[tuple[str, nn.Module, tuple, dict]] = []  # running modules
        self.module_calls: dict[int, tuple] = {}  # id(call) -> (module, args, kwargs, output)
        self._known: dict[int, tuple[weakref.ref, object]] = {}

    # module attribution

    def watch(self, model: nn.Module):
        """A context manager that hooks every module of ``model`` while it is open."""
        return _Watch(self, model)

    def records_weights(self, lead, length: int, n_keys: int) -> bool:
        """Whether a call of ``(*lead, length, n_keys)`` cells is recorded with its weights
        (else in the virtual form)."""
        return virtual.wants_dense(math.prod(lead), 1, length, n_keys, self.dense)

    @property
    def module(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def _open_call(self, call: AttentionCall) -> None:
        self.calls.append(call)
        if self.stack:
            self.module_calls[id(call)] = self.stack[-1][1:]

    # lineage of tensors

    def _get(self, t) -> object:
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

    def _set(self, t: torch.Tensor, info) -> None:
        self._known[id(t)] = (weakref.ref(t), info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reader = _READERS.get(name)
        if reader is not None:
            return reader(self, func, args, kwargs)
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and result.is_floating_point():
            self._follow(name, args, kwargs, result)
        return result

    def _follow(self, name: str, args, kwargs, result: torch.Tensor) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        known = [(t, self._get(t)) for t in tensors]
        known = [(t, info) for t, info in known if info is not None]
        if not known:
            if name in PRODUCTS:
                self._product(name, args, result)
            return
        source, info = known[0]
        if isinstance(info, _Weights):
            self._follow_weights(name, args, source, info, result)
        elif isinstance(info, _Scores):
            self._follow_scores(name, args, source, info, result)

    def _product(self, name: str, args, result: torch.Tensor) -> None:
        operands = _operands(name, args)
        if operands is None:
            return
        q, k = operands
        self._set(result, _Scores(q, k, self.module))

    def _follow_scores(self, name, args, source, info: _Scores, result) -> None:
        same_cells = result.shape[-2:] == source.shape[-2:]
        if name in SOFTMAX or not same_cells:
            return  # a reduction or other shape: it does not carry the scores on
        if name in SCALES:
            factor = _scalar(args[1] if args[0] is source else args[0])
            if factor is None:
                info = replace(info, unsupported=f"{name} by a tensor between q.k and softmax")
            else:
                divide = name.startswith(("div", "true_divide", "divide"))
                factor = 1 / factor if divide else factor
                bias = None if info.bias is None else info.bias * factor
                info = replace(info, scale=info.scale * factor, bias=bias)
        elif name in MASKING:
            info = _masking(name, args, source, info)
        elif name in KEEPS:
            pass
        elif name in VIEWS:
            if result.numel() != source.numel():
                return
        else:
            info = replace(info, unsupported=f"{name} between q.k and softmax")
        self._set(result, info)

    def _follow_weights(self, name, args, source, info: _Weights, result) -> None:
        if name in PRODUCTS and info.call.context is None:
            _weights_times_values(name, args, source, info.call, result)
        elif name in KEEPS or (name in VIEWS and result.shape[-2:] == source.shape[-2:]):
            self._set(result, info)


class _Watch:
    """Module hooks that keep :attr:`AttentionRecorder.stack` in step with the forward."""

    def __init__(self, recorder: AttentionRecorder, model: nn.Module):
        self.recorder = recorder
        self.model = model
        self.handles: list = []

    def __enter__(self):
        stack = self.recorder.stack
        for name, module in self.model.named_modules():

            def enter(module, args, kwargs, name=name):
                stack.append((name, module, args, kwargs))

            def leave(module, args, kwargs, output, name=name):
                while stack:
                    entry = stack.pop()
                    if entry[1] is module:
                        self._outputs(entry, output)
                        break

            self.handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            self.handles.append(
                module.register_forward_hook(leave, with_kwargs=True, always_call=True)
            )
        return self

    def _outputs(self, entry, output) -> None:
        for call in self.recorder.calls:
            known = self.recorder.module_calls.get(id(call))
            if known is not None and known[0] is entry[1] and len(known) == 3:
                self.recorder.module_calls[id(call)] = (*known, output)

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        return False


def _scalar(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return None


def _einsum_parts(args) -> tuple[list[str], str, list[torch.Tensor]] | None:
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    inputs = inputs.split(",")
    if len(inputs) != 2 or len(operands) != 2:
        return None
    return inputs, output, operands


def _operands(name: str, args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, k)`` as ``(*lead, L, E)`` and ``(*lead, S, E)`` from a ``q . k`` product."""
    if name in ("matmul", "bmm"):
        a, b = args[0], args[1]
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (a, b)):
            return None
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        q = a.expand(*lead, *a.shape[-2:])  # (*lead, L, E)
        k = b.expand(*lead, *b.shape[-2:]).transpose(-2, -1)  # (*lead, S, E)
        return q, k
    parts = _einsum_parts(args)
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


def _weights_times_values(name, args, source, call: AttentionCall, result) -> None:
    """Record v and the context from ``weights @ v`` (matmul, bmm or einsum)."""
    if name in ("matmul", "bmm"):
        if args[0] is not source or not isinstance(args[1], torch.Tensor):
            return
        v, context = args[1], result  # (*lead, S, E), (*lead, L, E)
    else:
        parts = _einsum_parts(args)
        if parts is None:
            return
        (sub_w, sub_v), out, (w, v) = parts
        if w is not source:
            (sub_w, w), (sub_v, v) = (sub_v, v), (sub_w, w)
        if w is not source:
            return
        lead, query, key = sub_w[:-2], sub_w[-2], sub_w[-1]
        width = [c for c in sub_v if c not in sub_w]
        if len(width) != 1 or key not in sub_v or sorted(out) != sorted(lead + query + width[0]):
            return
        v = torch.einsum(f"{sub_v}->{lead}{key}{width[0]}", v)
        context = torch.einsum(f"{out}->{lead}{query}{width[0]}", result)
    lead = call.q.shape[:-2]
    try:
        call.v = v.expand(*source.shape[:-2], *v.shape[-2:]).reshape(*lead, *v.shape[-2:])
        call.context = context.reshape(*lead, *context.shape[-2:])
    except RuntimeError:
        call.v = call.context = None


def _masking(name: str, args, source: torch.Tensor, info: _Scores) -> _Scores:
    """The scores after an add, sub, masked_fill or where: what it added or blocked."""
    if name.startswith(("add", "sub")):
        other = args[1] if args[0] is source else args[0]
        if args[0] is not source and name.startswith("sub"):
            return replace(info, unsupported="scores subtracted from a tensor")
        if _scalar(other) is not None:
            return info  # a constant on every cell: the softmax does not see it
        if not isinstance(other, torch.Tensor):
            return replace(info, unsupported=f"{name} of a {type(other).__name__}")
        other = -other if name.startswith("sub") else other
        return replace(info, bias=other if info.bias is None else info.bias + other)
    if name.startswith("masked_fill"):
        mask, value = args[1], _scalar(args[2])
        if value is None or value > BLOCKING_BIAS:
            return replace(info, unsupported=f"masked_fill with {args[2]!r}, not a block")
        return replace(info, blocked=_or(info.blocked, mask.bool()))
    condition, first, second = args[0], args[1], args[2]
    fill = second if first is source else first
    value = _scalar(fill)
    if value is None or value > BLOCKING_BIAS or source not in (first, second):
        return replace(info, unsupported="where() that does not block cells")
    keep = condition.bool()
    return replace(info, blocked=_or(info.blocked, ~keep if first is source else keep))


def split_bias(additive: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(blocked, bias)`` from an additive mask: terms at or below -5000 block their cell."""
    additive = additive.float()
    blocked = additive <= BLOCKING_BIAS
    bias = additive.masked_fill(blocked, 0.0)
    return (blocked if bool(blocked.any()) else None), (bias if bool(bias.any()) else None)


def _or(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a | b


def _row_slice(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    if t is None or t.shape[-2] == 1:
        return t
    return t.index_select(-2, rows)


def _recompute(q, k, scale, blocked, bias) -> torch.Tensor:
    """float32 weights from q, k, the scale and the mask truth."""
    return attention_weights(q.float(), k.float(), blocked, scale, bias=bias)


def _sdpa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """The signature of ``F.scaled_dot_product_attention``, to bind a call's arguments."""


_SDPA = inspect.signature(_sdpa_arguments)


@reads("scaled_dot_product_attention")
def _read_sdpa(recorder: AttentionRecorder, func, args, kwargs):
    result = func(*args, **kwargs)
    bound = _SDPA.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    q, k, v = a["query"], a["key"], a["value"]
    dtype = q.dtype
    if k.shape[-3] != q.shape[-3] and q.dim() >= 3 and q.shape[-3] % k.shape[-3] == 0:
        groups = q.shape[-3] // k.shape[-3]  # grouped-query attention
        k = k.repeat_interleave(groups, dim=-3)  # (B, H, S, E)
        v = v.repeat_interleave(groups, dim=-3)  # (B, H, S, E)
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q, k = q.expand(*lead, *q.shape[-2:]), k.expand(*lead, *k.shape[-2:])
        v = v.expand(*lead, *v.shape[-2:])
    length, n_keys = q.shape[-2], k.shape[-2]
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    call = AttentionCall(recorder.module, "sdpa", q, k, float(scale), weights=None, dtype=dtype)
    call.v, call.context = v, result
    mask, causal = a["attn_mask"], a["is_causal"]
    if a["dropout_p"]:
        call.unsupported = f"attention dropout is on (dropout_p={a['dropout_p']})"
    elif recorder.records_weights(q.shape[:-2], length, n_keys):
        blocked, bias = _mask_terms(mask, true_allows=True)
        if causal:
            causal_cells = torch.ones(length, n_keys, dtype=torch.bool, device=q.device).triu(1)
            blocked = _or(blocked, causal_cells)
        call.blocked, call.bias = blocked, bias
        call.weights = _recompute(q, k, call.scale, blocked, bias)  # (*lead, L, S)
        _check_output(call, _output_error(call.weights, v, result), "the weights from its")
    else:
        try:
            if causal:
                mode, padding = "causal", None  # torch refuses is_causal with a mask
            else:
                blocked = _blocked_only(mask, true_allows=True)
                mode, padding = _structure(blocked, q.shape[:-2], length, n_keys)
            call.virtual, context = _virtual_form(q, k, v, call.scale, mode, padding)
        except UnsupportedAttention as error:
            call.unsupported = str(error)
        else:
            error = float((context - result.to(context.dtype)).abs().max()) if v.numel() else 0.0
            _check_output(call, error, "the row statistics of its")
    recorder._open_call(call)
    return result


def _check_output(call: AttentionCall, error: float, what: str) -> None:
    """The call is unsupported unless what was recorded reproduces its output."""
    if not error <= tolerance(call.dtype) * max(1.0, float(call.v.abs().max())):  # NaN fails too
        call.unsupported = (
            f"{what} q, k and mask do not reproduce the output of its "
            f"scaled_dot_product_attention call (max error {error:.3g})"
        )


def _mask_terms(mask: torch.Tensor | None, true_allows: bool):
    """``(blocked, bias)`` of a mask argument: a bool one is True where allowed (SDPA's
    ``attn_mask``) or where blocked (``nn.MultiheadAttention``'s), a float one additive."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return (~mask if true_allows else mask), None
    return split_bias(mask)


def _blocked_only(mask: torch.Tensor | None, true_allows: bool) -> torch.Tensor | None:
    """The cells a mask argument blocks; an additive bias has no virtual form."""
    blocked, bias = _mask_terms(mask, true_allows)
    if bias is not None:
        raise UnsupportedAttention(_HAS_BIAS)
    return blocked


_TOO_LARGE = (
    "it is recorded as row statistics instead of weights (dense=False, or weights larger "
    "than attnpanel.traces.virtual.DENSE_MAX_BYTES), which need a mask of a mode (none, diagonal, "
    "causal) plus padded keys and no bias; capture it with dense=True (a shorter input if "
    "its weights do not fit): "
)
_HAS_BIAS = _TOO_LARGE + "it adds a bias to the scores"


def _structure(blocked, lead, length: int, n_keys: int) -> tuple[str, torch.Tensor | None]:
    """A mask as a mode and padded keys ``(*lead, S)``, read block of rows by block.

    ``blocked`` is broadcastable to ``(*lead, L, S)``; nothing of that size is made.

    Raises
    ------
    UnsupportedAttention
        When it blocks other cells, or its mode differs between samples or heads.
    """
    if blocked is None:
        return "none", None
    cells = blocked.reshape((1,) * (len(lead) + 2 - blocked.dim()) + tuple(blocked.shape))
    own = cells.shape[:-2]  # the leading dims it varies along (1 where it broadcasts)
    modes = ("none", "causal", "diagonal") if length == n_keys else ("none",)
    padded = torch.zeros((*own, n_keys), dtype=torch.bool)
    found = set()
    for index in itertools.product(*map(range, own)):
        one = cells[index]  # (L or 1, S or 1)
        keys = one.all(dim=0).expand(n_keys)  # blocked for every query: padding
        padded[index] = keys
        mode = next((m for m in modes if _matches(one, m, keys, length)), None)
        if mode is None:
            raise UnsupportedAttention(_TOO_LARGE + "its mask blocks other cells")
        found.add(mode)
    if len(found) > 1:
        raise UnsupportedAttention(
            _TOO_LARGE + f"its mask is {' in some rows, '.join(sorted(found))} in others"
        )
    return found.pop(), (padded.expand(*lead, n_keys) if bool(padded.any()) else None)


def _matches(cells: torch.Tensor, mode: str, keys: torch.Tensor, length: int) -> bool:
    """Whether ``cells`` ``(L or 1, S or 1)`` block exactly ``mode`` plus ``keys``."""
    n_keys = keys.numel()
    if cells.shape[0] == 1:
        return mode == "none"
    structure = masks_module.Masking(mode)
    for start in range(0, length, STRUCTURE_ROWS):
        rows = slice(start, min(start + STRUCTURE_ROWS, length))
        own = structure.blocked(rows, slice(0, n_keys), keys.device)
        expected = keys.expand(rows.stop - start, n_keys)
        expected = expected if own is None else own | expected
        if not torch.equal(cells[rows].expand_as(expected), expected):
            return False
    return True


def _exact_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _virtual_form(q, k, v, scale: float, mode: str, padding) -> tuple[VirtualForm, torch.Tensor]:
    """The rows' lse and the context ``(*lead, L, E)`` through the bounded fused pass
    (:func:`attnpanel.kernels.tiles.attention`); ``v`` None gives the lse alone."""
    lead = q.shape[:-2]
    count = math.prod(lead)
    dtype = _exact_dtype(q)

    def flat(t):  # (*lead, n, E) -> (count, 1, n, E): every leading index a sample of its own
        return t.expand(*lead, *t.shape[-2:]).reshape(count, 1, *t.shape[-2:]).to(dtype)

    key_padding = None if padding is None else padding.reshape(count, -1)
    masking = masks_module.Masking(mode, key_padding=key_padding)
    if v is None:
        context, lse = None, tiles.log_sum_exp(flat(q), flat(k), masking, scale)
    else:
        context, lse = tiles.attention(flat(q), flat(k), flat(v), masking, scale)
        context = context.reshape(*lead, *context.shape[-2:])
    form = VirtualForm(lse.reshape(*lead, -1).float(), mode, padding)
    return form, context


def _output_error(weights: torch.Tensor, v: torch.Tensor, output: torch.Tensor) -> float:
    """Largest difference of ``weights @ v`` from the kernel's output, on spread rows."""
    if not v.numel() or not weights.numel():
        return 0.0
    rows = spread_rows(weights.shape[-2])
    product = weights.index_select(-2, rows) @ v.float()  # (*lead, rows, E)
    return float((product - output.index_select(-2, rows).float()).abs().max())


_BOUNDED = inspect.signature(tiles.attention)


@reads("attention")
def _read_bounded(recorder: AttentionRecorder, func, args, kwargs):
    """attnpanel's own attention at any length (:func:`attnpanel.kernels.tiles.attention`): q, k,
    v, the mask and each row's ``lse``, whole."""
    result = func(*args, **kwargs)
    if func is not tiles.attention:
        return result
    bound = _BOUNDED.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    masking = a["masking"]
    lead = torch.broadcast_shapes(a["q"].shape[:-2], a["k"].shape[:-2], a["v"].shape[:-2])
    q, k, v = (a[name].expand(*lead, *a[name].shape[-2:]) for name in "qkv")
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    call = AttentionCall(recorder.module, "attnpanel", q, k, float(scale), None, dtype=q.dtype)
    call.v, call.context = v, result[0]
    length, n_keys = q.shape[-2], k.shape[-2]
    if recorder.records_weights(lead, length, n_keys):
        call.blocked = masking.blocked(slice(0, length), slice(0, n_keys), q.device)
        call.bias = masking.bias_tile(slice(0, length), slice(0, n_keys))
        call.weights = _recompute(q, k, call.scale, call.blocked, call.bias)
    elif masking.bias is not None:
        call.unsupported = _HAS_BIAS
    else:
        padding = masking.key_padding
        if padding is not None:
            padding = padding[:, None, :].expand(*lead, n_keys)
        call.virtual = VirtualForm(result[1].reshape(*lead, length).float(), masking.mode, padding)
    recorder._open_call(call)
    return result


_MHA = inspect.signature(F.multi_head_attention_forward)


@reads("multi_head_attention_forward")
def _read_mha(recorder: AttentionRecorder, func, args, kwargs):
    result = func(*args, **kwargs)
    bound = _MHA.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    heads = a["num_heads"]
    call = AttentionCall(recorder.module, "multi_head_attention_forward", query, key, 1.0, query)
    call.dtype = query.dtype
    if a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None:
        call.unsupported = "add_bias_kv, add_zero_attn or static keys add keys beyond the input"
        recorder._open_call(call)
        return result
    unbatched = query.dim() == 2
    seq_first = [t[:, None] if unbatched else t for t in (query, key, value)]  # (L, B, D)
    xq, xk, xv = (t.transpose(0, 1) for t in seq_first)  # (B, L, D)
    if a["use_separate_proj_weight"]:
        w_q, w_k, w_v = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
    else:
        w_q, w_k, w_v = a["in_proj_weight"].chunk(3)
    b_q = b_k = b_v = None
    if a["in_proj_bias"] is not None:
        b_q, b_k, b_v = a["in_proj_bias"].chunk(3)
    q = _split(F.linear(xq, w_q, b_q), heads)  # (B, H, L, E)
    k = _split(F.linear(xk, w_k, b_k), heads)  # (B, H, S, E)
    v = _split(F.linear(xv, w_v, b_v), heads)  # (B, H, S, E)
    batch, _, length, head_dim = q.shape
    n_keys = k.shape[2]
    call.q, call.k, call.v, call.scale = q, k, v, head_dim**-0.5
    call.cross = not (query is key or (query.shape == key.shape and torch.equal(query, key)))
    mask, padding = a["attn_mask"], a["key_padding_mask"]
    if mask is not None and mask.dim() == 3:
        mask = mask.view(batch, heads, length, n_keys)
    if padding is not None:
        padding = (padding[None] if unbatched else padding)[:, None, None, :]  # (B, 1, 1, S)
    if recorder.records_weights(q.shape[:-2], length, n_keys):
        call.blocked, call.bias = _mha_mask(mask, padding)
        call.weights = _recompute(q, k, call.scale, call.blocked, call.bias)  # (B, H, L, S)
        call.context = call.weights @ v.float()  # (B, H, L, E)
    else:
        try:
            blocked = _blocked_only(mask, true_allows=False)
            mode, blocked = _structure(blocked, q.shape[:-2], length, n_keys)
            keys = _blocked_only(padding, true_allows=False)  # (B, 1, 1, S)
            if keys is not None:
                keys = keys[:, :, 0].expand(batch, heads, n_keys)
                blocked = keys if blocked is None else blocked | keys
            call.virtual, context = _virtual_form(q, k, v, call.scale, mode, blocked)
            call.context = context.float()
        except UnsupportedAttention as error:
            call.unsupported = str(error)
            recorder._open_call(call)
            return result
    merged = call.context.transpose(1, 2).reshape(batch, length, heads * head_dim)  # (B, L, D)
    output = F.linear(merged, a["out_proj_weight"].float(), _float(a["out_proj_bias"]))
    actual = result[0][:, None] if unbatched else result[0]
    actual = actual.transpose(0, 1)  # (B, L, D)
    call.projections = {
        "x": xq,
        "output": actual,
        "w_q": w_q,
        "w_k": w_k,
        "w_v": w_v,
        "w_o": a["out_proj_weight"],
        "b_q": b_q,
        "b_k": b_k,
        "b_v": b_v,
        "b_o": a["out_proj_bias"],
    }
    if a["dropout_p"] and a["training"]:
        call.unsupported = f"attention dropout is on (dropout_p={a['dropout_p']})"
    else:
        error = float((output - actual.float()).abs().max())
        if not error <= tolerance(call.dtype) * max(1.0, float(actual.abs().max())):
            call.unsupported = (
                f"the weights from in_proj and the masks do not reproduce the output of "
                f"multi_head_attention_forward (max error {error:.3g})"
            )
    recorder._open_call(call)
    return result


def _mha_mask(mask, padding) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(blocked, bias)`` of ``nn.MultiheadAttention``'s ``attn_mask`` and key padding."""
    blocked, bias = _mask_terms(mask, true_allows=False)
    extra_blocked, extra_bias = _mask_terms(padding, true_allows=False)
    if extra_bias is not None:
        bias = extra_bias if bias is None else bias + extra_bias
    return _or(blocked, extra_blocked), bias


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _split(t: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = t.shape
    return t.reshape(batch, length, heads, width // heads).transpose(1, 2)  # (B, H, L, E)


@reads("softmax")
def _read_softmax(recorder: AttentionRecorder, func, args, kwargs):
    result = func(*args, **kwargs)
    logits = args[0] if args else kwargs.get("input")
    info = recorder._get(logits)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(info, _Scores) or not isinstance(result, torch.Tensor):
        return result
    if dim is None or dim not in (-1, logits.dim() - 1):
        return result
    q, k = info.q, info.k
    lead = logits.shape[:-2]
    try:
        q = q.reshape(*lead, *q.shape[-2:])  # (*lead, L, E)
        k = k.reshape(*lead, *k.shape[-2:])  # (*lead, S, E)
    except RuntimeError:
        return result
    call = AttentionCall(recorder.module, "softmax", q, k, info.scale, result.detach())
    call.dtype = q.dtype
    call.unsupported = info.unsupported
    if not call.unsupported:
        blocked, bias = info.blocked, None
        if info.bias is not None:
            extra, bias = split_bias(info.bias)
            blocked = _or(blocked, extra)
        call.blocked, call.bias = _lead(blocked, lead), _lead(bias, lead)
        _check_softmax(call, result)
    length, n_keys = result.shape[-2:]
    if not call.unsupported and not recorder.records_weights(lead, length, n_keys):
        _to_virtual(call)
    recorder._open_call(call)
    recorder._set(result, _Weights(call))
    return result


def _to_virtual(call: AttentionCall) -> None:
    """Keep a checked softmax call's rows' lse instead of its weights (too large to hold)."""
    try:
        if call.bias is not None:
            raise UnsupportedAttention(_HAS_BIAS)
        lead, (length, n_keys) = call.q.shape[:-2], (call.q.shape[-2], call.k.shape[-2])
        mode, padding = _structure(call.blocked, lead, length, n_keys)
        call.virtual, _ = _virtual_form(call.q, call.k, None, call.scale, mode, padding)
    except UnsupportedAttention as error:
        call.unsupported = str(error)
    else:
        call.weights = call.blocked = None  # the model's own, not held beyond its use


def _lead(t: torch.Tensor | None, lead: torch.Size) -> torch.Tensor | None:
    """A mask or bias broadcastable to ``(*lead, L, S)``, as the scores were viewed."""
    if t is None or t.dim() <= 2:
        return t
    if t.shape[:-2].numel() == lead.numel() or t.dim() != len(lead) + 2:
        return t.expand(*t.shape[:-2], *t.shape[-2:]).reshape(*lead, *t.shape[-2:])
    return t


def spread_rows(length: int, count: int = CHECKED_ROWS) -> torch.Tensor:
    """Query rows to verify: all of a short sequence, else an even spread with both ends."""
    if length <= count:
        return torch.arange(length)
    return torch.linspace(0, length - 1, count).round().long().unique()


def _check_softmax(call: AttentionCall, weights: torch.Tensor) -> None:
    """The model's weights must follow from q, k, the scale and the mask truth.

    Checked on an even spread of query rows (every row of a short sequence): a wrong
    scale, bias or mask shows in any row, and the whole check costs a few percent of
    the attention it checks.
    """
    rows = spread_rows(call.q.shape[-2])
    blocked = _row_slice(call.blocked, rows)
    bias = _row_slice(call.bias, rows)
    q = call.q.index_select(-2, rows)
    recomputed = _recompute(q, call.k, call.scale, blocked, bias)
    difference = (recomputed - weights.index_select(-2, rows).float()).abs()
    if blocked is not None:
        empty = blocked.expand_as(difference).all(dim=-1, keepdim=True)
        difference = difference.masked_fill(empty, 0.0)  # a padding row: what the model made of it
    error = float(difference.max()) if difference.numel() else 0.0
    # rounding grows with the logits (large in trained models): the derived bound, never less
    # than the fixed floor that tells a wrong scale or mask from rounding
    allowed = tolerance(call.dtype)
    if call.dtype in precision.EPSILON:
        logits = precision.max_logit(q, call.k, call.scale, blocked, bias)
        allowed = max(allowed, precision.softmax_bound(call.dtype, logits))
    if not error <= allowed:  # NaN fails too
        call.unsupported = (
            f"its softmax weights do not follow from q.k, scale {call.scale:.4g} and the "
            f"additive terms (max error {error:.3g})"
        )

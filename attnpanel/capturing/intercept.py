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

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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


_FUSED_PATH = {"lock": threading.Lock(), "users": 0, "was": True}


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _modes_skip_fused_path() -> bool:
    """Whether a :class:`TorchFunctionMode` on this thread's stack keeps PyTorch off its
    fused encoder path: the path's guard asks ``has_torch_function``, which a mode turns on."""
    with _Passing():
        return bool(torch.overrides.has_torch_function((torch.empty(0),)))


MODES_SKIP_FUSED_PATH = _modes_skip_fused_path()


@contextlib.contextmanager
def fused_path_off() -> Iterator[None]:
    """PyTorch's fused ``nn.TransformerEncoderLayer`` path kept off while a mode of this
    package runs the model inside this context.

    That path computes attention without calling ``F.multi_head_attention_forward``, so
    neither capture nor ablation would see it. Where a mode alone keeps the path off (every
    release with ``has_torch_function`` answering for modes), nothing global is touched: the
    mode stack is this thread's, so a model running plainly in another thread (a served
    page's other session) keeps its fused path. Otherwise the process-wide switch is
    turned off: the first of overlapping users turns it off and the last one out restores
    what it was.
    """
    if MODES_SKIP_FUSED_PATH:
        yield
        return
    with _FUSED_PATH["lock"]:
        if _FUSED_PATH["users"] == 0:
            _FUSED_PATH["was"] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _FUSED_PATH["users"] += 1
    try:
        yield
    finally:
        with _FUSED_PATH["lock"]:
            _FUSED_PATH["users"] -= 1
            if _FUSED_PATH["users"] == 0:
                torch.backends.mha.set_fastpath_enabled(_FUSED_PATH["was"])


class CaptureError(ValueError):
    """A model, module or input that :func:`capture` cannot trace exactly."""


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
class Scores:
    """What is known of a tensor computed from a ``q . k`` product."""

    q: torch.Tensor  # (*lead, L, E)
    k: torch.Tensor  # (*lead, S, E)
    module: str
    scale: float = 1.0
    bias: torch.Tensor | None = None  # added terms, in units of the current logits
    blocked: torch.Tensor | None = None  # cells filled with a blocking value
    unsupported: str = ""


@dataclass
class Weights:
    """A softmax output on its way to ``weights @ v``."""

    call: AttentionCall


class Lineage:
    """Where tensors came from, by identity, for as long as each tensor lives."""

    def __init__(self):
        self._known: dict[int, tuple[weakref.ref, object]] = {}

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

    # A recorder that computes what it needs from q, k and the mask itself (a survey's
    # statistics, block by block) sets this: an SDPA call then gets no recomputed weights,
    # and the recorder checks the output it reproduces.
    defers_weights = False

    def __init__(self, dense: bool | None = None):
        super().__init__()
        self.dense = dense
        self.calls: list[AttentionCall] = []
        self.stack: list[tuple[str, nn.Module, tuple, dict]] = []  # running modules
        self.module_calls: dict[int, tuple] = {}  # id(call) -> (module, args, kwargs, output)
        # id(call) -> [module, input, output, name] of the Linear that took the call's module's
        # output as its input (BERT's attention.output.dense: the output projection that
        # the module computing the attention leaves to its sibling)
        self.consumers: dict[int, list] = {}
        self.module_outputs: dict[int, tuple[weakref.ref, AttentionCall]] = {}  # by id(output)
        self._known = Lineage()

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

    # What a reader (attnpanel.capturing.readers) tells the recorder and asks of it.
    def record_call(self, call: AttentionCall) -> None:
        """Keep an attention call, attributed to the module running it."""
        self.calls.append(call)
        if self.stack:
            self.module_calls[id(call)] = self.stack[-1][1:]

    # lineage of tensors

    def lineage(self, t) -> object:
        """What the recorder knows of where a tensor came from (a q . k product, scores,
        weights), or None."""
        return self._known.of(t)

    def follow(self, t: torch.Tensor, info) -> None:
        """Remember where ``t`` came from, for the operations that take it next."""
        self._known.follow(t, info)

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
        known = [(t, self.lineage(t)) for t in tensors]
        known = [(t, info) for t, info in known if info is not None]
        if not known:
            if name in PRODUCTS:
                self._product(name, args, result)
            return
        source, info = known[0]
        if isinstance(info, Weights):
            self._follow_weights(name, args, source, info, result)
        elif isinstance(info, Scores):
            self._follow_scores(name, args, source, info, result)

    def _product(self, name: str, args, result: torch.Tensor) -> None:
        operands = product_operands(name, args)
        if operands is None:
            return
        q, k = operands
        self.follow(result, Scores(q, k, self.module))

    def _follow_scores(self, name, args, source, info: Scores, result) -> None:
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
        self.follow(result, info)

    def _follow_weights(self, name, args, source, info: Weights, result) -> None:
        if name in PRODUCTS and info.call.context is None:
            _weights_times_values(name, args, source, info.call, result)
        elif name in KEEPS or (name in VIEWS and result.shape[-2:] == source.shape[-2:]):
            self.follow(result, info)


class _Watch:
    """Module hooks that keep :attr:`AttentionRecorder.stack` in step with the forward."""

    def __init__(self, recorder: AttentionRecorder, model: nn.Module):
        self.recorder = recorder
        self.model = model
        self.handles: list = []
        self.pending: dict[int, list] = {}  # id(Linear) -> its consumer entry, until it returns

    def __enter__(self):
        stack = self.recorder.stack
        thread = threading.get_ident()  # the recorder (a torch mode) sees only this thread
        for name, module in self.model.named_modules():

            def enter(module, args, kwargs, name=name):
                if threading.get_ident() != thread:
                    return  # another thread's forward of the same model: not recorded
                stack.append((name, module, args, kwargs))
                if isinstance(module, nn.Linear) and args:
                    self._consumer(module, args[0], name)

            def leave(module, args, kwargs, output, name=name):
                if threading.get_ident() != thread:
                    return
                pending = self.pending.pop(id(module), None)
                if pending is not None:
                    pending[2] = output
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
        first = output[0] if isinstance(output, tuple | list) and output else output
        for call in self.recorder.calls:
            known = self.recorder.module_calls.get(id(call))
            if known is not None and known[0] is entry[1] and len(known) == 3:
                self.recorder.module_calls[id(call)] = (*known, output)
                if isinstance(first, torch.Tensor):
                    self.recorder.module_outputs[id(first)] = (weakref.ref(first), call)

    def _consumer(self, module: nn.Module, given, name: str) -> None:
        """Note a Linear that takes a recorded module's output as it is."""
        found = self.recorder.module_outputs.get(id(given))
        if found is None or found[0]() is not given:
            return
        call = found[1]
        if id(call) not in self.recorder.consumers:
            entry = [module, given, None, name]
            self.recorder.consumers[id(call)] = entry
            self.pending[id(module)] = entry

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


def einsum_parts(args) -> tuple[list[str], str, list[torch.Tensor]] | None:
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


def _weights_times_values(name, args, source, call: AttentionCall, result) -> None:
    """Record v and the context from ``weights @ v`` (matmul, bmm or einsum)."""
    if name in ("matmul", "bmm"):
        if args[0] is not source or not isinstance(args[1], torch.Tensor):
            return
        v, context = args[1], result  # (*lead, S, E), (*lead, L, E)
    else:
        parts = einsum_parts(args)
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


def _masking(name: str, args, source: torch.Tensor, info: Scores) -> Scores:
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
        return replace(info, blocked=union(info.blocked, mask.bool()))
    condition, first, second = args[0], args[1], args[2]
    fill = second if first is source else first
    value = _scalar(fill)
    if value is None or value > BLOCKING_BIAS or source not in (first, second):
        return replace(info, unsupported="where() that does not block cells")
    keep = condition.bool()
    return replace(info, blocked=union(info.blocked, ~keep if first is source else keep))


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


def row_slice(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    if t is None or t.shape[-2] == 1:
        return t
    return t.index_select(-2, rows)


def recompute(q, k, scale, blocked, bias) -> torch.Tensor:
    """float32 weights from q, k, the scale and the mask truth."""
    return attention_weights(q.float(), k.float(), blocked, scale, bias=bias)


def spread_rows(length: int, count: int = CHECKED_ROWS) -> torch.Tensor:
    """Query rows to verify: all of a short sequence, else an even spread with both ends."""
    if length <= count:
        return torch.arange(length)
    return torch.linspace(0, length - 1, count).round().long().unique()

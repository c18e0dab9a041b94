"""Record every attention computation of a running model: the reading use of the watcher.

:class:`AttentionRecorder` is an :class:`~attnpanel.watching.watcher.AttentionWatcher`: at
each attention site it finds, a reader records an :class:`AttentionCall` holding q and k
exactly as they entered the product (after rotary embeddings, after grouped-query
expansion), v, the scale, every cell the model blocked and every additive bias, per sample
and head, and the weights. A reader per kind of fused call registers itself with
:func:`reads` (:mod:`attnpanel.capturing.readers`); the softmax path is read from what the
watcher followed from ``q . k`` to the softmax.

Module hooks attribute each call to the innermost module running it, and note what only a
module knows (its output, the Linear that takes it). Nothing here changes what the model
computes: every function is called with its own arguments and its result returned untouched.

Shapes use ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys and ``E`` head dim.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnpanel.kernels.attention import attention_weights
from attnpanel.traces import virtual
from attnpanel.watching.linear import NORMALISER, LinearForm
from attnpanel.watching.modules import Running
from attnpanel.watching.watcher import AttentionWatcher, Site, ValuesProduct

CHECKED_ROWS = 64  # rows on which a captured softmax or projection is checked
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}
STRUCTURE_ROWS = 1024  # rows of a model's mask compared with a mode at a time


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
    via: str  # "sdpa", "multi_head_attention_forward", "softmax" or "linear"
    q: torch.Tensor  # (B, H, L, E) as it entered the product (linear: its features phi(q))
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
    layer: str = ""  # its layer name, as the watcher named its site
    fill: str = ""  # how the model blocked cells, in words (readers.fill_words); "" if none
    normaliser: str = "softmax"  # how a row's products became weights ("row sum": linear)


@dataclass(frozen=True)
class VirtualForm:
    """An attention too large to record as weights: each row's log-sum-exp and the mask as
    a mode plus padded keys, from which every cell is recomputed exactly
    (:mod:`attnpanel.traces.virtual`)."""

    lse: torch.Tensor  # (*lead, L) float32
    mode: str  # "none", "diagonal" or "causal"
    padding: torch.Tensor | None  # (*lead, S) bool: keys blocked for every query


_READERS: dict[str, Callable] = {}


def reads(via: str):
    """Register a reader for the attention sites of kind ``via`` ("sdpa",
    "multi_head_attention_forward", "attnpanel" or "softmax").

    A reader is ``reader(recorder, site, func, args, kwargs) -> result``: it must call
    ``func`` with the arguments it was given and return that result unchanged.
    """

    def register(reader):
        _READERS[via] = reader
        return reader

    return register


class AttentionRecorder(AttentionWatcher):
    """Record every attention computation run inside ``with recorder.watching(model):``.

    Examples
    --------
    >>> recorder = AttentionRecorder()  # doctest: +SKIP
    >>> with recorder.watching(model), torch.no_grad():  # doctest: +SKIP
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
        self.module_calls: dict[int, tuple] = {}  # id(call) -> (module, args, kwargs, output)
        # id(call) -> [module, input, output, name] of the Linear that took the call's module's
        # output as its input (BERT's attention.output.dense: the output projection that
        # the module computing the attention leaves to its sibling)
        self.consumers: dict[int, list] = {}
        self.module_outputs: dict[int, tuple[weakref.ref, AttentionCall]] = {}  # by id(output)
        self._pending: dict[int, list] = {}  # id(Linear) -> its consumer entry, until it returns

    def records_weights(self, lead, length: int, n_keys: int) -> bool:
        """Whether a call of ``(*lead, length, n_keys)`` cells is recorded with its weights
        (else in the virtual form)."""
        return virtual.wants_dense(math.prod(lead), 1, length, n_keys, self.dense)

    def record_call(self, call: AttentionCall, site: Site) -> None:
        """Keep an attention call, attributed to the module running it."""
        call.layer = site.layer
        site.note["call"] = call
        self.calls.append(call)
        if site.running is not None:
            running = site.running
            self.module_calls[id(call)] = (running.module, running.args, running.kwargs)

    # the watcher's hooks

    def attention(self, site: Site, func, args, kwargs):
        return _READERS[site.via](self, site, func, args, kwargs)

    def softmax(self, site: Site, func, args, kwargs):
        return _READERS["softmax"](self, site, func, args, kwargs)

    def linear(self, site: Site, form: LinearForm, result: torch.Tensor):
        """A linear attention: its implicit weights, from the model's own features."""
        q, k = form.q.detach(), form.k.detach()
        call = AttentionCall(site.module, "linear", q, k, 1.0, form.weights)
        call.v, call.context = form.v.detach(), form.context
        call.dtype = form.q.dtype
        call.normaliser = NORMALISER
        self.record_call(call, site)
        return result

    def values(self, site: Site, product: ValuesProduct, func, args, kwargs):
        result = func(*args, **kwargs)
        call = site.note.get("call")
        if call is None or call.context is not None:
            return result
        lead = call.q.shape[:-2]
        try:
            v, context = product.canonical(args, result, site.lead)
            call.v = v.reshape(*lead, *v.shape[-2:])
            call.context = context.reshape(*lead, *context.shape[-2:])
        except RuntimeError:
            call.v = call.context = None
        return result

    def entered(self, running: Running) -> None:
        if isinstance(running.module, nn.Linear) and running.args:
            self._consumer(running.module, running.args[0], running.name)

    def left(self, running: Running, output) -> None:
        pending = self._pending.pop(id(running.module), None)
        if pending is not None:
            pending[2] = output
        first = output[0] if isinstance(output, tuple | list) and output else output
        for call in self.calls:
            known = self.module_calls.get(id(call))
            if known is not None and known[0] is running.module and len(known) == 3:
                self.module_calls[id(call)] = (*known, output)
                if isinstance(first, torch.Tensor):
                    self.module_outputs[id(first)] = (weakref.ref(first), call)

    def _consumer(self, module: nn.Module, given, name: str) -> None:
        """Note a Linear that takes a recorded module's output as it is."""
        found = self.module_outputs.get(id(given))
        if found is None or found[0]() is not given:
            return
        call = found[1]
        if id(call) not in self.consumers:
            entry = [module, given, None, name]
            self.consumers[id(call)] = entry
            self._pending[id(module)] = entry


def row_slice(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    if t is None or t.shape[-2] == 1:
        return t
    return t.index_select(-2, rows.to(t.device))


def recompute(q, k, scale, blocked, bias) -> torch.Tensor:
    """float32 weights from q, k, the scale and the mask truth."""
    return attention_weights(q.float(), k.float(), blocked, scale, bias=bias)


def spread_rows(length: int, count: int = CHECKED_ROWS, device=None) -> torch.Tensor:
    """Query rows to verify: all of a short sequence, else an even spread with both ends;
    on ``device``, the tensors' the rows index (``index_select`` takes no index from
    another device)."""
    if length <= count:
        return torch.arange(length, device=device)
    return torch.linspace(0, length - 1, count, device=device).round().long().unique()

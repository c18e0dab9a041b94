"""The one mechanism that finds every attention computation in a running model.

Every attention, however written, ends in one of a few torch calls:

* ``F.scaled_dot_product_attention`` (fused kernels, Hugging Face ``sdpa``, nanoGPT);
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` and the layers built on it);
* attnpanel's own bounded attention (:func:`attnpanel.kernels.tiles.attention`);
* a ``softmax`` over a ``q . k`` product (``matmul``, ``bmm`` or ``einsum``), with a scale,
  additive biases and mask fills in between, then ``weights @ v`` (eager Hugging Face
  code, NILMFormer, TransformerLens, tutorials).

:class:`AttentionWatcher` is a :class:`torch.overrides.TorchFunctionMode` that recognises
them (following tensors by :mod:`~attnpanel.watching.lineage`), names each one's layer
(:meth:`~attnpanel.watching.modules.ModuleStack.name_call`) and hands it to three hooks as a
:class:`Site`: :meth:`~AttentionWatcher.attention` (a fused call), :meth:`~AttentionWatcher.softmax`
(the weights of a softmax path) and :meth:`~AttentionWatcher.values` (its ``weights @ v``).
A reader records what it sees there (:class:`attnpanel.capturing.recorder.AttentionRecorder`);
a writer changes a head there (:mod:`attnpanel.interventions`). The hooks' defaults call
the function with its own arguments and return its result untouched.

Shapes use ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys and ``E`` head dim.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attnpanel.kernels import tiles
from attnpanel.watching.lanes import Lane, split_lead
from attnpanel.watching.lineage import (
    KEEPS,
    PRODUCTS,
    SOFTMAX,
    Lineage,
    Scores,
    Weights,
    einsum_parts,
    follow_scores,
    keeps_weights,
    product_operands,
)
from attnpanel.watching.linear import LinearForm, Unnormalised, normalised, read_linear
from attnpanel.watching.modules import ModuleStack, Running, never_attends

FUSED_CALLS = {
    "scaled_dot_product_attention": "sdpa",
    "multi_head_attention_forward": "multi_head_attention_forward",
    "attention": "attnpanel",
}
MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _sdpa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """The signature of ``F.scaled_dot_product_attention``, to bind a call's arguments."""


SDPA_SIGNATURE = inspect.signature(_sdpa_arguments)
BOUNDED_SIGNATURE = inspect.signature(tiles.attention)


def bind(signature: inspect.Signature, args, kwargs) -> dict:
    """A call's arguments by name, defaults filled in."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


@dataclass
class Site:
    """One attention computation, found as the model runs it."""

    layer: str  # its layer name (a capture's ``layer`` coordinate)
    via: str  # "sdpa", "multi_head_attention_forward", "attnpanel" or "softmax"
    module: str  # the innermost named module running it ("" = the model itself)
    running: Running | None  # that module's call
    lead: tuple[int, ...]  # the attention's leading dims; flattened, (B, H)
    batch: int
    heads: int
    scores: Scores | None = None  # a softmax path: its q, k, scale and mask
    note: dict = field(default_factory=dict)  # what a watcher keeps of the site
    valued: bool = False  # its weights @ v was met
    calls: tuple = ()  # the module calls running through all of it, outermost first
    scope: str = ""  # the innermost of those ("": the model)

    @property
    def batch_hint(self) -> int | None:
        return self.running.batch if self.running is not None else None


@dataclass(frozen=True)
class ValuesProduct:
    """A ``weights @ v`` product: where v and the heads' output lanes are."""

    name: str
    v_position: int  # index of v among the call's positional arguments
    output_lane: Lane  # the heads' output lanes in the product's result
    v_lane: Lane | None  # v's head and key axes; None where v broadcasts over heads
    subscripts: tuple[str, str, str] | None = None  # einsum: weights, v, output

    def v(self, args) -> torch.Tensor:
        return args[self.v_position]

    def canonical(self, args, result: torch.Tensor, lead) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v, context)`` as ``(*lead, S, E)`` and ``(*lead, L, E)``."""
        v = self.v(args)
        if self.subscripts is None:
            v = v.expand(*lead, *v.shape[-2:]) if v.dim() >= len(lead) + 2 else v
            return v.reshape(*lead, *v.shape[-2:]), result.reshape(*lead, *result.shape[-2:])
        sub_w, sub_v, out = self.subscripts
        head_lead, query, key = sub_w[:-2], sub_w[-2], sub_w[-1]
        width = next(c for c in sub_v if c not in sub_w)
        v = torch.einsum(f"{sub_v}->{head_lead}{key}{width}", v)
        context = torch.einsum(f"{out}->{head_lead}{query}{width}", result)
        return v, context


def values_product(name: str, args, source: torch.Tensor, site: Site) -> ValuesProduct | None:
    """The product ``weights @ v`` of ``source`` (the weights), or None where it is not one."""
    lead = tuple(source.shape[:-2])
    if name in ("matmul", "bmm"):
        v = args[1] if len(args) > 1 else None
        if args[0] is not source or not isinstance(v, torch.Tensor) or v.dim() < 2:
            return None
        out_dim = len(torch.broadcast_shapes(source.shape[:-2], v.shape[:-2])) + 2
        axes = tuple(range(out_dim - 2 - len(lead), out_dim - 2))
        output = Lane(lead, axes, out_dim - 2, site.batch, site.heads)
        v_lane = None
        if tuple(v.shape[:-2]) == lead:
            v_lane = Lane(lead, tuple(range(len(lead))), v.dim() - 2, site.batch, site.heads)
        return ValuesProduct(name, 1, output, v_lane)
    parts = einsum_parts(args)
    if parts is None:
        return None
    (sub_a, sub_b), out, (a, b) = parts
    if a is source:
        sub_w, sub_v, v_position = sub_a, sub_b, 2
    elif b is source:
        sub_w, sub_v, v_position = sub_b, sub_a, 1
    else:
        return None
    if isinstance(args[1], list | tuple):
        return None  # einsum(eq, [a, b]): v is not an argument of its own
    head_lead, query, key = sub_w[:-2], sub_w[-2], sub_w[-1]
    width = [c for c in sub_v if c not in sub_w]
    if (
        len(sub_w) != len(lead) + 2
        or len(width) != 1
        or key not in sub_v
        or sorted(out) != sorted(head_lead + query + width[0])
    ):
        return None
    output = Lane(
        lead, tuple(out.index(c) for c in head_lead), out.index(query), site.batch, site.heads
    )
    v_lane = None
    if all(c in sub_v for c in head_lead):
        axes = tuple(sub_v.index(c) for c in head_lead)
        v_lane = Lane(lead, axes, sub_v.index(key), site.batch, site.heads)
    return ValuesProduct(name, v_position, output, v_lane, (sub_w, sub_v, out))


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

    That path computes attention without calling ``F.multi_head_attention_forward``, so no
    watcher would see it. Where a mode alone keeps the path off (every release with
    ``has_torch_function`` answering for modes), nothing global is touched: the mode stack
    is this thread's, so a model running plainly in another thread (a served page's other
    session) keeps its fused path. Otherwise the process-wide switch is turned off: the
    first of overlapping users turns it off and the last one out restores what it was.
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


class AttentionWatcher(TorchFunctionMode):
    """Find every attention computation run inside ``with watcher.watching(model):``.

    Subclasses override the hooks :meth:`attention`, :meth:`softmax` and :meth:`values`
    (and :meth:`entered` / :meth:`left` for what a module tells); each hook must call the
    function it is given, and returns what the model goes on with.

    Attributes
    ----------
    sites : list of Site
        Every attention of the current (or last) forward, in order: a new forward starts
        the list again (a site holds its module's inputs and its q and k).
    site_modules : set of str
        The modules every forward watched so far ran attention in.
    site_listener : callable or None
        ``site_listener(site)`` as each site is found (where it starts, for a replay).
    """

    # whether its module hooks only name layers (no entered/left of its own, as a capture's
    # reading of the projections has): then modules that never run attention go unhooked
    names_only = False

    def __init__(self):
        super().__init__()
        self.modules: ModuleStack | None = None
        self.lineage = Lineage()
        self.sites: list[Site] = []
        self.site_modules: set[str] = set()
        self.site_scopes: set[str] = set()
        self.site_listener = None  # called with each site as it is found

    # what the model and its modules tell

    def watch(
        self, model: nn.Module, only: set[str] | None = None, scope: set[str] | None = None
    ) -> ModuleStack:
        """A context manager that hooks every module of ``model`` (or the model and the
        modules ``only`` names) while it is open; with ``scope``, this watcher's mode is
        entered while those modules run."""
        hooked = only if only is None or scope is None else only | scope
        skip = never_attends if self.names_only else None
        self.modules = ModuleStack(
            model, self.entered, self.left, hooked, self.sites.clear, scope, self, skip
        )
        return self.modules

    def attention_modules(self) -> set[str]:
        """The modules the sites found so far ran in: enough hooks for later forwards of
        the same model on inputs of the same kind (:meth:`watch`'s ``only``)."""
        return set(self.site_modules)

    def attention_scope(self) -> set[str] | None:
        """The modules whose forwards ran every site found so far, whole (a softmax path's
        ``q . k``, softmax and ``weights @ v``): later forwards of the same model on
        inputs of the same kind need this watcher's mode only while these run
        (:meth:`watching`'s ``scope``). None where the whole model needs it: a site of the
        model itself, or ``nn.MultiheadAttention``'s (a mode anywhere above it keeps
        PyTorch's fused encoder paths, which never call it, off)."""
        if "" in self.site_scopes:
            return None
        return set(self.site_scopes)

    @contextlib.contextmanager
    def watching(
        self, model: nn.Module, only: set[str] | None = None, scope: set[str] | None = None
    ) -> Iterator[AttentionWatcher]:
        """Watch ``model``'s modules and its torch calls (off PyTorch's fused encoder path):
        every call, or with ``scope`` (:meth:`attention_scope` of an earlier forward) those
        made while a scope module runs (a mode's dispatch costs each torch call of the rest
        of the model some microseconds: a quarter of a small transformer's forward).

        On exit the module stack is let go: it holds this watcher's hooks (bound methods),
        and the cycle would keep every site's tensors (a batch's q, k and weights) alive
        until Python's slowest garbage collection, batch after batch in a survey.
        """
        mode = self if scope is None else contextlib.nullcontext()
        try:
            with fused_path_off(), self.watch(model, only, scope), mode:
                yield self
        finally:
            self.modules = None

    @property
    def module(self) -> str:
        return self.modules.module if self.modules is not None else ""

    def entered(self, running: Running) -> None:
        """A module starts its forward."""

    def left(self, running: Running, output) -> None:
        """A module's forward returned ``output``."""

    # the hooks: what to do at an attention site

    def attention(self, site: Site, func, args, kwargs):
        """A fused attention call (``site.via``): SDPA, ``nn.MultiheadAttention``'s function,
        attnpanel's bounded attention."""
        return func(*args, **kwargs)

    def softmax(self, site: Site, func, args, kwargs):
        """The softmax over ``site.scores``: its result is the weights."""
        return func(*args, **kwargs)

    def values(self, site: Site, product: ValuesProduct, func, args, kwargs):
        """The weights of a softmax path times the values: its result is the heads' output."""
        return func(*args, **kwargs)

    def linear(self, site: Site, form: LinearForm, result: torch.Tensor):
        """A linear attention's context, ``result`` (:mod:`~attnpanel.watching.linear`):
        what the model goes on with."""
        return result

    # the dispatch

    def _site(self, via: str, lead, heads: int | None = None, scores=None) -> Site:
        running = self.modules.innermost if self.modules is not None else None
        layer = self.modules.name_call() if self.modules is not None else "(model)"
        hint = running.batch if running is not None else None
        lead = tuple(int(s) for s in lead)
        if heads is None:
            batch, heads = split_lead(lead, hint)
        else:
            batch = lead[0] if len(lead) == 2 else 1
        return Site(layer, via, self.module, running, lead, batch, heads, scores)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        via = FUSED_CALLS.get(name)
        if via == "attnpanel" and func is not tiles.attention:
            via = None
        if via is not None:
            return self.attention(self._fused_site(via, args, kwargs), func, args, kwargs)
        if name in SOFTMAX:
            logits = args[0] if args else kwargs.get("input")
            info = self.lineage.of(logits)
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(info, Scores) and dim in (-1, logits.dim() - 1):
                site = self._site("softmax", logits.shape[:-2], scores=info)
                self._found(site)
                result = self.softmax(site, func, args, kwargs)
                self.lineage.follow(result, Weights(site))
                return result
        known = self.lineage.first_known(args, kwargs)
        if known is not None and isinstance(known[1], Weights) and name in PRODUCTS:
            source, info = known
            site = info.site
            product = None if site.valued else values_product(name, args, source, site)
            if product is not None:
                site.valued = True
                self._widen(site)
                return self.values(site, product, func, args, kwargs)
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor) or not result.is_floating_point():
            return result
        if known is None:
            if name in PRODUCTS and (operands := product_operands(name, args)) is not None:
                calls = tuple(self.modules.running) if self.modules is not None else ()
                self.lineage.follow(result, Scores(*operands, self.module, calls=calls))
            return result
        waiting = self._unnormalised(args)
        if waiting is not None and normalised(name, args, *waiting, result):
            return self._linear(waiting[1], result)
        source, info = known
        if isinstance(info, Scores):
            linear = read_linear(name, args, source, info, result)
            if linear is not None:
                form, done = linear
                if done:
                    return self._linear(form, result)
                self.lineage.follow(result, Unnormalised(form))
                return result
            followed = follow_scores(name, args, source, info, result)
            if followed is not None:
                self.lineage.follow(result, followed)
        elif isinstance(info, Weights) and keeps_weights(
            name, args, source, result, info.site.scores
        ):
            self.lineage.follow(result, info)
        elif isinstance(info, Unnormalised) and name in KEEPS and result.shape == source.shape:
            self.lineage.follow(result, info)
        return result

    def _unnormalised(self, args) -> tuple[torch.Tensor, LinearForm] | None:
        """A linear attention's ``phi(Q) KV`` among ``args``, with its form."""
        if not self.lineage:
            return None
        for t in args:
            info = self.lineage.of(t)
            if isinstance(info, Unnormalised):
                return t, info.form
        return None

    def _linear(self, form: LinearForm, result: torch.Tensor):
        """A linear attention's context is ``result``: its site."""
        site = self._site("linear", form.weights.shape[:-2])
        self._found(site)
        site.valued = True
        return self.linear(site, form, result)

    def _fused_site(self, via: str, args, kwargs) -> Site:
        if via == "sdpa":
            query = bind(SDPA_SIGNATURE, args, kwargs)["query"]
            site = self._site(via, query.shape[:-2])
        elif via == "attnpanel":
            a = bind(BOUNDED_SIGNATURE, args, kwargs)
            lead = torch.broadcast_shapes(a["q"].shape[:-2], a["k"].shape[:-2], a["v"].shape[:-2])
            site = self._site(via, lead)
        else:
            a = bind(MHA_SIGNATURE, args, kwargs)
            query, heads = a["query"], a["num_heads"]
            lead = (heads,) if query.dim() == 2 else (query.shape[1], heads)
            site = self._site(via, lead, heads=heads)
        self._found(site)
        return site

    def _found(self, site: Site) -> None:
        self.sites.append(site)
        self.site_modules.add(site.module)
        if site.via != "multi_head_attention_forward":  # (its scope: the model)
            site.calls = self._running()
            if site.scores is not None:
                site.calls = common_calls(site.calls, site.scores.calls)
        self._scope(site)
        if self.site_listener is not None:
            self.site_listener(site)

    def _widen(self, site: Site) -> None:
        """Its ``weights @ v`` runs now: the calls running through the whole site."""
        site.calls = common_calls(site.calls, self._running())
        self._scope(site)

    def _running(self) -> tuple:
        return tuple(self.modules.running) if self.modules is not None else ()

    def _scope(self, site: Site) -> None:
        site.scope = site.calls[-1].name if site.calls else ""
        self.site_scopes.add(site.scope)


def common_calls(a: tuple, b: tuple) -> tuple:
    """The module calls running at both times (the same calls, not only the same names:
    a module that returned and ran again between them does not run through both)."""
    common = []
    for x, y in zip(a, b, strict=False):
        if x is not y:
            break
        common.append(x)
    return tuple(common)


@dataclass
class HeadLanes:
    """``nn.MultiheadAttention``'s function run with an identity output projection, so that
    each head's lane of its output is there to read or change before the layer's own
    projection (exact: each merged output is one product by 1).

    ``lanes`` is ``(L, B, H, E)`` (``(L, H, E)`` unbatched); :meth:`project` finishes the
    call on (changed) lanes with the layer's own output projection.
    """

    lanes: torch.Tensor
    lane: Lane
    weights: torch.Tensor | None
    out_weight: torch.Tensor
    out_bias: torch.Tensor | None
    arguments: dict

    @classmethod
    def run(cls, func, args, kwargs) -> HeadLanes:
        a = bind(MHA_SIGNATURE, args, kwargs)
        heads = a["num_heads"]
        w_o, b_o = a["out_proj_weight"], a["out_proj_bias"]
        width = w_o.shape[1]
        identity = dict(a)
        identity["out_proj_weight"] = torch.eye(width, dtype=w_o.dtype, device=w_o.device)
        identity["out_proj_bias"] = None if b_o is None else torch.zeros_like(b_o)
        merged, weights = func(**identity)  # (L, B, D) or (L, D)
        lanes = merged.reshape(*merged.shape[:-1], heads, width // heads)  # (L, B, H, E)
        if merged.dim() == 2:
            lane = Lane((heads,), (lanes.dim() - 2,), 0, 1, heads)
        else:
            lane = Lane((merged.shape[1], heads), (1, 2), 0, merged.shape[1], heads)
        return cls(lanes, lane, weights, w_o, b_o, a)

    def project(self, lanes: torch.Tensor):
        """The call's own result, from these lanes."""
        merged = lanes.reshape(*lanes.shape[:-2], -1)
        return F.linear(merged, self.out_weight, self.out_bias), self.weights

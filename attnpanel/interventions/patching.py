"""Activation patching: a head's q, k, v, weights or output taken from a run on another input.

:func:`patch` is a context manager like :func:`attnpanel.ablate`: on entry the model runs
once on ``source`` and a :class:`HeadPatcher` records, at every attention site the watcher
finds, what ``what`` names; inside the block, the named heads' ``what`` is replaced by the
recorded one (at chosen positions only, when given) and everything downstream follows. The
other heads are bit-identical (``torch.where`` keeps their cells), and the model is
unchanged afterwards.

Where each ``what`` is exchanged, by kind of call:

================  ====================  ================================  ==================
what              SDPA                  softmax path (``q.k``, softmax,    ``nn.Multihead
                                        ``weights @ v``)                  Attention``
================  ====================  ================================  ==================
``output``        the call's result     the ``weights @ v`` result        its merged lanes
``q``, ``k``      the call's argument   the weights recomputed from the   recomputed from its
                                        patched q or k, the scale and     own projections
                                        the mask the watcher followed
``v``             the call's argument   the ``weights @ v`` operand       likewise
``weights``       ``w_source @ v`` for  the softmax's result              likewise
                  the patched heads
================  ====================  ================================  ==================

A recomputed exchange is exact to float32 rounding for the patched heads and leaves the
others' cells untouched. SDPA with grouped-query attention: where the call itself shares a
key/value head between query heads (``enable_gqa``), patching ``k`` or ``v`` of query head
``h`` patches key/value head ``h // group``, so every query head of its group sees it;
where the model expands k and v per query head before the call (Hugging Face's
``repeat_kv``), each query head's own copy is patched.

The same exchange points, given a zero that requires gradients instead of a source,
give attribution patching (:mod:`attnpanel.interventions.effects`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from attnpanel.capturing.readers import MhaHeads, as_lead, sdpa_heads, sdpa_mask
from attnpanel.capturing.recorder import recompute
from attnpanel.interventions.gate import (
    AblationError,
    HeadWriter,
    check_heads,
    check_layers,
    check_written,
    heads_asked,
)
from attnpanel.kernels.attention import attend
from attnpanel.watching.lanes import Lane
from attnpanel.watching.lineage import split_bias, union
from attnpanel.watching.watcher import (
    BOUNDED_SIGNATURE,
    MHA_SIGNATURE,
    SDPA_SIGNATURE,
    HeadLanes,
    Site,
    ValuesProduct,
    bind,
)

WHATS = ("output", "q", "k", "v", "weights")
KEEP = object()  # HeadPatcher.select: the positions stay as they were
MODES = ("record", "write", "probe")


class PatchingError(AblationError):
    """A patch that cannot be made: another shape, a layer the source did not run, a head's
    ``what`` that the call does not expose."""


def check_what(what: str) -> None:
    if what not in WHATS:
        raise PatchingError(f"what={what!r}: a head is patched at one of {WHATS}")


def inputs_of(given) -> tuple[tuple, dict]:
    """A model's inputs from a tuple of positional inputs, a dict of keyword inputs or one
    tensor."""
    if isinstance(given, torch.Tensor):
        return (given,), {}
    if isinstance(given, Mapping):
        return (), dict(given)
    if isinstance(given, tuple | list):
        return tuple(given), {}
    raise PatchingError(
        f"inputs are a tuple of positional inputs, a dict of keyword inputs or a tensor; "
        f"got {type(given).__name__}"
    )


class HeadPatcher(HeadWriter):
    """Record, write or probe each head's ``what`` at every attention site.

    Parameters
    ----------
    model : torch.nn.Module
    what : {"output", "q", "k", "v", "weights"}
    positions : sequence of int, optional
        Query positions (``output``, ``q``, ``weights``) or key positions (``k``, ``v``) to
        patch; every position by default.

    Attributes
    ----------
    mode : {"record", "write", "probe"}
        ``record``: keep each site's ``what`` (:attr:`recorded`); ``write``: replace the
        :attr:`selected` heads' by the recorded; ``probe``: add a zero that requires
        gradients to every head's (:attr:`probes`).
    selected : dict of str to list of int
        The heads written, by layer.
    """

    def __init__(self, model: nn.Module, what: str = "output", positions=None):
        super().__init__(model)
        check_what(what)
        self.what = what
        self.positions = None if positions is None else [int(p) for p in positions]
        self.mode = "record"
        self.selected: dict[str, list[int]] = {}
        self.recorded: dict[str, torch.Tensor] = {}
        self.probes: dict[str, tuple[torch.Tensor, torch.Tensor, Lane]] = {}
        self.groups: dict[str, int] = {}  # query heads per key/value head, where shared
        self.source_heads: dict[str, int] = {}  # the layers of the source run, their heads
        self.lengths: dict[str, int] = {}  # positions of each layer's patched tensor
        self.lanes: dict[str, Lane] = {}  # where the heads sit in each recorded tensor

    def record(self, *args, **kwargs):
        """Run the model on these inputs and keep every site's ``what``; the model's output."""
        self.mode, self.recorded, self.seen, self.only = "record", {}, {}, None
        self.scope = None
        with torch.no_grad(), self.watching():
            output = self.model(*args, **kwargs)
        self.source_heads = dict(self.seen)
        self.follow(self)  # later forwards hook and watch only what ran attention
        self.sites.clear()  # they hold the source run's activations
        return output

    def select(self, heads: Mapping[str, Sequence[int]], positions=KEEP) -> None:
        """Write ``heads`` (by layer) in the next forwards, at ``positions`` (all: None;
        by default the positions given before)."""
        self.mode, self.selected = "write", {k: list(v) for k, v in heads.items() if v}
        if positions is not KEEP:
            self.positions = None if positions is None else [int(p) for p in positions]
        self.seen, self.written = {}, set()

    def probe(self) -> None:
        """Add a zero that requires gradients at every head's ``what`` in the next forward."""
        self.mode, self.probes = "probe", {}
        self.seen, self.written = {}, set()

    # the exchange: one place for every kind of call and every what

    def exchange(self, site: Site, t: torch.Tensor, lane: Lane) -> torch.Tensor | None:
        """What the model goes on with in place of ``t`` (this site's ``what``), or None
        where it goes on with ``t`` as it is."""
        layer = site.layer
        if lane.heads != site.heads:
            self.groups[layer] = site.heads // lane.heads
        if self.mode == "record":
            self.recorded[layer] = t.detach().clone()
            self.lengths[layer] = t.shape[lane.position_axis]
            self.lanes[layer] = lane
            return None
        if self.mode == "probe":
            probe = torch.zeros_like(t, requires_grad=True)
            self.probes[layer] = (t.detach(), probe, lane)
            self.written.add(layer)
            return t + probe
        heads = self.selected.get(layer)
        if not heads:
            return None
        check_heads(layer, site.heads, heads, PatchingError)
        source = self.recorded.get(layer)
        if source is None:
            ran = ", ".join(self.recorded) or "none"
            raise PatchingError(
                f"layer {layer!r} computed no attention in the source run; the layers that "
                f"did: {ran}"
            )
        if source.shape != t.shape:
            raise PatchingError(
                f"layer {layer!r}: the source's {self.what} is {tuple(source.shape)}, this "
                f"run's {tuple(t.shape)}: patching needs inputs of the same shape"
            )
        if lane.heads != site.heads:  # key/value heads shared by groups of query heads
            heads = sorted({h // (site.heads // lane.heads) for h in heads})
        self.written.add(layer)
        chosen = lane.selection(t, heads, self.positions)
        return torch.where(chosen, source.to(t.dtype), t)

    def write_output(self, site: Site, output: torch.Tensor, lane: Lane) -> torch.Tensor:
        if self.what != "output":
            return output
        exchanged = self.exchange(site, output, lane)
        return output if exchanged is None else exchanged

    def _output(self, site, output, lane):
        return self.write_output(site, output, lane)

    # the watcher's hooks

    def attention(self, site: Site, func, args, kwargs):
        self.seen[site.layer] = site.heads
        if self.what == "output":
            return super().attention(site, func, args, kwargs)
        if site.via == "sdpa":
            return self._sdpa(site, func, args, kwargs)
        if site.via == "attnpanel":
            return self._bounded(site, func, args, kwargs)
        return self._mha(site, func, args, kwargs)

    def softmax(self, site: Site, func, args, kwargs):
        self.seen[site.layer] = site.heads
        result = func(*args, **kwargs)
        if self.what == "weights":
            lane = Lane.leading(result, site.lead, site.batch_hint)
            exchanged = self.exchange(site, result, lane)
            return result if exchanged is None else exchanged
        if self.what not in ("q", "k"):
            return result
        scores = site.scores
        q = scores.q.reshape(*site.lead, *scores.q.shape[-2:])  # (*lead, L, E)
        k = scores.k.reshape(*site.lead, *scores.k.shape[-2:])  # (*lead, S, E)
        given = q if self.what == "q" else k
        exchanged = self.exchange(site, given, Lane.leading(given, site.lead, site.batch_hint))
        if exchanged is None:
            return result
        if scores.unsupported:
            raise PatchingError(
                f"layer {site.layer!r}: its {self.what} cannot be patched exactly: "
                f"{scores.unsupported}"
            )
        q, k = (exchanged, k) if self.what == "q" else (q, exchanged)
        blocked, bias = scores.blocked, None
        if scores.bias is not None:
            extra, bias = split_bias(scores.bias)
            blocked = union(blocked, extra)
        blocked, bias = (as_lead(t, torch.Size(site.lead)) for t in (blocked, bias))
        weights = self._weights(q, k, scores.scale, blocked, bias).to(result.dtype)  # (*lead, L, S)
        return self._changed_heads(site, weights, result)

    def values(self, site: Site, product: ValuesProduct, func, args, kwargs):
        if self.what != "v":
            return super().values(site, product, func, args, kwargs)
        if product.v_lane is None:
            raise PatchingError(
                f"layer {site.layer!r}: its values are shared by every head (v broadcasts), "
                "so one head's v cannot be patched"
            )
        exchanged = self.exchange(site, product.v(args), product.v_lane)
        if exchanged is not None:
            args = (*args[: product.v_position], exchanged, *args[product.v_position + 1 :])
        return func(*args, **kwargs)

    # the fused calls

    def _sdpa(self, site: Site, func, args, kwargs):
        a = bind(SDPA_SIGNATURE, args, kwargs)
        if self.what == "weights":
            result = func(**a)
            q, k, v = sdpa_heads(a)
            blocked, bias = sdpa_mask(a, q.shape[-2], k.shape[-2])
            scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
            weights = self._weights(q, k, scale, blocked, bias)  # (*lead, L, S)
            lane = Lane.leading(weights, site.lead, site.batch_hint)
            exchanged = self.exchange(site, weights, lane)
            if exchanged is None:
                return result
            context = (exchanged @ v.float()).to(result.dtype)  # (*lead, L, E)
            return self._changed_heads(site, context, result)
        name = {"q": "query", "k": "key", "v": "value"}[self.what]
        given = a[name]
        lane = Lane.leading(given, given.shape[:-2], site.batch_hint)
        if lane.heads != site.heads and site.heads % max(lane.heads, 1):
            raise PatchingError(f"layer {site.layer!r}: {lane.heads} {name} heads for {site.heads}")
        exchanged = self.exchange(site, given, lane)
        if exchanged is not None:
            a[name] = exchanged
        return func(**a)

    def _bounded(self, site: Site, func, args, kwargs):
        if self.what == "weights":
            raise PatchingError(
                f"layer {site.layer!r}: attnpanel's bounded attention never forms its weights "
                "(it is for sequences too long to hold them): patch q, k, v or the output"
            )
        a = bind(BOUNDED_SIGNATURE, args, kwargs)
        given = a[self.what]
        exchanged = self.exchange(site, given, Lane.leading(given, site.lead, site.batch_hint))
        if exchanged is not None:
            a[self.what] = exchanged
        return func(**a)

    def _mha(self, site: Site, func, args, kwargs):
        run = HeadLanes.run(func, args, kwargs)
        a = bind(MHA_SIGNATURE, args, kwargs)
        if a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None:
            raise PatchingError(
                f"layer {site.layer!r}: add_bias_kv, add_zero_attn or static keys add keys "
                "beyond the input; its heads' q, k, v and weights cannot be patched"
            )
        found = MhaHeads.of(a)
        q, k, v = found.q, found.k, found.v  # (B, H, n, E)
        blocked, bias = found.masks()
        lane = Lane.leading(q, q.shape[:-2], None)
        if self.what == "weights":
            weights = self._weights(q, k, found.scale, blocked, bias)  # (B, H, L, S)
            exchanged = weights = self.exchange(site, weights, lane)
        else:
            given = {"q": q, "k": k, "v": v}[self.what]
            exchanged = self.exchange(site, given, lane)
            if exchanged is not None:
                q, k, v = {"q": (exchanged, k, v), "k": (q, exchanged, v), "v": (q, k, exchanged)}[
                    self.what
                ]
                weights = self._weights(q, k, found.scale, blocked, bias)
        if exchanged is None:
            return run.project(run.lanes)
        context = (weights @ v.float()).to(run.lanes.dtype)  # (B, H, L, E)
        lanes = context.permute(2, 0, 1, 3)  # (L, B, H, E)
        lanes = lanes[:, 0] if run.lanes.dim() == 3 else lanes
        changed = self._heads_mask(site, run.lanes, run.lane)
        output, returned = run.project(torch.where(changed, lanes, run.lanes))
        if returned is None:
            return output, None
        # the weights it returns (need_weights) are the patched heads' too; the others' are
        # its own, as returned
        heads = self._heads_mask(site, weights, lane)  # (B, H, 1, 1) or one for every head
        new = weights.detach()
        if not a["average_attn_weights"]:
            return output, torch.where(heads, new.reshape(returned.shape), returned)
        own = recompute(found.q, found.k, found.scale, blocked, bias)  # (B, H, L, S)
        change = torch.where(heads, new - own, 0.0).sum(dim=1) / own.shape[1]  # mean change
        return output, (returned + change.reshape(returned.shape)).to(returned.dtype)

    def _weights(self, q, k, scale, blocked, bias) -> torch.Tensor:
        """float32 weights from q, k, the scale and the mask truth: differentiable while
        probing (the probe's gradient must reach them), in one buffer otherwise."""
        if self.mode == "probe":
            return attend(q.float(), k.float(), blocked, scale, bias=bias)[1]
        return recompute(q, k, scale, blocked, bias)

    def _changed_heads(self, site: Site, computed: torch.Tensor, result: torch.Tensor):
        """``result`` with the heads this forward changes taken from ``computed`` (same
        layout, the attention's leading dims first)."""
        lane = Lane.leading(result, site.lead, site.batch_hint)
        return torch.where(self._heads_mask(site, result, lane), computed, result)

    def _heads_mask(self, site: Site, like: torch.Tensor, lane: Lane) -> torch.Tensor:
        if self.mode == "probe":
            return torch.ones((), dtype=torch.bool, device=like.device)
        return lane.selection(like, self.selected.get(site.layer, []))


@contextlib.contextmanager
def patch(
    model: nn.Module,
    source,
    heads: Mapping[str, int | list[int]],
    what: str = "output",
    positions: Sequence[int] | None = None,
) -> Iterator[HeadPatcher]:
    """Run ``model`` with the named heads' ``what`` taken from a run on ``source``.

    Parameters
    ----------
    model : torch.nn.Module
        Any model :func:`attnpanel.capture` can trace.
    source : tuple, dict or torch.Tensor
        The inputs of the run to take the heads from: positional inputs (a tuple), keyword
        inputs (a dict) or one tensor. Recorded once, on entry; its inputs must have the
        shape of those the block runs on.
    heads : mapping of str to int or list of int
        Layer names, as a capture's ``layer`` coordinate names them, to head indices.
    what : {"output", "q", "k", "v", "weights"}
        The head's lane of the attention output (its ``weights @ v``, before the merge and
        the output projection), its queries, keys, values or attention weights.
    positions : sequence of int, optional
        Patch only these query positions (``output``, ``q``, ``weights``) or key positions
        (``k``, ``v``).

    Yields
    ------
    HeadPatcher

    Raises
    ------
    PatchingError
        A layer that is no module of the model, a head it lacks, a source of another shape,
        a ``what`` the call cannot expose; on exit, a layer asked for that computed no
        attention inside the block, or whose ``what`` was not found: never a silent no-op.

    Examples
    --------
    >>> with attnpanel.patch(model, (clean,), heads={"layers.1.attn": [3]}):  # doctest: +SKIP
    ...     y = model(corrupted)
    """
    asked = heads_asked(heads)
    check_layers(model, asked, PatchingError)
    args, kwargs = inputs_of(source)
    patcher = HeadPatcher(model, what, positions)
    patcher.record(*args, **kwargs)
    patcher.select(asked, positions)
    with patcher.watching():
        yield patcher
    check_written(patcher, asked, "patch", PatchingError)


def score_of(y: torch.Tensor, score: Callable | None) -> float:
    """``score(y)`` as a float (default ``||y||`` in float64), refused unless a scalar."""
    value = score(y) if score is not None else torch.linalg.vector_norm(y.double())
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise PatchingError("score(y) must return a scalar (a number or a one-element tensor)")
        return float(value.detach())
    return float(value)


ROUNDING_ULPS = 8  # a score difference within this many ulps of the output's dtype is noise


def score_difference(
    source_score: float, target_score: float, dtype: torch.dtype = torch.float32
) -> float:
    """``source - target``, refused where there is no difference for heads to carry: none,
    or one within the rounding of the model's output (``dtype``) at the score's size, of
    which every share would be noise (the norm of a LayerNorm's output, for one, is the
    same for every input)."""
    difference = source_score - target_score
    size = max(abs(source_score), abs(target_score))
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    if not math.isfinite(difference) or abs(difference) <= ROUNDING_ULPS * eps * size:
        within = (
            "" if difference == 0 else f", a difference within the {dtype} rounding of the score"
        )
        raise PatchingError(
            f"the score is {source_score!r} on the source and {target_score!r} on the "
            f"target{within}: there is no difference for the heads to carry (pick a score "
            "that the corruption changes)"
        )
    return difference

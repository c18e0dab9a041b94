"""Why a head's query attends to a key: the cell's score split over the input's channels
and positions, through the query and through the key, by integrated gradients.

For a head ``h`` of a layer, a query ``i`` and a key ``j``, the score is the number the
model's softmax reads at that cell, ``s = q_i . k_j * scale + bias`` (before the softmax;
a bias does not depend on the input). Integrated gradients (Sundararajan et al. 2017) from
a baseline input ``b`` to the input ``x`` give each input element ``e`` the share

    A_e = (x_e - b_e) * mean over the path of d s / d x_e,    x(t) = b + t (x - b)

(the path sampled at ``steps`` midpoints), and the shares add up to ``s(x) - s(b)``
(completeness; the error left by the steps is reported, and more steps shrink it as
``1 / steps^2``). The gradient is taken apart where the score is made:
``d s / d x = (d s / d q_i) (d q_i / d x) + (d s / d k_j) (d k_j / d x)``: the first term
is the query side, the second the key side; the two sides add up to the whole.

The forward stops at the layer (nothing after it runs) and the path's steps run as one
batch, in chunks of :data:`CHUNK` steps. The model is watched as a capture watches it
(:mod:`attnpanel.watching`): a softmax path (its q, k, scale and mask followed from the
``q . k`` product) or SDPA; ``nn.MultiheadAttention``'s fused function is refused by name.

Reference: M. Sundararajan, A. Taly, Q. Yan, "Axiomatic Attribution for Deep Networks",
ICML 2017.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.modes import evaluating
from attnpanel.interventions.importance import probing
from attnpanel.kernels.masks import BLOCKING_BIAS
from attnpanel.watching.lanes import split_lead
from attnpanel.watching.linear import NORMALISER
from attnpanel.watching.watcher import SDPA_SIGNATURE, AttentionWatcher, Site, bind

# what an attribution explains: a cell, a row (key None), the map (query and key None)
TARGETS = (
    "the cell's score",
    "the row's scores weighted by its weights",
    "the map's scores weighted by its weights",
)
ATTRIBUTED = ("score", "weight")  # what of a cell score_attribution explains (``of=``)
STEPS = 64  # midpoints of the path from the baseline to the input
CHUNK = 16  # steps run as one batch
SIDES = ("query", "key")


@dataclass(frozen=True)
class Cell:
    """One cell of one head's map on one sample: what a score attribution explains."""

    sample: int
    layer: str
    head: int
    query: int
    key: int


class AttributionError(ValueError):
    """A score attribution asked of something the model does not have or does not use."""


class _Reached(Exception):
    """The forward reached the cell's layer: nothing after it is needed."""


class CellProbe(AttentionWatcher):
    """Reads one cell's score (and its q and k) at one layer, and stops the forward there.

    Attributes
    ----------
    layers : dict of str to int
        The layers met before it (and it), with their head counts.
    found : tuple or None
        ``(scores, q_i, k_j, scale)`` of the last forward: the scores of the cells asked per
        batch row ``(batch, R, C)`` (the model's own, with its bias), the queries' q and the
        keys' k (``(batch, R, E)``, ``(batch, C, E)``, in the graph of the input) and the
        scale of their product. ``R`` and ``C`` are 1 for a cell; a row has every key, the
        map (``query`` None) every query too.
    """

    def __init__(self, layer: str, head: int, query: int | None, key: int | None):
        super().__init__()
        self.layer, self.head, self.query, self.key = layer, head, query, key
        self.layers: dict[str, int] = {}
        self.found = None
        self.normaliser = "softmax"  # how the layer's rows become weights ("row sum": linear)
        self.shape = None  # (L, S) of the layer's map
        self.rows, self.cols = _span(query), _span(key)  # the cells asked, as slices

    def _check(self, site: Site, shape) -> tuple[int, int] | None:
        """``(B, H)`` of the cell's layer (its map ``shape``, ``(L, S)``, checked), or None
        for another layer."""
        self.layers[site.layer] = site.heads
        if site.layer != self.layer:
            return None
        batch, heads = split_lead(site.lead, site.batch_hint)
        if not 0 <= self.head < heads:
            raise AttributionError(f"layer {site.layer} has {heads} heads, not head {self.head}")
        for name, value, size in (("query", self.query, shape[0]), ("key", self.key, shape[1])):
            if value is not None and not 0 <= value < size:  # (no key: the query's row)
                raise AttributionError(
                    f"{name} {value} is outside the map of layer {site.layer}: 0 to {size - 1}"
                )
        return batch, heads

    def _reach(self, lead: tuple[int, int], q, k, scale: float, cells) -> None:
        """Keep the cell's score (``cells``: its logit per leading index) and the query's
        and key's vectors (``q``, ``k`` as ``(*lead, L, E)``, ``(*lead, S, E)``; a softmax
        path's are views of its product's operands: in the graph through those); stop."""
        batch, heads = lead
        pick = (slice(None), self.head)
        q_i = q.reshape(batch, heads, *q.shape[-2:])[pick][:, self.rows]  # (B, R, E)
        k_j = k.reshape(batch, heads, *k.shape[-2:])[pick][:, self.cols]  # (B, C, E)
        cells = cells.reshape(batch, heads, *cells.shape[-2:])[pick].detach()  # (B, R, C)
        self.found = (cells, q_i, k_j, scale)
        raise _Reached

    def linear(self, site: Site, form, result):
        """A linear attention's cell: its score is ``phi(q_i) . phi(k_j)`` (no scale, no
        bias), its weights each row over its sum."""
        lead = self._check(site, form.weights.shape[-2:])
        if lead is not None:
            cells = form.q[..., self.rows, :] @ form.k[..., self.cols, :].transpose(-2, -1)
            self.normaliser = NORMALISER
            self._reach(lead, form.q, form.k, 1.0, cells)
        return result

    def softmax(self, site: Site, func, args, kwargs):
        result = func(*args, **kwargs)
        scores = site.scores
        if scores is not None and not scores.unsupported:
            logits = args[0] if args else kwargs["input"]
            lead = self._check(site, logits.shape[-2:])
            if lead is not None:
                cells = logits[..., self.rows, self.cols]  # (*lead, R, C)
                self._reach(lead, scores.q, scores.k, scores.scale, cells)
        return result

    def attention(self, site: Site, func, args, kwargs):
        if site.via == "sdpa":
            a = bind(SDPA_SIGNATURE, args, kwargs)
            q, k = a["query"], a["key"]
            lead = self._check(site, (q.shape[-2], k.shape[-2]))
            if lead is not None:
                if q.dim() == 4 and k.shape[-3] != q.shape[-3]:  # grouped: k per q head
                    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
                scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
                i, j = self.rows, self.cols
                cells = (q[..., i, :] @ k[..., j, :].transpose(-2, -1)) * scale  # (*lead, R, C)
                mask = a["attn_mask"]
                if mask is not None:
                    cell = mask[..., i, j]  # a bool mask keeps True, a float one adds
                    if mask.dtype == torch.bool:
                        cells = cells.masked_fill(~cell, -math.inf)
                    else:
                        cells = cells + cell
                if a["is_causal"]:
                    rows = torch.arange(q.shape[-2], device=cells.device)[i]
                    later = torch.arange(k.shape[-2], device=cells.device)[j] > rows[:, None]
                    cells = cells.masked_fill(later, -math.inf)
                cells = torch.broadcast_to(cells, (*lead, *cells.shape[-2:]))
                self._reach(lead, q, k, scale, cells)
        elif site.via == "multi_head_attention_forward":
            self.layers[site.layer] = site.heads
            if site.layer == self.layer:
                raise AttributionError(
                    f"layer {site.layer} runs nn.MultiheadAttention's fused function: its "
                    "q and k are not reachable there yet (score attribution is not built for it)"
                )
        return func(*args, **kwargs)


def score_attribution(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    layer: str,
    head: int,
    query: int | None,
    key: int | None,
    sample: int = 0,
    baseline: str | Sequence[torch.Tensor] | torch.Tensor = "zeros",
    steps: int = STEPS,
    channels: Sequence[str] | None = None,
    position_dim: int | None = None,
    of: str = "score",
) -> xr.DataArray:
    """Split one cell's score (or weight) over the input's channels and positions, query
    side and key side apart (integrated gradients; see the module's docstring).

    Parameters
    ----------
    model : torch.nn.Module
        Any model, called as ``model(*inputs)`` (``model(**inputs)`` for a mapping).
    inputs : torch.Tensor, sequence of torch.Tensor or mapping of str to torch.Tensor
        Its inputs, batch first: positional, or by keyword (a tokenizer's output). Every
        floating-point one is attributed (its channels in order: a ``(batch, position)``
        input is one channel); the others (a mask) are passed as they are. Where none is
        (token ids), the output of the first ``nn.Embedding`` the model calls is
        attributed instead (``attributed_at``).
    layer, head, query, key : str, int
        The cell: a layer as a capture names it, a head, a query and a key of its map.
        ``key=None``: the query's whole row, as one number: its scores weighted by the
        model's own weights at the input, held fixed along the path (``sum_j w_ij s_ij``,
        the score the query's attention sees on average); one backward per step, as a
        cell, not one per key. ``query=None`` and ``key=None``: the whole map, as one
        number, ``sum_ij w_ij s_ij`` (the same held weights), again one backward per step.
    sample : int
        The batch row attributed.
    baseline : "zeros", "mean", or tensors
        Where the path starts: zeros, each input's mean over its positions (per channel),
        or inputs of the sample's shapes, one per attributed input (a corrupted window).
    steps : int
        Midpoints of the path; the completeness error falls as ``1 / steps^2``.
    channels : sequence of str, optional
        The channels' names (default ``channel 0`` ...), every attributed input's in order.
    position_dim : int, optional
        The dim that runs over positions in every attributed input (default: the size
        they share, or a lone input's longest dim after the batch).
    of : {"score", "weight"}
        What of the cell is explained: its score, or its weight (after the softmax, or a
        linear attention's row sum). A weight depends on the query's whole row: its key
        side gathers what reaches it through every key.

    Returns
    -------
    xarray.DataArray
        ``(side, channel, position)``: each element's share of ``s(x) - s(baseline)``,
        through the query (``side="query"``) and through the key. Attrs: the cell, the
        ``score`` and ``baseline_score``, ``steps`` and ``completeness_error`` (the sum of
        the shares less the score's change).

    Raises
    ------
    AttributionError
        A layer, head, query or key the model does not have; a blocked cell (its score is
        not used); integer inputs with no embedding before the layer; a baseline of
        another shape.
    """
    if of not in ATTRIBUTED:
        raise AttributionError(f"of={of!r}: a cell's {' or '.join(ATTRIBUTED)} is explained")
    if of == "weight" and (query is None or key is None):
        raise AttributionError("of='weight' explains one cell's weight: give a query and a key")
    if query is None and key is not None:
        raise AttributionError(
            f"key {key} without a query: give a query (a cell, or key=None for its row), or "
            "neither (the whole map)"
        )
    names, ones = one_sample(inputs, sample)
    attributed = [i for i, t in enumerate(ones) if torch.is_floating_point(t)]
    probe = CellProbe(layer, head, query, None if of == "weight" else key)  # (a weight: its row)
    with evaluating(model), probing(model):
        # token ids are not differentiable: the path runs through the first embedding's
        # output instead (the tokens' vectors), and the result says so
        path = (
            Path(model, probe, ones, attributed, names)
            if attributed
            else Path.embedded(model, probe, ones, names)
        )
        ends = path.ends()
        dims = _position_dims(ends, 1 if path.at else position_dim)
        starts = _baselines(ends, baseline, dims)
        path.weight_of = key if of == "weight" else None
        if key is None:  # a row or the map: its scores weighted by the model's weights
            path.hold_weights(ends)
        at_input = path.score(ends)
        at_baseline = path.score(starts)
        if is_blocked(at_input) or is_blocked(at_baseline):
            raise blocked_cell(layer, head, query, key)
        sides = path.integrated(starts, steps)
    shares = [
        torch.stack([side[n] for side in sides])[:, 0] * (end - start)[0]
        for n, (end, start) in enumerate(zip(ends, starts, strict=True))
    ]  # per input: (side, *its sample dims)
    if path.at and channels is None:
        channels = [f"dim {d}" for d in range(ends[0].shape[-1])]
    found = _as_array(shares, dims, channels)
    total = float(at_input - at_baseline)
    return found.assign_attrs(
        layer=layer, head=head, query=-1 if query is None else query,
        key=-1 if key is None else key, sample=sample,
        target="the cell's weight" if of == "weight" else TARGETS[(query is None) + (key is None)],
        explains=of,
        score=float(at_input), baseline_score=float(at_baseline), steps=steps,
        completeness_error=float(found.sum()) - total,
        baseline=baseline if isinstance(baseline, str) else "given",
        method="integrated gradients", normaliser=probe.normaliser,
        attributed_at=f"the output of {path.at}" if path.at else "the model's inputs",
    )  # fmt: skip


def explain_cell(
    method, model: nn.Module, args: tuple, kwargs: dict, cell: Cell, **options
) -> xr.DataArray:
    """``method`` (:func:`score_attribution` or
    :func:`~attnpanel.interventions.components.component_attribution`) of ``cell`` on the
    one sample ``model(*args, **kwargs)`` runs (the batch cut to it: its ``sample`` is the
    cell's); ``options`` are the method's own."""
    if args and kwargs:
        raise AttributionError(
            "the model takes inputs by position and by keyword at once: call "
            f"attnpanel.{method.__name__} with a wrapper that takes one kind"
        )
    found = method(
        model, args or kwargs, layer=cell.layer, head=cell.head, query=cell.query,
        key=cell.key, **options,
    )  # fmt: skip
    return found.assign_attrs(sample=cell.sample)


def one_sample(inputs, sample: int) -> tuple[list[str] | None, list[torch.Tensor]]:
    """The inputs' keywords (None: positional) and each input cut to batch row ``sample``
    (a tensor, a sequence or a mapping of them, batch first)."""
    names = list(inputs) if isinstance(inputs, Mapping) else None  # keyword inputs
    if names is not None:
        given = tuple(inputs.values())
    else:
        given = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    batch = given[0].shape[0]
    if not 0 <= sample < batch:
        raise AttributionError(f"sample {sample} is outside the batch: 0 to {batch - 1}")
    return names, [t[sample : sample + 1].detach() for t in given]


def blocked_cell(layer: str, head: int, query: int, key: int | None) -> AttributionError:
    """The error of a cell whose score the model does not use."""
    return AttributionError(
        f"cell (query {query}, key {key}) of head {head}, layer {layer} is blocked by the "
        "mask: its score is not used"
    )


def _span(index: int | None) -> slice:
    """The cells asked along one side of the map: one (a slice of 1), or all (None)."""
    return slice(None) if index is None else slice(index, index + 1)


def is_blocked(score: torch.Tensor) -> bool:
    return bool(not torch.isfinite(score) or score <= BLOCKING_BIAS)


class Path:
    """The model run at points between a baseline and the input (attributed inputs
    interpolated, the others as given), up to the cell's layer."""

    def __init__(self, model: nn.Module, probe: CellProbe, ones: list, attributed: list[int],
                 names: list[str] | None = None):  # fmt: skip
        self.model, self.probe, self.ones, self.attributed = model, probe, ones, attributed
        self.names = names  # the inputs' keywords (None: positional)
        self.seen = False  # whether a forward reached the layer (its modules are known)
        self.at = ""  # the embedding whose output is attributed ("": the inputs)
        self.embedding: nn.Module | None = None
        self.embedded: torch.Tensor | None = None  # its output on the sample
        self.weights: torch.Tensor | None = None  # a whole row's: its scores' weights
        self.weight_of: int | None = None  # the key whose weight is explained (None: scores)

    @classmethod
    def embedded(cls, model: nn.Module, probe: CellProbe, ones: list, names=None) -> Path:
        """A path through the output of the first ``nn.Embedding`` the model calls (its
        inputs are token ids)."""
        path = cls(model, probe, ones, [], names)
        first: list = []

        thread = threading.get_ident()  # another thread's forward of a shared model: untouched

        def seen(module, args, output):
            if not first and threading.get_ident() == thread:
                first.append((module, output.detach()))

        hooks = [m.register_forward_hook(seen) for m in model.modules()
                 if isinstance(m, nn.Embedding)]  # fmt: skip
        failed = None
        try:
            with torch.no_grad():
                path.run([])
        except AttributionError:
            raise
        except Exception as err:  # noqa: BLE001 - said below, with what the model said
            failed = err
        finally:
            for hook in hooks:
                hook.remove()
        if not first:
            why = f" ({type(failed).__name__}: {failed})" if failed is not None else ""
            raise AttributionError(
                "no input is floating point and the model calls no nn.Embedding before the "
                f"layer: nothing differentiable to attribute to{why}"
            ) from failed
        if failed is not None:
            raise failed
        path.embedding, path.embedded = first[0]
        path.at = next(name for name, m in model.named_modules() if m is path.embedding)
        return path

    def ends(self) -> list[torch.Tensor]:
        """What the path ends at: the attributed inputs, or the embedding's output."""
        if self.embedding is not None:
            return [self.embedded]
        return [self.ones[i] for i in self.attributed]

    def run(self, points: list[torch.Tensor]) -> None:
        """One forward of ``points`` (a batch of each attributed input, or of the
        embedding's output) to the layer."""
        rows = points[0].shape[0] if points else 1
        args = [t.expand(rows, *t.shape[1:]) for t in self.ones]
        for n, i in enumerate(self.attributed):
            args[i] = points[n]
        swap = None
        if self.embedding is not None and points:  # the embedding gives the points instead
            thread = threading.get_ident()  # (this forward's, not another thread's)
            swap = self.embedding.register_forward_hook(
                lambda m, a, out: points[0] if threading.get_ident() == thread else None
            )
        try:
            self._forward(args)
        finally:
            if swap is not None:
                swap.remove()

    def _forward(self, args: list) -> None:
        probe = self.probe
        probe.found = None
        # after the first forward, only the modules that ran attention are watched (a mode
        # on every torch call of the rest made a forward 4x slower)
        narrowed = (probe.attention_modules(), probe.attention_scope()) if self.seen else ()
        try:
            with probe.watching(self.model, *narrowed):
                if self.names is None:
                    self.model(*args)
                else:
                    self.model(**dict(zip(self.names, args, strict=True)))
        except _Reached:
            self.seen = True
            return
        seen = ", ".join(probe.layers) or "none"
        raise AttributionError(f"layer {probe.layer} computed no attention (layers met: {seen})")

    def score(self, points: list[torch.Tensor]) -> torch.Tensor:
        """The model's own score of the cell at ``points`` (one row); of a whole row, its
        scores weighted by :attr:`weights` (the model's own at the input, held)."""
        with torch.no_grad():
            self.run(points)
        cells = self.probe.found[0][0]  # (R, C)
        if self.weight_of is not None:  # a cell's weight: its row's cells normalised
            j = self.weight_of
            return (
                self._normalised(cells.double())[0, j]
                if not is_blocked(cells[0, j])
                else cells[0, j]
            )
        if self.weights is None:
            return cells[0, 0]
        kept = self.weights > 0
        return (self.weights[kept] * cells.double()[kept]).sum()

    def hold_weights(self, points: list[torch.Tensor]) -> None:
        """Hold the rows' weights at ``points`` (the input): the softmax of their scores
        (``(R, S)``: a row, or every row of the map)."""
        with torch.no_grad():
            self.run(points)
        self.weights = self._normalised(self.probe.found[0][0].double())

    def _normalised(self, cells: torch.Tensor) -> torch.Tensor:
        """The weights of rows of cells: their softmax, or (a linear attention's) each
        product over its row's sum."""
        if self.probe.normaliser == "softmax":
            return torch.softmax(cells, -1)
        return cells / cells.sum(-1, keepdim=True)

    def _coefficients(self, cells: torch.Tensor, k_j: torch.Tensor) -> torch.Tensor:
        """``d target / d s_ij`` for each cell asked, ``(n, R, C)`` at the ``n`` points:
        1 for a cell's score, the held weights for a row's or the map's; for a weight
        ``w_j`` of the row, ``w_j (1[k = j] - w_k)`` (softmax) or ``(1[k = j] - w_j) / sum``
        (row sum), at each point's own weights."""
        n, rows, cols = cells.shape
        if self.weight_of is None:
            held = self.weights if self.weights is not None else torch.ones(rows, cols)
            return held.to(k_j).expand(n, rows, cols)
        cells = cells.double()
        w = self._normalised(cells)
        chosen = torch.zeros_like(w)
        chosen[..., self.weight_of] = 1.0
        j = slice(self.weight_of, self.weight_of + 1)
        if self.probe.normaliser == "softmax":
            return (w[..., j] * (chosen - w)).to(k_j)
        return ((chosen - w[..., j]) / cells.sum(-1, keepdim=True)).to(k_j)

    def integrated(self, starts: list[torch.Tensor], steps: int) -> list[list[torch.Tensor]]:
        """The mean gradient along the path, ``[query side, key side]``, each a list over
        the attributed inputs shaped as they are."""
        ends = self.ends()
        sums = [[torch.zeros_like(t) for t in ends] for _ in SIDES]
        alphas = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
        for chunk in alphas.split(CHUNK):
            points = [
                (a + chunk.to(a).view(-1, *[1] * (a.dim() - 1)) * (b - a)).requires_grad_(True)
                for a, b in zip(starts, ends, strict=True)
            ]
            self.run(points)
            cells, q_i, k_j, scale = self.probe.found  # (n, R, C), (n, R, E), (n, C, E)
            # t = f(s), s_ij = q_i . k_j * scale: d t / d q_i = sum_j g_ij k_j * scale and
            # d t / d k_j = sum_i g_ij q_i * scale, g = d t / d s; one backward a side
            g = self._coefficients(cells, k_j)
            into_q = torch.einsum("nrc,nce->nre", g, k_j.detach()) * scale
            into_k = torch.einsum("nrc,nre->nce", g, q_i.detach()) * scale
            query_side = torch.autograd.grad(q_i, points, into_q, retain_graph=True)
            key_side = torch.autograd.grad(k_j, points, into_k, allow_unused=True)
            for found, side in zip((query_side, key_side), sums, strict=True):
                for n, grad in enumerate(found):
                    if grad is not None:
                        side[n] += grad.sum(0, keepdim=True)
        return [[total / steps for total in side] for side in sums]


def _position_dims(ones: list[torch.Tensor], position_dim: int | None) -> list[int]:
    """Each attributed input's position dim."""
    if position_dim is not None:
        return [position_dim % t.dim() for t in ones]
    if len(ones) == 1:
        return [1 + int(np.argmax(ones[0].shape[1:]))]
    shared = set.intersection(*(set(t.shape[1:]) for t in ones))
    if len(shared) != 1:
        raise AttributionError(
            "the inputs share no one length of positions: say which dim runs over them "
            "(position_dim=)"
        )
    length = shared.pop()
    return [1 + list(t.shape[1:]).index(length) for t in ones]


def _baselines(ones: list[torch.Tensor], baseline, dims: list[int]) -> list[torch.Tensor]:
    if isinstance(baseline, str):
        if baseline == "zeros":
            return [torch.zeros_like(t) for t in ones]
        if baseline == "mean":
            return [
                t.mean(dim=d, keepdim=True).expand_as(t) for t, d in zip(ones, dims, strict=True)
            ]
        raise AttributionError(f"baseline {baseline!r}: 'zeros', 'mean' or tensors")
    given = [baseline] if isinstance(baseline, torch.Tensor) else list(baseline)
    if len(given) != len(ones):
        raise AttributionError(f"{len(given)} baselines for {len(ones)} attributed inputs")
    found = []
    for t, b in zip(ones, given, strict=True):
        b = b.to(t).reshape(-1, *b.shape[-(t.dim() - 1) :]) if b.dim() >= t.dim() - 1 else b
        if tuple(b.shape[1:]) != tuple(t.shape[1:]):
            raise AttributionError(
                f"a baseline of shape {tuple(b.shape)} for an input of {tuple(t.shape[1:])} "
                "per sample"
            )
        found.append(b[:1])
    return found


def _as_array(shares: list[torch.Tensor], dims: list[int], channels) -> xr.DataArray:
    """``(side, channel, position)`` of each input's shares ``(side, *its sample dims)``."""
    parts = []
    for values, dim in zip(shares, dims, strict=True):
        values = values.detach().cpu().double()
        if values.dim() == 2:  # (side, position): one channel
            values = values[:, None, :]
        elif values.dim() == 3:
            values = values if dim == 2 else values.transpose(1, 2)
        else:
            raise AttributionError(f"an input of {values.dim() - 1} dims per sample: 1 or 2")
        parts.append(values)
    values = torch.cat(parts, dim=1)
    n_channels, n_positions = values.shape[1:]
    names = list(channels) if channels is not None else [f"channel {c}" for c in range(n_channels)]
    if len(names) != n_channels:
        raise AttributionError(f"{len(names)} channel names for {n_channels} channels")
    return xr.DataArray(
        values.numpy(),
        dims=("side", "channel", "position"),
        coords={"side": list(SIDES), "channel": names, "position": np.arange(n_positions)},
        name="score_attribution",
    )

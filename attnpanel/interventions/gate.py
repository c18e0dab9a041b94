"""Switch attention heads off inside a real model, at the sites the watcher finds.

:func:`ablate` is a context manager: inside it the model runs with the given heads switched
off, found the way :func:`attnpanel.capture` finds attention, by the same
:class:`~attnpanel.watching.watcher.AttentionWatcher` (no adapter, no rewritten model):
``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``, attnpanel's own
bounded attention and every ``softmax`` over a ``q . k`` product followed to its
``weights @ v``. The head's lane of that attention output (its ``weights @ v``, before the
heads are merged and projected) is multiplied by a gate: 0 switches the head off
(``how="zero"``); with ``how="mean"`` the lane is replaced by its mean over the query
positions. The other heads' lanes are multiplied by exactly 1, so they are bit-identical.

Layers are named as a capture's ``layer`` coordinate names them (one rule,
:meth:`~attnpanel.watching.modules.ModuleStack.name_call`). A layer asked for that computed
no attention, or whose head lanes were not found, is an error: never a silent no-op.

The same gates, kept at 1 and made to require gradients, give Michel et al.'s (2019)
head-importance estimate in one backward pass (:mod:`attnpanel.interventions.importance`).

Shapes use ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys and ``E`` head dim.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from attnpanel.watching.lanes import Lane
from attnpanel.watching.linear import LinearForm
from attnpanel.watching.modules import module_names, own_name
from attnpanel.watching.watcher import AttentionWatcher, HeadLanes, Site, ValuesProduct

HOWS = ("zero", "mean")
_INDEXED = re.compile(r"^(.*)\[(\d+)\]$")


class AblationError(ValueError):
    """A layer or head that the model does not have, or an attention whose heads cannot be
    switched off."""


def check_how(how: str) -> None:
    """Raise :class:`AblationError` unless ``how`` is a way to switch a head off."""
    if how not in HOWS:
        raise AblationError(f"how={how!r}: a head is switched off by one of {HOWS}")


class HeadWriter(AttentionWatcher):
    """A watcher that may change each head's lane of every attention output it finds.

    Subclasses say what with :meth:`write_output`; the sites' lanes are found here once
    for every kind of call.

    Attributes
    ----------
    seen : dict of str to int
        Every layer that computed attention while watched, with its head count.
    written : set of str
        The layers whose head lanes were found (and handed to :meth:`write_output`).
    only, scope : set of str or None
        The modules hooked, and those whose calls are watched (None: every one); see
        :meth:`follow`.
    """

    names_only = True  # its module hooks name layers and nothing else

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.seen: dict[str, int] = {}
        self.written: set[str] = set()
        self.only: set[str] | None = None  # the modules to hook (None: every one)
        self.scope: set[str] | None = None  # the modules to watch the calls of (None: all)

    def follow(self, found: AttentionWatcher) -> HeadWriter:
        """Hook and watch only what ``found``'s forwards ran their attention in: enough for
        later forwards of the same model on inputs of the same kind, and cheaper (the rest
        of the model runs outside the mode)."""
        return self.narrow(found.attention_modules(), found.attention_scope())

    def narrow(self, only, scope) -> HeadWriter:
        """Hook only the modules ``only`` names, and watch the calls of ``scope`` (None:
        every module, every call)."""
        self.only, self.scope = only, scope
        return self

    @contextlib.contextmanager
    def watching(self, model: nn.Module | None = None) -> Iterator[HeadWriter]:
        with super().watching(self.model if model is None else model, self.only, self.scope):
            yield self

    def write_output(self, site: Site, output: torch.Tensor, lane: Lane) -> torch.Tensor:
        """The heads' output (their ``weights @ v`` lanes) the model goes on with."""
        return output

    def _output(self, site: Site, output: torch.Tensor, lane: Lane) -> torch.Tensor:
        self.written.add(site.layer)
        return self.write_output(site, output, lane)

    # the watcher's hooks

    def attention(self, site: Site, func, args, kwargs):
        self.seen[site.layer] = site.heads
        if site.via == "multi_head_attention_forward":
            run = HeadLanes.run(func, args, kwargs)
            return run.project(self._output(site, run.lanes, run.lane))
        result = func(*args, **kwargs)
        context = result[0] if site.via == "attnpanel" else result  # (*lead, L, E)
        lane = Lane.leading(context, site.lead, site.batch_hint)
        written = self._output(site, context, lane)
        return (written, result[1]) if site.via == "attnpanel" else written

    def softmax(self, site: Site, func, args, kwargs):
        self.seen[site.layer] = site.heads
        return func(*args, **kwargs)

    def values(self, site: Site, product: ValuesProduct, func, args, kwargs):
        return self._output(site, func(*args, **kwargs), product.output_lane)

    def linear(self, site: Site, form: LinearForm, result):
        self.seen[site.layer] = site.heads
        context = form.canonical(result)  # (*lead, L, E): the heads' lanes
        lane = Lane.leading(context, site.lead, site.batch_hint)
        return form.restore(self._output(site, context, lane))


class HeadGate(HeadWriter):
    """Multiply each head's lane of the attention output by a gate, in any model.

    Parameters
    ----------
    model : torch.nn.Module
        The model whose modules name the layers.
    off : mapping of str to list of int, optional
        The heads to switch off, by layer name.
    how : {"zero", "mean"}
        A switched-off lane becomes 0, or its mean over the query positions.
    gradient : bool
        Gate every head of every layer with a 1 that requires gradients (:attr:`gates`),
        for the gradient estimate of head importance.

    Attributes
    ----------
    gates : dict of str to torch.Tensor
        With ``gradient``: each layer's ``(H,)`` gates of the last forward.
    """

    def __init__(
        self,
        model: nn.Module,
        off: Mapping[str, list[int]] | None = None,
        how: str = "zero",
        gradient: bool = False,
    ):
        super().__init__(model)
        check_how(how)
        self.how, self.gradient = how, gradient
        self.off = {} if off is None else dict(off)
        self.gates: dict[str, torch.Tensor] = {}

    @property
    def gated(self) -> set[str]:
        """The layers whose head lanes were found."""
        return self.written

    def _gate(self, layer: str, heads: int, like: torch.Tensor) -> torch.Tensor | None:
        """The layer's ``(H,)`` gate, or None when every head stays as it is."""
        if self.gradient:
            gate = torch.ones(heads, device=like.device, requires_grad=True)
            self.gates[layer] = gate
            return gate
        off = self.off.get(layer)
        if not off:
            return None
        check_heads(layer, heads, off)
        gate = torch.ones(heads, device=like.device)
        gate[list(off)] = 0.0
        return gate

    def write_output(self, site: Site, output: torch.Tensor, lane: Lane) -> torch.Tensor:
        gate = self._gate(site.layer, site.heads, output)
        return output if gate is None else self.apply_gate(site.layer, gate, output, lane)

    def apply_gate(self, layer: str, gate: torch.Tensor, output: torch.Tensor, lane: Lane):
        """``output`` with each head's lane times its gate (or, for ``how="mean"``, moved
        towards its mean over the queries by ``1 - gate``)."""
        full = lane.per_head(gate.to(output.dtype), output)
        if self.how == "zero":
            return output * full
        mean = output.mean(dim=lane.position_axis, keepdim=True)
        return output * full + (1 - full) * mean


def check_heads(layer: str, heads: int, asked, error=AblationError) -> None:
    """Raise ``error`` for a head index the layer does not have."""
    wrong = [h for h in asked if not 0 <= h < heads]
    if wrong:
        raise error(
            f"layer {layer!r} has {heads} heads (0 to {heads - 1}); there is no head "
            f"{', '.join(map(str, wrong))}"
        )


def heads_asked(heads: Mapping[str, int | list[int]]) -> dict[str, list[int]]:
    """``{layer: [head, ...]}`` of a user's mapping, refused by name where it is not one."""
    if not isinstance(heads, Mapping):
        raise AblationError(
            f"heads must map layer names to head indices, such as {{'layers.0.attn': [3]}}; "
            f"got {type(heads).__name__}"
        )
    asked = {}
    for layer, found in heads.items():
        found = [found] if isinstance(found, int) else list(found)
        if not all(isinstance(h, int) and not isinstance(h, bool) for h in found):
            raise AblationError(f"layer {layer!r}: heads are integers, got {found!r}")
        asked[str(layer)] = found
    return asked


def check_layers(model: nn.Module, layers, error=AblationError) -> None:
    """Every asked layer names a module of the model (or the model itself)."""
    modules = module_names(model)
    root = type(model).__name__
    for layer in layers:
        match = _INDEXED.match(layer)
        base = match.group(1) if match else layer
        if own_name(base) != base:
            raise error(
                f"layer {layer!r} is named {own_name(layer)!r}: a wrapped module takes its "
                "wrapper's name (as capture and attention_heads name it)"
            )
        if base in modules or base == root:
            continue
        looks = [
            name
            for name, module in model.named_modules()
            if name and re.search("attn|attention", type(module).__name__ + name, flags=re.I)
        ]
        hint = f"; its attention-like modules: {', '.join(looks[:12])}" if looks else ""
        raise error(f"{root} has no layer {layer!r}{hint}")


def check_written(
    writer: HeadWriter, asked: Mapping[str, list[int]], what: str, error=AblationError
) -> None:
    """Every asked layer computed attention and had its head lanes found, else ``error``
    naming the layers that did: an intervention that touched nothing is never silent."""
    ran = ", ".join(f"{name} ({heads} heads)" for name, heads in writer.seen.items()) or "none"
    for layer, heads in asked.items():
        if layer not in writer.seen:
            raise error(
                f"layer {layer!r} computed no attention inside {what}(); the layers that did: {ran}"
            )
        if heads and layer not in writer.written:
            raise error(
                f"layer {layer!r}: its attention ran, but the heads' lanes of its output "
                f"(weights @ v) were not found, so {what}() changed nothing"
            )


@contextlib.contextmanager
def ablate(
    model: nn.Module, heads: Mapping[str, int | list[int]], how: str = "zero"
) -> Iterator[HeadGate]:
    """Run ``model`` with the given attention heads switched off, inside a ``with`` block.

    The head's lane of the attention output (its ``weights @ v``, before the head merge and
    the output projection) is set to zero (``how="zero"``) or to its mean over the query
    positions (``how="mean"``), in whichever torch call computes it: SDPA (fused QKV,
    ``is_causal``, grouped-query), ``nn.MultiheadAttention``, an einsum or matmul softmax
    path (eager Hugging Face, NILMFormer, TransformerLens). Nothing of the model is
    changed: on exit it computes bit-identically to before.

    Parameters
    ----------
    model : torch.nn.Module
        Any model.
    heads : mapping of str to int or list of int
        Layer names, as a capture's ``layer`` coordinate names them (the module running the
        attention; ``name[1]`` for its second call in one forward), to the heads to switch
        off.
    how : {"zero", "mean"}
        What a switched-off head's lane becomes.

    Yields
    ------
    HeadGate
        Its ``seen`` says which layers computed attention, and their head counts.

    Raises
    ------
    AblationError
        A layer that is no module of the model; a head index the layer does not have
        (raised by the forward that meets it); on exit, a layer asked for that never
        computed attention inside the block (the model not run at all included), or whose
        head lanes could not be found, naming the layers that did.

    Examples
    --------
    >>> with attnpanel.ablate(model, heads={"layers.1.attn": [3, 5]}):  # doctest: +SKIP
    ...     y = model(x)
    """
    asked = heads_asked(heads)
    check_layers(model, asked)
    gate = HeadGate(model, asked, how)
    with gate.watching():
        yield gate
    check_written(gate, asked, "ablate")


def attention_heads(model: nn.Module, *inputs, **kwargs) -> dict[str, int]:
    """Every layer that computes attention in one forward of ``model``, with its heads.

    Layer names are a capture's ``layer`` coordinate values. The forward runs without
    gradients and changes nothing.
    """
    gate = HeadWriter(model)
    with gate.watching(), torch.no_grad():
        model(*inputs, **kwargs)
    return dict(gate.seen)

"""What the user looks at: the explorer's state, the single source of truth of every view.

:class:`ExplorerState` holds the trace and the selection (sample, layer, head, query,
mask, stage, enabled heads, and what is shown) as ``param`` parameters with bounds and
docs. Widgets are made from these parameters, the explorer's sections watch them, the
page URL mirrors some of them, and a notebook user or a test sets them with
``state.param.update(...)``. It imports no plotting or GUI library.

The layer shown is the ``layer`` parameter alone: :attr:`ExplorerState.trace` is that
layer of the trace, read when a view draws, and the shared :class:`StageCache` keys its
entries by the layer (:attr:`ExplorerState.selection` carries it).
"""

from __future__ import annotations

import param
import xarray as xr

from attnpanel.interventions.model_run import (
    ANOTHER_SAMPLE,
    SPAN_MEAN,
    SPAN_ZEROS,
    ModelRun,
    Patching,
)
from attnpanel.interventions.patching import WHATS
from attnpanel.kernels.masks import MASK_MODES
from attnpanel.readouts.core import Selection, StageCache, at_layer, uses_sinusoidal
from attnpanel.traces.schema import STAGES
from attnpanel.traces.stages import mask_options

COLORMAPS = ("coolwarm", "RdBu_r", "bwr", "fire", "viridis")
# What a view can depend on: a change of any of these redraws the views that name it.
SELECTION_PARAMS = ("sample", "head", "query", "mask", "stage", "enabled_heads", "layer")
# the other parameters views depend on (the engine redraws the views that name them)
VIEW_PARAMS = (
    "show_reference",
    "corruption",
    "corrupt_sample",
    "corrupt_span",
    "patch_what",
    "patched_head",
    "why_key",
    "composed_pair",
    "composition",
)


class ExplorerState(param.Parameterized):
    """The trace and the selection every view of the explorer reads.

    Parameters
    ----------
    trace : xarray.Dataset
        A trace (see ``attnpanel.trace``); only ``weights`` is required. A trace with a
        ``layer`` dim is explored one layer at a time (the ``layer`` parameter).
    cache : StageCache, optional
        Where recomputed stages are kept. By default the trace's shared cache
        (:meth:`StageCache.shared`): every state of one trace object, such as the sessions
        of a server, reuses what another computed.
    **params
        Initial values of the parameters below.
    """

    sample = param.Integer(default=0, bounds=(0, 0), doc="Sample (batch index) shown.")
    layer = param.Integer(
        default=0,
        bounds=(0, 0),
        doc="Layer shown, for a trace with a `layer` dim: every view follows.",
    )
    head = param.Selector(
        default=0,
        objects=[0, "mean"],
        doc='Head of the large matrix, or "mean" of the enabled heads.',
    )
    query = param.Integer(default=0, bounds=(0, 0), doc="Selected query position.")
    mask = param.Selector(
        default="none",
        objects=list(MASK_MODES),
        doc="Mask mode; weights are recomputed live from q and k.",
    )
    stage = param.Selector(
        default="softmax",
        objects=list(STAGES),
        doc="Stage of the score-to-weight pipeline in the large matrix.",
    )
    enabled_heads = param.ListSelector(
        default=[], objects=[], doc="Heads kept in the merge and the output."
    )
    colormap = param.Selector(
        default="coolwarm",
        objects=list(COLORMAPS),
        doc="Colour map of the large matrix (low to high).",
    )
    side_by_side = param.Boolean(
        default=False, doc="Show the matrix without a mask beside the masked one."
    )
    show_reference = param.Boolean(
        default=True,
        doc="Overlay the reference series (each channel's truth and the model's prediction) "
        "on the input signal of the top view.",
    )
    show_positional = param.Boolean(
        default=False,
        doc=(
            "Show the sinusoidal positional encoding; on at start when the trace's attribute "
            "`positional_encoding` is 'sinusoidal'."
        ),
    )
    show_head_average = param.Boolean(
        default=False,
        doc="Show the head average (what nn.MultiheadAttention returns) beside the head maps.",
    )
    show_projection = param.Boolean(
        default=False,
        doc=(
            "Show the Q/K/V projection (x, Wq, Wk, Wv and the heads' q, k, v); drawn the "
            "first time it is shown."
        ),
    )
    show_merge = param.Boolean(
        default=False,
        doc=("Show the head merge and the output projection Wo; drawn the first time it is shown."),
    )
    show_embedding = param.Boolean(
        default=False,
        doc=(
            "Show the shown head's queries and keys in one plane, a box of which marks them "
            "on the matrix; drawn the first time it is shown."
        ),
    )
    step = param.Integer(
        default=0,
        bounds=(0, 7),
        doc=(
            "Step of the guided walk of the selected query through the layer (1-7); 0 when "
            "the walk is closed. A step sets the stage it explains."
        ),
    )
    show_survey = param.Boolean(
        default=False,
        doc=(
            "Show every head's statistics over every sample (a survey); drawn the first "
            "time it is shown."
        ),
    )
    show_patching = param.Boolean(
        default=False,
        doc=(
            "Show which heads carry the difference between this sample and a corrupted one "
            "(each head patched from the clean run into the corrupted run, inside the model); "
            "computed the first time it is shown."
        ),
    )
    show_why = param.Boolean(False, doc="Show the selected cell's score split over the input.")
    why_key = param.Integer(
        -1,
        bounds=(-1, None),
        doc="The explained cell's key (a click on "
        "the matrix picks it); -1: the key the query attends most.",
    )
    show_composition = param.Boolean(False, doc="Show the heads' composition graph.")
    composition = param.Selector(
        default="K",
        objects=["Q", "K", "V"],
        doc="The composition drawn: a later head's queries, keys or values reading.",
    )
    composed_pair = param.Tuple(("", -1, "", -1), length=4, doc="The pair of heads drawn "
                                "beside the graph: (layer, head, later layer, head).")  # fmt: skip
    maps_ahead = param.Boolean(
        default=True,
        doc="Send the large matrix's neighbouring maps (other heads, stages, masks) to the "
        "browser while the page is idle, so that a head, stage or mask change is drawn there "
        "without a round trip (a served page; see docs/explorer.md).",
    )
    corruption = param.Selector(
        default=None,
        objects=[],
        allow_None=True,
        check_on_set=True,  # a link's value outside the model's choices is refused
        doc="The corrupted input heads are patched into: the model's own (the demo: this "
        "window without one of its devices), another sample, or a span of the input replaced.",
    )
    corrupt_sample = param.Integer(
        default=1, bounds=(0, None), doc="The other sample, where the corrupted input is one."
    )
    corrupt_span = param.Range(
        default=(0, 1),
        bounds=(0, None),
        doc="The input positions [start, stop) replaced, where the corrupted input is a span "
        "replaced.",
    )
    patch_what = param.Selector(
        default="output",
        objects=list(WHATS),
        doc="What of each head is patched from the clean run into the corrupted run.",
    )
    patched_head = param.Tuple(
        default=("", -1),
        length=2,
        doc="The head (layer name, index) whose patched prediction is drawn; ('', -1): none.",
    )
    last_error = param.String(default="", doc="The last error a view reported.")
    survey = param.ClassSelector(
        class_=xr.Dataset,
        default=None,
        allow_None=True,
        doc="A survey of the model over the trace's samples (attnpanel.survey), or None: "
        "with the model at hand, the survey is computed when first shown.",
    )
    model = param.ClassSelector(
        class_=ModelRun,
        default=None,
        allow_None=True,
        doc="The model behind the trace, at hand: head toggles switch heads off inside it "
        "and the page draws its prediction again (None: only this layer's output changes).",
    )

    def __init__(self, trace: xr.Dataset, cache: StageCache | None = None, **params):
        if not isinstance(trace, xr.Dataset) or "weights" not in trace:
            raise ValueError("AttentionExplorer needs a trace: an xarray.Dataset with 'weights'")
        if trace["weights"].size == 0:
            sizes = ", ".join(f"{d}={n}" for d, n in trace["weights"].sizes.items())
            raise ValueError(f"this trace is empty ({sizes}): there is no attention to show")
        self.layers = trace if "layer" in trace.dims else None
        self.cache = StageCache.shared(trace) if cache is None else cache
        # Its own Dataset (a shallow copy: the arrays are shared, never written).
        self._one_layer = trace.copy(deep=False) if self.layers is None else None
        late = {
            name: params.pop(name)
            for name in (
                "sample",
                "head",
                "query",
                "why_key",
                "mask",
                "enabled_heads",
                "layer",
                "corruption",
                "corrupt_sample",
                "corrupt_span",
            )
            if name in params
        }
        super().__init__(**params)
        if self.layers is not None:
            self.param.layer.bounds = (0, self.layers.sizes["layer"] - 1)
            if "layer" in late:
                self.layer = late.pop("layer")  # first: the bounds below read the layer
        first = self.trace
        n_batch, n_heads = first.sizes["batch"], first.sizes["head"]
        masks = mask_options(first)
        own_mask = first.attrs.get("mask", "none")
        self.param.sample.bounds = (0, n_batch - 1)
        self.param.query.bounds = (0, first.sizes["query"] - 1)
        self.param.why_key.bounds = (-1, first.sizes["key"] - 1)
        self.param.head.objects = list(range(n_heads)) + ["mean"]
        self.param.mask.objects = masks
        self.param.enabled_heads.objects = list(range(n_heads))
        with param.parameterized.discard_events(self):
            self.mask = own_mask if own_mask in masks else masks[0]
            self.enabled_heads = list(range(n_heads))
            if "show_positional" not in params:
                self.show_positional = uses_sinusoidal(first)
        self._patching_choices()
        self.param.update(**late)
        self._start = self.param.values()

    @param.depends("model", watch=True)
    def _patching_choices(self) -> None:
        """The corrupted inputs and spans the model at hand offers."""
        if self.model is None:
            self.param.corruption.objects = []
            return
        names = self.model.corruption_names()
        self.param.corruption.objects = names
        batch, length = self.model.batch, self.model.positions() or 1
        self.param.corrupt_sample.bounds = (0, max(batch - 1, 0))
        self.param.corrupt_span.bounds = (0, length)
        with param.parameterized.discard_events(self):  # a value given at the start stays
            if self.corruption not in names:
                self.corruption = names[0] if names else None
            if not 0 <= self.corrupt_sample < batch:
                self.corrupt_sample = min(1, batch - 1)
            start, stop = self.corrupt_span
            if not 0 <= start < stop <= length or self.corrupt_span == (0, 1):
                self.corrupt_span = (length // 2 - length // 16, length // 2 + length // 16)

    @param.depends("corruption", "patch_what", watch=True)
    def _forget_patched_head(self) -> None:
        """Another corrupted input or what: the curves show its largest effect again."""
        self.patched_head = ("", -1)

    @property
    def patching(self) -> Patching:
        """The corrupted input and what of a head the page patches, as a plain value (the
        other sample and the span only where the corrupted input reads them: a change of
        one it ignores is the same request)."""
        how = self.corruption or ""
        other = self.corrupt_sample if how == ANOTHER_SAMPLE else 0
        span = (
            tuple(int(round(p)) for p in self.corrupt_span)
            if how in (SPAN_MEAN, SPAN_ZEROS)
            else (0, 0)
        )
        return Patching(how, other, span, self.patch_what)

    def reset(self) -> None:
        """Go back to the selection the state started with (every parameter)."""
        start = {name: value for name, value in self._start.items() if name != "name"}
        start["enabled_heads"] = list(start["enabled_heads"])
        start["last_error"] = ""
        self.param.update(**start)

    @property
    def trace(self) -> xr.Dataset:
        """The Dataset every view reads: the shown layer of the trace."""
        if self.layers is None:
            return self._one_layer
        return at_layer(self.layers, self.layer)

    @property
    def n_heads(self) -> int:
        """Number of heads of the trace."""
        return len(self.param.enabled_heads.objects)

    @property
    def selection(self) -> Selection:
        """The current selection as a plain value (what the readouts and views take)."""
        return Selection(
            sample=self.sample,
            head=self.head,
            query=self.query,
            mask=self.mask,
            stage=self.stage,
            enabled_heads=tuple(sorted(self.enabled_heads)),
            layer=self.layer,
        )

    def toggle_head(self, head: int, on: bool) -> None:
        """Keep ``head`` in the merge (``on``) or drop it from it."""
        enabled = set(self.enabled_heads) | {head} if on else set(self.enabled_heads) - {head}
        if sorted(enabled) != sorted(self.enabled_heads):
            self.enabled_heads = sorted(enabled)

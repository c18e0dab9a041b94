"""Numbers the views show, read or recomputed from a trace: numpy only, no plotting.

Every function takes an ``xarray.Dataset`` trace (see ``attnpanel.trace``) and a
:class:`Selection` (what the user looks at) and returns numpy arrays or strings. The
HoloViews views (``attnpanel.render.views``), the served explorer's live path and the offline
export all draw these numbers, so a test of a readout is a test of what every page shows.

A readout that needs a variable the trace lacks raises :class:`MissingVariable`, naming
it; the explorer shows that message in the view's place.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import xarray as xr

from attnpanel.kernels.statistics import head_statistics_of
from attnpanel.readouts.quantities import signal_quantity
from attnpanel.traces import virtual
from attnpanel.traces.positions import Positions
from attnpanel.traces.schema import STAGES
from attnpanel.traces.stages import attention_stage, masked_cells, normaliser
from attnpanel.util.locks import KeyLocks

PREDICTED = " (predicted)"  # a model's prediction of a series: drawn dashed in its colour
PRE_MASK = ("raw", "scaled")  # the stages computed before the mask is applied
STAGE_LABELS = {
    "raw": "raw scores q·k",
    "scaled": "scaled scores q·k / √E",
    "masked": "masked scores",
    "softmax": "softmax weights",
    "value_weighted": "value-weighted a·‖v W_o‖",
}
# a linear attention's stages (a trace whose normaliser is a row sum): q and k hold its
# features, and no softmax is run
ROW_SUM_LABELS = {
    "raw": "feature products φ(q)·φ(k)",
    "scaled": "feature products φ(q)·φ(k)",
    "masked": "masked feature products",
    "softmax": "weights φ(q)·φ(k) / row sum",
    "value_weighted": "value-weighted a·‖v W_o‖",
}


def weights_words(ds: xr.Dataset) -> str:
    """What this trace's weights are, in words: a softmax's, or a linear attention's."""
    return stage_label(ds, "softmax")


def both_weights_words(a: xr.Dataset, b: xr.Dataset) -> str:
    """What two compared traces' weights are: their one kind's words, or "weights" where
    one is a softmax's and the other a linear attention's."""
    words = weights_words(a)
    return words if words == weights_words(b) else "weights"


def stage_label(ds: xr.Dataset, stage: str) -> str:
    """A stage's words for this trace: its weights are a softmax, or a linear attention's
    row sums."""
    if normaliser(ds) == "row sum":
        return ROW_SUM_LABELS[stage]
    return STAGE_LABELS[stage]


class MissingVariable(KeyError):
    """A view needs a trace variable (or coordinate) that this trace does not hold."""

    def __init__(self, names, view: str = "this view"):
        self.names = tuple([names] if isinstance(names, str) else names)
        self.view = view
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """One sentence naming what is missing, for display in the view's place."""
        joined = ", ".join(f"`{n}`" for n in self.names)
        return f"The {self.view} needs {joined}, which this trace does not contain."

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Selection:
    """What the user is looking at.

    Parameters
    ----------
    sample : int
        Batch index (by position).
    head : int or "mean"
        Head index, or ``"mean"`` for the mean over the enabled heads.
    query : int
        Query position.
    mask : str or None
        Mask mode the weights are recomputed with; ``None`` means the trace's own.
    stage : {"raw", "scaled", "masked", "softmax"}
        Stage of the score-to-weight pipeline.
    enabled_heads : tuple of int or None
        Heads kept in the merge; ``None`` means all.
    layer : int
        Layer of a multi-layer trace the Dataset read is (a key of the caches: one
        :class:`StageCache` serves every layer).
    """

    sample: int = 0
    head: int | str = 0
    query: int = 0
    mask: str | None = None
    stage: str = "softmax"
    enabled_heads: tuple[int, ...] | None = field(default=None)
    layer: int = 0

    def with_(self, **changes) -> Selection:
        """A copy with some fields changed."""
        return replace(self, **changes)


def require(ds: xr.Dataset, names, view: str) -> None:
    """Raise :class:`MissingVariable` unless every name is a variable or coordinate of ds."""
    names = [names] if isinstance(names, str) else list(names)
    missing = [n for n in names if n not in ds.variables]
    if missing:
        raise MissingVariable(missing, view)


class StageCache:
    """Least-recently-used cache of the arrays the views recompute, bounded in bytes.

    Recomputing a stage from ``q`` and ``k`` takes tens of milliseconds per sample on a
    small CPU; the explorer revisits the same (sample, mask, stage) often (the stage player,
    toggling masks or heads), so results are kept as float32 up to ``max_bytes`` in all
    (8 x 480 x 480 x 4 bytes = 7.4 MB per sample and stage at the demo size).
    """

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._computing = KeyLocks()
        self._passing = threading.local()

    @contextlib.contextmanager
    def passing(self):
        """Within it, on this thread, a miss is computed and returned but not kept: work
        done ahead of the user (the maps sent to the browser while the page is idle, which
        the browser then holds) does not fill a cache every session shares."""
        before = getattr(self._passing, "on", False)
        self._passing.on = True
        try:
            yield self
        finally:
            self._passing.on = before

    def get(self, key, compute):
        """Return the cached value of ``key``, computing it with ``compute()`` on a miss."""
        found = self._hit(key)
        if found is not None:
            return found[0]
        with self._computing.hold(key):  # threads asking for one key compute it once
            found = self._hit(key)
            if found is not None:
                return found[0]
            value = compute()
            if getattr(self._passing, "on", False):
                return value
            with self._lock:
                self._items[key] = value
                self._bytes += getattr(value, "nbytes", 0)
                while self._bytes > self.max_bytes and len(self._items) > 1:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= getattr(old, "nbytes", 0)
        return value

    def _hit(self, key) -> tuple | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return (self._items[key],)
        return None

    def __contains__(self, key) -> bool:
        return key in self._items

    def keys(self) -> list:
        """The keys held now, least recently used first."""
        with self._lock:
            return list(self._items)

    @classmethod
    def shared(cls, trace: xr.Dataset) -> StageCache:
        """The one cache of a trace object, shared by everything that explores it.

        Every session of a served trace (one object per server process) then reuses the
        stages another session computed; the cache goes with the trace.
        """
        key = id(trace)  # a Dataset is not hashable; its entry goes when it is collected
        with _SHARED_LOCK:
            found = _SHARED.get(key)
            if found is None:
                found = _SHARED[key] = cls()
                weakref.finalize(trace, _SHARED.pop, key, None)
            return found

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held now (at most ``max_bytes``, unless one alone is more)."""
        return self._bytes

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._items.clear()
            self._bytes = 0


_SHARED: dict[int, StageCache] = {}  # id(trace) -> its cache, while the trace lives
_SHARED_LOCK = threading.Lock()


def mask_mode(ds: xr.Dataset, sel: Selection) -> str:
    return ds.attrs.get("mask", "none") if sel.mask is None else sel.mask


def drawn_masked(
    ds: xr.Dataset, mask: str | None = None, sample: int = 0, head: int | str | None = None
) -> np.ndarray | None:
    """The ``(query, key)`` cells drawn as masked for one sample and head, or None.

    See :func:`attnpanel.traces.stages.masked_cells`: what the mask blocks for that sample and
    head (in every head for ``head="mean"``), and padded positions.
    """
    return masked_cells(ds, mask, batch=sample, head=head if isinstance(head, int) else None)


def stage_heads(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> np.ndarray:
    """The selected stage of one sample for every head, ``(head, query, key)`` float32.

    Only the selected sample is recomputed (from ``q`` and ``k``, for the selected mask);
    the full 4-D tensor is never copied.
    """
    mask = mask_mode(ds, sel)
    if sel.stage not in STAGES:
        raise ValueError(f"unknown stage {sel.stage!r}; expected one of {STAGES}")

    def compute():
        try:
            values = attention_stage(ds, sel.stage, mask=mask, batch=sel.sample)
        except KeyError as err:
            names = [n for n in ("q", "k") if n not in ds]
            raise MissingVariable(names or ["q", "k"], f"{sel.stage} stage") from err
        return np.asarray(values.values, dtype=np.float32)

    if cache is None:
        return compute()
    return cache.get(("stage", sel.layer, sel.sample, mask, sel.stage), compute)


def stages_cached(ds: xr.Dataset, sel: Selection, cache: StageCache) -> bool:
    """Whether the maps of a selection are in ``cache`` (its stage, and the softmax the head
    maps show): False means a recomputation from q and k (tens to hundreds of ms)."""
    mask = mask_mode(ds, sel)
    return all(
        ("stage", sel.layer, sel.sample, mask, stage) in cache
        for stage in dict.fromkeys((sel.stage, "softmax"))
    )


def attention_values(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> np.ndarray:
    """The ``(query, key)`` array shown by the attention matrix, float32.

    For the masked and softmax stages, blocked cells are NaN, so they are drawn in the
    "NaN" clipping colour (black) apart from the colour scale: the ``-1e4`` fill never
    squashes the colours of the rest. ``head="mean"`` averages the enabled heads.
    """
    heads = stage_heads(ds, sel, cache)
    mask = mask_mode(ds, sel)

    def compute():
        if sel.head == "mean":
            enabled = list(sel.enabled_heads) if sel.enabled_heads else list(range(len(heads)))
            values = heads[enabled].mean(axis=0)
        else:
            values = heads[int(sel.head)].copy()
        if sel.stage in ("masked", "softmax", "value_weighted"):
            blocked = drawn_masked(ds, mask, sel.sample, sel.head)
            if blocked is not None:
                values[blocked] = np.nan
        return values

    if cache is None:
        return compute()
    enabled = sel.enabled_heads if sel.head == "mean" else None
    return cache.get(("matrix", sel.layer, sel.sample, mask, sel.stage, sel.head, enabled), compute)


def layer_label(name) -> str:
    """A layer as every surface names it (page, CLI, export, importance, survey): the
    capture's own name for it, its module name, which carries its index where the model
    has several (``encoder.2.attention``, ``transformer.h.0.attn``)."""
    return str(name)


TITLE_LINE = 64  # characters of a map's title line (a 500 px map at Bokeh's title font)
MAP_TITLE_LINE = 28  # ... of a (layer, head) map's title line, beside long layer names


def fitted_title(first: str, joint: str, second: str, line: int = TITLE_LINE) -> str:
    """``first{joint} second`` on one line where it fits ``line`` characters, else broken
    after ``joint``: a map's title wraps, it is never cut."""
    if len(first) + len(joint) + 1 + len(second) > line:
        return f"{first}{joint}\n{second}"
    return f"{first}{joint} {second}"


def wrapped_title(text: str, line: int = MAP_TITLE_LINE) -> str:
    """``text`` broken between words into lines of at most ``line`` characters (a word
    longer than a line keeps its own line): a small map's title wraps, it is never cut."""
    import textwrap

    return textwrap.fill(text, width=line, break_long_words=False, break_on_hyphens=False)


def head_words(head) -> str:
    """A head as every title names it: ``head 3``, or ``mean of heads``."""
    return "mean of heads" if head == "mean" else f"head {head}"


def matrix_title(ds: xr.Dataset, sel: Selection, number: int | None = None) -> str:
    """The attention matrix's title for a selection (naming the layer of a captured model);
    ``number``: the sample's number where ``ds`` holds some samples of a trace only."""
    head = head_words(sel.head)
    if "layer" in ds.coords and ds["layer"].ndim == 0:
        head = f"{head}, layer {layer_label(ds['layer'].item())}"
    mask = mask_mode(ds, sel)
    if "sample_mask" in ds and mask == ds.attrs.get("mask", "none"):
        mask += ", per sample"
    if "padding" in ds:
        padded = int(np.asarray(ds["padding"].isel(batch=sel.sample).values).sum())
        if padded:
            mask += f"; {padded} padded positions masked"
    # the scores before the mask name no mask: none is applied to them yet
    words = f"mask {mask}" if sel.stage not in PRE_MASK else "before the mask"
    sample = sel.sample if number is None else number
    return fitted_title(f"sample {sample}, {head}", ":", f"{stage_label(ds, sel.stage)} ({words})")


def position_axis(ds: xr.Dataset, sel: Selection) -> tuple[np.ndarray, str]:
    """The x values of the top view: timestamps where known, else integer positions."""
    if "time" in ds.coords:
        time = ds["time"]
        if "batch" in time.dims:
            time = time.isel(batch=sel.sample)
        return np.asarray(time.values), "time"
    return np.arange(ds.sizes["query"]), "position"


@dataclass(frozen=True)
class SequenceSeries:
    """What the top view plots for one sample (numbers only; the views style them)."""

    xs: np.ndarray  # timestamps where the trace has ``time``, else positions
    xname: str  # "time" or "position"
    yname: str  # "signal", "norm" or "attention"
    ylabel: str
    unit: str | None
    series: list  # [(label, values)], the signal (or the only series) first
    title: str


def sequence_series(ds: xr.Dataset, sel: Selection, show_reference: bool = True):
    """The input sequence of the selected sample: a :class:`SequenceSeries`.

    The trace's input ``signal`` (with each reference series' ``truth`` and the model's
    ``prediction``, when asked and present: see ``REFERENCE_SERIES`` in
    :mod:`attnpanel.traces.schema`); otherwise the norm of the input vector ``x`` per
    position; for a trace with only weights, the attention each position receives (mean
    over heads and queries), or for a virtual trace (whose weights are computed, not held)
    the norm of its query vectors.
    """
    xs, xname = position_axis(ds, sel)
    if "signal" in ds:
        signal = ds["signal"]
        name = str(signal.attrs.get("long_name", "signal"))
        series = [(name, signal.isel(batch=sel.sample).values)]
        for variable, suffix in (("truth", ""), ("prediction", PREDICTED)):
            if not show_reference or variable not in ds:
                continue
            channels = ds[variable].isel(batch=sel.sample)
            for i, channel in enumerate(channels["series"].values):
                series.append((f"{channel}{suffix}", channels.isel(series=i).values))
        dates = Positions.of(ds, sel.sample).dates()
        when = f", {dates}" if dates else ""
        title = f"sample {sel.sample}: {name}{when} (click to pick the query)"
        unit = signal.attrs.get("units")
        ylabel = name if len(series) == 1 else signal_quantity(ds, name, unit)
        return SequenceSeries(xs, xname, "signal", ylabel, unit, series, title)
    if "x" in ds:
        norm = np.linalg.norm(ds["x"].isel(batch=sel.sample).values, axis=-1)
        title = f"sample {sel.sample}: input vector norm per position"
        return SequenceSeries(xs, xname, "norm", "‖x‖", None, [("input norm", norm)], title)
    if virtual.is_virtual(ds) and "q" in ds:
        # what each position receives would take a pass over every cell of every head
        q = ds["q"].isel(batch=sel.sample).transpose("head", "position", "head_dim")
        norm = np.linalg.norm(q.values, axis=-1).mean(0)
        title = f"sample {sel.sample}: query vector norm per position (mean over heads)"
        return SequenceSeries(xs, xname, "norm", "‖q‖", None, [("query norm", norm)], title)
    received = ds["weights"].isel(batch=sel.sample).mean(("head", "query")).values
    title = f"sample {sel.sample}: attention each position receives"
    return SequenceSeries(
        xs,
        xname,
        "attention",
        "attention received",
        None,
        [("attention received", received)],
        title,
    )


def clock_labels(ds: xr.Dataset, sample: int = 0) -> list[str] | None:
    """Each position of a sample as text (:meth:`Positions.labels`: clock times, spans,
    named tokens), or None where the trace has neither a clock nor named tokens."""
    return Positions.of(ds, sample).labels()


def selected_weights(ds: xr.Dataset, sel: Selection, cache: StageCache | None) -> np.ndarray:
    """Softmax weights of the selected query row (mean of enabled heads for "mean")."""
    return query_weights(ds, sel, cache)[sel.query]


def query_weights(ds: xr.Dataset, sel: Selection, cache: StageCache | None) -> np.ndarray:
    """Softmax weights of every query of the selected head, ``(query, key)`` float32 (mean
    of enabled heads for "mean"): the rows :func:`selected_weights` reads."""
    heads = stage_heads(ds, sel.with_(stage="softmax"), cache)
    if sel.head != "mean":
        return heads[int(sel.head)]
    enabled = list(sel.enabled_heads) if sel.enabled_heads else list(range(len(heads)))
    if cache is None:
        return heads[enabled].mean(axis=0)
    key = ("weights", sel.layer, sel.sample, mask_mode(ds, sel), tuple(enabled))
    return cache.get(key, lambda: heads[enabled].mean(axis=0))


def values_for(ds: xr.Dataset, sel: Selection) -> np.ndarray:
    """Value vectors of the selected sample: ``(key, E)`` for a head, ``(key, D)`` for mean."""
    require(ds, "v", "value aggregation view")
    v = ds["v"].isel(batch=sel.sample).values  # (H, S, E)
    if sel.head == "mean":
        return v.transpose(1, 0, 2).reshape(v.shape[1], -1)  # (S, H*E)
    return v[int(sel.head)]


def head_contexts(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> np.ndarray:
    """Per-head context vectors of the selected query, ``(head, head_dim)``.

    The trace's own ``context`` when the mask is the trace's; otherwise recomputed from
    the recomputed weights and ``v``.
    """
    if sel.mask in (None, ds.attrs.get("mask", "none")) and "context" in ds:
        return ds["context"].isel(batch=sel.sample, query=sel.query).values.astype(np.float32)
    require(ds, "v", "head merge view")
    weights = stage_heads(ds, sel.with_(stage="softmax"), cache)[:, sel.query]  # (H, S)
    v = ds["v"].isel(batch=sel.sample).values  # (H, S, E)
    return np.einsum("hs,hse->he", weights, v).astype(np.float32)


def enabled_set(ds: xr.Dataset, sel: Selection) -> set[int]:
    n_heads = ds.sizes["head"]
    return set(range(n_heads)) if sel.enabled_heads is None else set(sel.enabled_heads)


def merged_output(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None):
    """Merged vector and output of the selected query, with all heads and without the off ones.

    Returns
    -------
    merged, output_all, output_enabled : numpy.ndarray
        ``(D,)`` merged vector (off heads zeroed), the output with every head, the output
        with only the enabled heads.
    """
    require(ds, "w_o", "output projection view")
    contexts = head_contexts(ds, sel, cache)  # (H, E)
    n_heads = contexts.shape[0]
    enabled = enabled_set(ds, sel)
    keep = np.array([h in enabled for h in range(n_heads)], dtype=np.float32)[:, None]
    w_o = np.asarray(ds["w_o"].values, dtype=np.float32)
    merged_all = contexts.reshape(-1)  # (D,) heads side by side, as the model merges them
    merged = (contexts * keep).reshape(-1)
    return merged, w_o @ merged_all, w_o @ merged


def output_change_ratio(ds: xr.Dataset, sel: Selection, cache: StageCache | None = None) -> float:
    """``‖y_enabled − y_all‖ / ‖y_all‖`` at the selected query."""
    _, output_all, output_enabled = merged_output(ds, sel, cache)
    return float(np.linalg.norm(output_enabled - output_all) / (np.linalg.norm(output_all) or 1))


POSITIONAL_ATTR = "positional_encoding"  # trace attribute naming the model's encoding


def layer_names(ds: xr.Dataset) -> list[str]:
    """The names of a multi-layer trace's layers (its ``layer`` coordinate); [] for one layer."""
    if "layer" not in ds.dims:
        return []
    if "layer" in ds.coords:
        return [str(name) for name in ds["layer"].values]
    return [str(i) for i in range(ds.sizes["layer"])]


def at_layer(ds: xr.Dataset, layer: int) -> xr.Dataset:
    """One layer of a multi-layer trace (by position); a one-layer trace as it is."""
    if "layer" not in ds.dims:
        return ds
    return ds.isel(layer=int(layer))


def uses_sinusoidal(ds: xr.Dataset) -> bool:
    """Whether the trace says its model adds the sinusoidal encoding.

    Read from the attribute ``positional_encoding`` (``"sinusoidal"``), which a user (or a
    capture that knows) sets; a Hugging Face BERT learns its positions instead.
    """
    return str(ds.attrs.get(POSITIONAL_ATTR, "")).lower() == "sinusoidal"


def head_patterns(weights: np.ndarray, named: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Where each head looks, over the queries of one sample.

    Parameters
    ----------
    weights : numpy.ndarray
        ``(head, query, key)`` softmax weights of one sample (query and key on the same
        positions; blocked cells 0).
    named : numpy.ndarray, optional
        ``(key,)`` True at named tokens (:class:`~attnpanel.traces.positions.Positions`):
        their rows are left out, their weight adds no distance and is ``token_share``, and
        the lag is each row's top step.

    Returns
    -------
    dict of numpy.ndarray, each ``(head,)``
        ``distance``: mean attention distance ``sum_k w[q, k] |q - k|`` averaged over
        the queries; ``lag``: the most common offset ``key - query`` of each query's
        most-attended key; ``lag_share``: the share of queries whose top key is at that
        lag; ``entropy``: the mean row entropy relative to a uniform row (1 = uniform).
    """
    weights = np.asarray(weights, dtype=np.float32)
    n_heads, n_query, n_key = weights.shape
    named = None if named is None or not np.any(named) else np.asarray(named, dtype=bool)
    # distance and entropy: the survey's own statistics (one implementation of each)
    stats = head_statistics_of(
        torch.from_numpy(np.ascontiguousarray(weights))[None],
        named=None if named is None else torch.from_numpy(named),
    )
    mean_distance = stats["distance"][0].numpy()
    steps = weights if named is None else np.where(named, 0.0, weights)[:, ~named[:n_query]]
    rows = np.arange(n_query) if named is None else np.flatnonzero(~named[:n_query])
    offsets = steps.argmax(axis=2) - rows[None, :]  # (H, Q)
    n_query = len(rows)
    lag = np.empty(n_heads, dtype=np.int64)
    share = np.empty(n_heads, dtype=np.float64)
    for head in range(n_heads):
        values, counts = np.unique(offsets[head], return_counts=True)
        lag[head] = values[counts.argmax()]
        share[head] = counts.max() / n_query
    entropy = stats["entropy"][0].numpy()
    uniform = np.log(n_key) if n_key > 1 else 1.0
    found = {
        "distance": mean_distance,
        "lag": lag,
        "lag_share": share,
        "entropy": entropy / uniform,
    }
    if "token_share" in stats:
        found["token_share"] = stats["token_share"][0].numpy()
    return found


def time_step(ds: xr.Dataset, sample: int = 0) -> np.timedelta64 | None:
    """The regular step between the positions of a sample that have a time, else None."""
    return Positions.of(ds, sample).step()

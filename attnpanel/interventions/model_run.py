"""The model behind a trace, at hand: re-run on one sample with heads switched off.

A trace holds numbers the model computed once. With the model itself, the explorer can ask
what the prediction needs: :class:`ModelRun` re-runs the model on one sample of the inputs
the trace was captured on, with some heads of some layers switched off
(:func:`attnpanel.interventions.gate.ablate`), and gives the prediction as the trace's
reference series (``(series, position)``) and the model's metrics against the truth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.interventions.attribution import STEPS, Cell, explain_cell, score_attribution
from attnpanel.interventions.corruptions import replace_span
from attnpanel.interventions.effects import patching_effect
from attnpanel.interventions.gate import ablate, attention_heads
from attnpanel.interventions.gradients import attention_gradients
from attnpanel.interventions.importance import output_tensor, relative_change
from attnpanel.interventions.patching import PatchingError, patch
from attnpanel.surveys.survey import survey
from attnpanel.traces.positions import Layout
from attnpanel.util.kept import Kept

CACHED_RUNS = 512  # predictions kept (sample x heads off): a ranking of 3 x 8 heads is 25
MAX_SERIES = 8  # a default prediction of more channels is drawn as its norm
# captures of one sample kept (every layer's maps: tens of MB): the shown sample and the two
# beside it, computed ahead (attnpanel.app.neighbours)
CACHED_CAPTURES = 3
# cells' score attributions kept (each a (side, channel, position) array: 6 MB for a text
# model's 768 dims of 512 tokens)
CACHED_ATTRIBUTIONS = 16


def mean_absolute_error(prediction: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """``MAE`` over every series and position: the default metric."""
    return {"MAE": float(np.nanmean(np.abs(prediction - truth)))}


ANOTHER_SAMPLE = "another sample"
SPAN_MEAN, SPAN_ZEROS = "span replaced by its mean", "span replaced by zeros"


@dataclass(frozen=True)
class Corruption:
    """A corrupted input of one sample, named on the page: ``make(sample) -> (args,
    kwargs)`` of the same shapes as the clean sample's inputs; ``score(output)`` the number
    whose clean-corrupted difference the heads share out (default ``||output||``)."""

    name: str
    make: Callable[[int], tuple[tuple, dict]]
    score: Callable | None = None
    score_words: str = "‖output‖"  # what ``score`` is, in the user's words


@dataclass(frozen=True)
class Patching:
    """Which corrupted input the page patches heads into, and what of a head."""

    how: str = ANOTHER_SAMPLE  # a Corruption's name, ANOTHER_SAMPLE, SPAN_MEAN or SPAN_ZEROS
    other: int = 1  # the other sample (ANOTHER_SAMPLE)
    span: tuple[int, int] = (0, 1)  # the positions replaced (SPAN_*)
    what: str = "output"  # what of a head: output, q, k, v, weights


@dataclass(eq=False)
class ModelRun:
    """A model and the inputs a trace was captured on.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    inputs : tuple
        Its positional inputs for the whole batch (tensors with the batch first).
    kwargs : dict
        Its keyword inputs.
    layers : sequence of str
        The model's layer names (``attention_heads``) of the trace's layers, in the trace's
        ``layer`` order (one name for a single-layer trace).
    predict : callable
        ``predict(output) -> (batch, series, position)`` array: the model's output as the
        trace's reference series (the demo: each series' predicted power in W). Default: the
        output tensor itself, ``(batch, position)`` or ``(batch, position, series)``.
    metrics : callable
        ``metrics(prediction, truth) -> {name: value}`` for one sample's
        ``(series, position)`` arrays. Default: the mean absolute error.
    series : sequence of str, optional
        The series' names (the trace's ``series`` coordinate).
    corruptions : sequence of Corruption, optional
        Corrupted inputs of its own to patch heads between (the demo: each window without
        one of its devices); another sample and a span of the input replaced are always there.
    layout : attnpanel.Layout, optional
        The model's named tokens (NILMFormer's statistics token): its survey leaves them
        out of distances and keeps the weight on them (``token_share``).
    step : float, optional
        Seconds between two positions: its survey's ``distance_time``.
    channels : sequence of str, optional
        The names of the input's channels, every floating-point input's in order (the
        demo: the aggregate power and the 16 time features): a score attribution
        (:meth:`why`) names them.
    """

    model: nn.Module
    inputs: tuple
    kwargs: dict = field(default_factory=dict)
    layers: Sequence[str] = ()
    predict: Callable | None = None
    metrics: Callable[[np.ndarray, np.ndarray], dict[str, float]] = mean_absolute_error
    series: Sequence[str] | None = None
    corruptions: Sequence[Corruption] = ()
    layout: Layout | None = None
    step: float | None = None
    channels: Sequence[str] | None = None

    def __post_init__(self):
        self._predictions = Kept(CACHED_RUNS)  # shared by every session
        self._captures = Kept(CACHED_CAPTURES)
        self._gradients = Kept(CACHED_CAPTURES)
        self._survey: xr.Dataset | None = None
        self._survey_lock = threading.Lock()
        self._heads: dict[str, int] | None = None
        self._effects = Kept(CACHED_RUNS)
        self._attributions = Kept(CACHED_ATTRIBUTIONS)

    @property
    def batch(self) -> int:
        """Samples in the inputs."""
        first = next(t for t in (*self.inputs, *self.kwargs.values()) if torch.is_tensor(t))
        return int(first.shape[0])

    def one(self, sample: int) -> tuple[tuple, dict]:
        """The inputs of one sample (every tensor with the batch first, cut to it)."""
        batch = self.batch
        if not 0 <= sample < batch:
            raise ValueError(f"sample {sample} is out of range: the inputs have {batch}")

        def cut(value):
            if torch.is_tensor(value) and value.dim() and value.shape[0] == batch:
                return value[sample : sample + 1]
            return value

        return tuple(cut(v) for v in self.inputs), {k: cut(v) for k, v in self.kwargs.items()}

    def heads(self) -> dict[str, int]:
        """Every attention layer of the model with its heads (one forward on sample 0)."""
        if self._heads is None:
            inputs, kwargs = self.one(0)
            self._heads = attention_heads(self.model, *inputs, **kwargs)
        return self._heads

    def _series(self, output) -> np.ndarray:
        """The prediction of one sample, ``(series, position)`` float64."""
        if self.predict is not None:
            found = np.asarray(self.predict(output), dtype=np.float64)
        else:
            found = output_tensor(output).detach().double().cpu().numpy()
            if found.ndim == 3 and found.shape[2] > MAX_SERIES:
                found = np.linalg.norm(found, axis=2)  # hidden states: their norm
            found = found[:, None] if found.ndim == 2 else np.swapaxes(found, 1, 2)
        return found[0]

    def series_names(self, count: int) -> list[str]:
        """The predicted series' names: given, else ``output`` (one) or ``output i``."""
        if self.series is not None:
            return list(self.series)
        if self.predict is None and count == 1:
            return ["‖output‖"]
        return ["output"] if count == 1 else [f"output {i}" for i in range(count)]

    def prediction(self, sample: int, off: Mapping[str, Sequence[int]] | None = None) -> np.ndarray:
        """The model's prediction of ``sample``, ``(series, position)``, with the heads of
        ``off`` (layer name to head indices) switched off."""
        off = {layer: sorted(heads) for layer, heads in (off or {}).items() if heads}
        key = (sample, tuple(sorted((layer, tuple(h)) for layer, h in off.items())))
        return self._predictions.get(key, lambda: self._run(sample, off))

    def _run(self, sample: int, off: dict[str, list[int]]) -> np.ndarray:
        inputs, kwargs = self.one(sample)
        # every head on, too, on the path the ablated forwards take: a padded
        # nn.TransformerEncoder runs fused (its padded rows 0) outside a mode only
        with torch.no_grad(), ablate(self.model, off):
            output = self.model(*inputs, **kwargs)
        return self._series(output)

    def capture(self, sample: int) -> xr.Dataset | xr.DataTree:
        """Every attention of the model on one sample (:func:`attnpanel.capture`); the last
        few are kept, shared by every session."""
        from attnpanel.capturing.capture import capture

        def compute():
            inputs, kwargs = self.one(sample)
            return capture(self.model, *inputs, **kwargs)

        return self._captures.get(sample, compute)

    def survey(self) -> xr.Dataset:
        """Every head's statistics on every sample of the inputs
        (:func:`attnpanel.survey`), computed once (by the first caller; the others wait
        for it) and kept."""
        with self._survey_lock:
            if self._survey is None:
                self._survey = survey(
                    self.model,
                    [(self.inputs, self.kwargs)],
                    prepare=lambda batch: batch,
                    progress=False,
                    layout=self.layout,
                    step=self.step,
                )
            return self._survey

    def gradients(self, sample: int) -> xr.DataArray:
        """``d ||output|| / d a_ij`` of every weight of :meth:`capture` of one sample
        (:func:`attnpanel.interventions.gradients.attention_gradients`); the last few are
        kept."""

        def compute():
            inputs, kwargs = self.one(sample)
            return attention_gradients(self.model, *inputs, trace=self.capture(sample), **kwargs)

        return self._gradients.get(sample, compute)

    def importance_forwards(self, sample: int) -> list[Callable[[], np.ndarray]]:
        """The forwards :meth:`importance` of ``sample`` runs, one call each (kept once
        run): work done ahead, a piece at a time, while a served page is idle."""
        calls = [partial(self.prediction, sample)]
        for layer, count in self.heads().items():
            calls += [partial(self.prediction, sample, {layer: [head]}) for head in range(count)]
        return calls

    def importance(self, sample: int) -> xr.DataArray:
        """Each head's importance for one sample: the relative change of the prediction
        ``||p - p_ablated|| / ||p||`` with that head alone switched off, ``(layer, head)``."""
        heads = self.heads()
        plain = self.prediction(sample)
        table = np.full((len(heads), max(heads.values(), default=0)), np.nan)
        for row, (layer, count) in enumerate(heads.items()):
            for head in range(count):
                ablated = self.prediction(sample, {layer: [head]})
                table[row, head] = relative_change(
                    torch.from_numpy(plain), torch.from_numpy(ablated)
                )
        return xr.DataArray(
            table,
            dims=("layer", "head"),
            coords={"layer": np.array(list(heads), dtype=str), "head": np.arange(table.shape[1])},
            name="importance",
            attrs={
                "method": "ablation",
                "how": "zero",
                "measure": "||p - p_ablated|| / ||p|| (the prediction)",
                "sample": sample,
            },
        )

    # why a head attends: a cell's score split over the input

    def why(self, cell: Cell, baseline: str = "zeros", steps: int = STEPS) -> xr.DataArray:
        """The score of one cell split over the input's channels and positions, query side
        and key side (:func:`attnpanel.score_attribution`); the last few are kept."""
        return self._attributions.get(
            (cell, baseline, steps),
            lambda: explain_cell(score_attribution, self.model, *self.one(cell.sample), cell,
                                 baseline=baseline, steps=steps, channels=self.channels),
        )  # fmt: skip

    # patching between a clean and a corrupted input

    def positions(self) -> int | None:
        """The positions of the first input where a span of it can be replaced: a floating
        ``(batch, position)`` or ``(batch, position, feature)`` sequence; else None."""
        first = self.inputs[0] if self.inputs else None
        if torch.is_tensor(first) and first.is_floating_point() and first.dim() in (2, 3):
            return int(first.shape[1])
        return None

    def corruption_names(self) -> list[str]:
        """The corrupted inputs the page offers: the model's own, another sample, and a span
        replaced where the first input is a floating sequence."""
        names = [c.name for c in self.corruptions]
        if self.batch > 1:
            names.append(ANOTHER_SAMPLE)
        if self.positions() is not None:
            names += [SPAN_MEAN, SPAN_ZEROS]
        return names

    def score_words(self, how: Patching) -> str:
        """What the score whose difference the heads share is, in the user's words."""
        named = {c.name: c for c in self.corruptions}
        return named[how.how].score_words if how.how in named else "‖output‖"

    def corrupted(self, sample: int, how: Patching) -> tuple[tuple, dict, Callable | None]:
        """The corrupted inputs of ``sample`` and the score their difference is measured by."""
        named = {c.name: c for c in self.corruptions}
        if how.how in named:
            args, kwargs = named[how.how].make(sample)
            return args, kwargs, named[how.how].score
        if how.how == ANOTHER_SAMPLE:
            if how.other == sample:
                raise PatchingError("the other sample is the shown one: there is no difference")
            args, kwargs = self.one(how.other)
            return args, kwargs, None
        if how.how in (SPAN_MEAN, SPAN_ZEROS):
            args, kwargs = self.one(sample)
            fill = "mean" if how.how == SPAN_MEAN else "zeros"
            return (replace_span(args[0], *how.span, fill), *args[1:]), kwargs, None
        raise PatchingError(f"no corrupted input {how.how!r}; there are {self.corruption_names()}")

    def describe(self, sample: int, how: Patching) -> str:
        """The corrupted input in words: "sample 1 without the kettle", "sample 3"."""
        if how.how == ANOTHER_SAMPLE:
            return f"sample {how.other}"
        if how.how in (SPAN_MEAN, SPAN_ZEROS):
            fill = "their mean" if how.how == SPAN_MEAN else "zeros"
            first, last = how.span[0], how.span[1] - 1  # the stop is not replaced
            return f"sample {sample} with positions {first}-{last} replaced by {fill}"
        return f"sample {sample} {how.how}"

    def _pair(self, args: tuple, kwargs: dict):
        if args and kwargs:
            raise PatchingError(
                "the model takes positional and keyword inputs at once; patching takes one kind"
            )
        return kwargs if kwargs else args

    def patching(self, sample: int, how: Patching) -> xr.DataArray:
        """Each head's patching effect on ``sample``'s prediction, ``(layer, head)``: the
        share of the clean-corrupted difference of the score that patching its ``what``
        from the clean run into the corrupted run restores; kept per request."""

        def compute():
            args, kwargs, score = self.corrupted(sample, how)
            clean = self._pair(*self.one(sample))
            found = patching_effect(
                self.model, clean, self._pair(args, kwargs), score=score, what=how.what,
                progress=False,
            )  # fmt: skip
            return found.assign_attrs(sample=sample, corrupted=self.describe(sample, how))

        return self._effects.get(("effect", sample, how), compute)

    def patched(self, sample: int, how: Patching, layer: str, head: int) -> np.ndarray:
        """The prediction on the corrupted input with one head's ``what`` patched from the
        clean run, ``(series, position)``."""

        def compute():
            args, kwargs, _ = self.corrupted(sample, how)
            clean = self._pair(*self.one(sample))
            with torch.no_grad(), patch(self.model, clean, {layer: [head]}, what=how.what):
                output = self.model(*args, **kwargs)
            return self._series(output)

        return self._effects.get(("patched", sample, how, layer, head), compute)

    def corrupted_prediction(self, sample: int, how: Patching) -> np.ndarray:
        """The prediction on the corrupted input, ``(series, position)``."""

        def compute():
            args, kwargs, _ = self.corrupted(sample, how)
            with torch.no_grad(), ablate(self.model, {}):  # the patched forwards' path
                output = self.model(*args, **kwargs)
            return self._series(output)

        return self._effects.get(("corrupted", sample, how), compute)

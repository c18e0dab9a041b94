"""Your model on your recordings: windows, a recipe and a model as one object.

:class:`RecordingModel` runs the model on every window through its recipe and gives what
the page, the command line and the methods above take: the predictions and the truth in
units, the metrics researchers report (per target, per house, per window and over the
set: :meth:`RecordingModel.evaluate`), the corrupted inputs "this window without <channel>"
(the input minus that submeter), and a :class:`~attnpanel.interventions.model_run.ModelRun`
for the explorer's head toggles and patching.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import xarray as xr
from torch import nn

from attnpanel.interventions.importance import output_tensor
from attnpanel.interventions.model_run import Corruption, ModelRun
from attnpanel.series import metrics as scores
from attnpanel.series.recipes import Recipe, RecipeError
from attnpanel.series.windows import READINGS

BATCH = 64  # windows per forward


def without_channel(windows: xr.Dataset, channel: str) -> xr.Dataset:
    """The windows with one submeter taken out of the input: input - channel, at least 0."""
    names = [str(c) for c in windows["channel"].values]
    if channel not in names or channel == windows.attrs["input"]:
        others = [n for n in names if n != windows.attrs["input"]]
        raise RecipeError(f"no submeter {channel!r} to take out; there are {', '.join(others)}")
    readings = windows[READINGS].copy()
    input_name = windows.attrs["input"]
    taken = (readings.sel(channel=input_name) - readings.sel(channel=channel)).clip(min=0.0)
    readings.loc[{"channel": input_name}] = taken
    return windows.assign({READINGS: readings})


@dataclass(eq=False)
class RecordingModel:
    """A model, its recipe and the windows it is shown.

    Parameters
    ----------
    model : torch.nn.Module
        The model (eval mode).
    recipe : Recipe
        How a window becomes its inputs and its output series in units.
    windows : xarray.Dataset
        What :func:`attnpanel.series.windows_of` cut.
    thresholds : mapping of str to float, optional
        The on-state threshold of each target in units (the on-state metrics need one).
    """

    model: nn.Module
    recipe: Recipe
    windows: xr.Dataset
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.recipe.check(self.windows)
        self._predictions: np.ndarray | None = None

    @property
    def targets(self) -> list[str]:
        return list(self.recipe.targets)

    def inputs(self, windows: xr.Dataset | None = None) -> tuple[tuple, dict]:
        """The model's inputs for every window (or for ``windows``)."""
        return self.recipe.inputs(self.windows if windows is None else windows)

    def _forward(self, windows: xr.Dataset) -> np.ndarray:
        args, kwargs = self.recipe.inputs(windows)
        with torch.no_grad():
            output = self.model(*args, **kwargs)
        return self.recipe.outputs(output, windows)

    def predictions(self) -> np.ndarray:
        """``(window, target, position)`` in units, every window, computed once."""
        if self._predictions is None:
            count = self.windows.sizes["window"]
            parts = [
                self._forward(self.windows.isel(window=slice(start, start + BATCH)))
                for start in range(0, count, BATCH)
            ]
            self._predictions = np.concatenate(parts, axis=0)
        return self._predictions

    def truth(self) -> np.ndarray:
        """The targets' readings, ``(window, target, position)`` in units."""
        return self.recipe.truth(self.windows)

    def evaluate(self, periods=("D", "W", "ME")) -> pd.DataFrame:
        """Every metric, one row each: ``target``, ``house`` (``all`` over every house),
        ``window`` (``all`` over the set), ``scope`` (``window``, ``set`` or the energy
        period ``D`` / ``W`` / ``ME``), ``metric``, ``value``."""
        prediction, truth = self.predictions(), self.truth()
        houses = self.windows["house"].values.astype(str)
        time = self.windows["time"].values
        rows = []
        for t, target in enumerate(self.targets):
            threshold = self.thresholds.get(target)

            def add(house, window, scope, found, target=target):
                rows.extend(
                    {"target": target, "house": house, "window": window, "scope": scope,
                     "metric": name, "value": value}
                    for name, value in found.items()
                )  # fmt: skip

            for w in range(len(houses)):
                add(
                    houses[w],
                    str(w),
                    "window",
                    scores.nilm(truth[w, t], prediction[w, t], threshold),
                )
            for house in ["all", *sorted(set(houses))]:
                chosen = np.ones(len(houses), bool) if house == "all" else houses == house
                y, y_hat = truth[chosen, t], prediction[chosen, t]
                add(house, "all", "set", scores.nilm(y, y_hat, threshold))
                for period in periods:
                    add(house, "all", period, scores.energy(
                        y, y_hat, time[chosen], np.repeat(houses[chosen], y.shape[-1]), period
                    ))  # fmt: skip
        return pd.DataFrame(rows)

    def submeters(self) -> list[str]:
        """The channels that can be taken out of the input."""
        return [str(c) for c in self.windows["channel"].values if c != self.windows.attrs["input"]]

    def without(self, channel: str) -> Corruption:
        """The corrupted input "without <channel>", scored by the predicted targets' sum."""
        without_channel(self.windows.isel(window=[0]), channel)  # a channel not there: now

        def make(sample: int) -> tuple[tuple, dict]:
            one = without_channel(self.windows.isel(window=[sample]), channel)
            return self.recipe.inputs(one)

        def score(output) -> torch.Tensor:
            return output_tensor(output).double().sum()

        return Corruption(f"without {channel}", make, score, "the predicted targets' sum")

    def model_run(self, layers=()) -> ModelRun:
        """The model at hand for the explorer: head toggles re-run it and the page draws
        each target's prediction in units; its metrics per target; patching between a
        window and the same window without each submeter."""
        args, kwargs = self.inputs()
        windows = self.windows

        def predict(output) -> np.ndarray:
            return self.recipe.outputs(output, windows.isel(window=[0]))

        def metrics(prediction: np.ndarray, truth: np.ndarray) -> dict[str, float]:
            found = {}
            for t, target in enumerate(self.targets):
                one = scores.nilm(truth[t], prediction[t], self.thresholds.get(target))
                found[f"MAE {target} ({windows.attrs['units']})"] = one["MAE"]
                if "F1" in one:
                    found[f"F1 {target}"] = one["F1"]
            return found

        return ModelRun(
            self.model, args, kwargs, layers=list(layers), predict=predict, metrics=metrics,
            series=self.targets, corruptions=[self.without(c) for c in self.submeters()],
        )  # fmt: skip

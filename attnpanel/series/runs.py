"""Your model on your recordings: windows, a recipe and a model as one object.

:class:`RecordingModel` runs the model on every window through its recipe and gives what
the page, the command line and the methods above take: the predictions and the truth in
units, the metrics researchers report (per target, per house, per window and over the
set: :meth:`RecordingModel.evaluate`), the corrupted inputs "this window without <channel>"
(the input minus that submeter), and a :class:`~attnpanel.interventions.model_run.ModelRun`
for the explorer's head toggles and patching.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from attnpanel.series.windows import READINGS, step_seconds

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

    def subset(self, windows: slice | Sequence[int]) -> RecordingModel:
        """The same model and recipe on some of the windows."""
        return RecordingModel(
            self.model, self.recipe, self.windows.isel(window=windows), self.thresholds
        )

    def trace(self, windows: slice | Sequence[int] | None = None) -> xr.Dataset | xr.DataTree:
        """Every attention of the model on ``windows`` (every window by default), with each
        position's time in the recording's zone, the recipe's named tokens named, and the
        reference series in units: the input as ``signal``, the targets as ``truth`` and the
        model's ``prediction`` (NaN at named tokens, which have no reading)."""
        from attnpanel.capturing.capture import capture

        chosen = self.windows if windows is None else self.windows.isel(window=windows)
        args, kwargs = self.recipe.inputs(chosen)
        zone = chosen.attrs.get("time_zone", "UTC")
        with torch.no_grad():
            found = capture(
                self.model, *args, time=chosen["time"].values, layout=self.recipe.position_layout(),
                **kwargs,
            )  # fmt: skip
        units = chosen.attrs["units"]
        series = {"series": np.array(self.targets, dtype=object)}
        dims = ("batch", "series", "position")
        reference = {
            "signal": xr.DataArray(
                self.recipe.on_positions(self.recipe.signal(chosen)),
                dims=("batch", "position"),
                attrs={"long_name": f"{chosen.attrs['input']} power", "units": units},
            ),
            "truth": xr.DataArray(
                self.recipe.on_positions(self.recipe.truth(chosen)), dims=dims, coords=series,
                attrs={"long_name": "target power", "units": units},
            ),
            "prediction": xr.DataArray(
                self.recipe.on_positions(self._forward(chosen)), dims=dims,
                coords=series, attrs={"long_name": "predicted target power", "units": units},
            ),
        }  # fmt: skip

        def dressed(ds: xr.Dataset) -> xr.Dataset:
            ds = ds.assign(reference)
            ds.attrs["time_zone"] = zone  # the page reads the house's own clock
            return ds

        if isinstance(found, xr.DataTree):
            return found.map_over_datasets(dressed)
        return dressed(found)

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

        def predict(output) -> np.ndarray:  # over the trace's positions: NaN at its tokens
            return self.recipe.on_positions(self.recipe.outputs(output, windows.isel(window=[0])))

        def metrics(prediction: np.ndarray, truth: np.ndarray) -> dict[str, float]:
            found = {}
            for t, target in enumerate(self.targets):
                steps = np.isfinite(truth[t])  # a named token has no reading
                one = scores.nilm(
                    truth[t][steps], prediction[t][steps], self.thresholds.get(target)
                )
                found[f"MAE {target} ({windows.attrs['units']})"] = one["MAE"]
                if "F1" in one:
                    found[f"F1 {target}"] = one["F1"]
            return found

        return ModelRun(
            self.model, args, kwargs, layers=list(layers), predict=predict, metrics=metrics,
            series=self.targets, corruptions=[self.without(c) for c in self.submeters()],
            layout=self.recipe.position_layout(), step=step_seconds(windows),
        )  # fmt: skip

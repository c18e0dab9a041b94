"""The recipe of the reference NILMFormer (Petralia et al., KDD 2025, its official code).

Its interface, as its ``NILMDataset`` and ``NILMscaler`` build it:

- input ``(B, 1 + 2E, L)``: channel 0 the mains divided by one maximum in W (``MaxScaling``,
  fitted on the training houses after clipping; the scale is not saved with the weights:
  give ``scale``, or read the JSON :meth:`Recipe.save` writes);
- then, for each clock feature of the window's timestamps in order, its sine and cosine:
  ``minute/60``, ``hour/24``, ``dow/7`` (Monday 0), ``month/12`` and ``dom/31`` (January
  and the 1st are 1: nothing is subtracted, as ``NILMDataset`` does; its
  ``TSDatasetScaling`` subtracts 1 and a model trained with it needs ``subtract_one``);
  the default features are minute, hour, dow, month: E = 4, 8 channels;
- output ``(B, 1, L)`` of one target in the same scale; negative power is set to 0 as its
  evaluation does;
- the model appends one statistics token (the window's mean and std), so its attention is
  over L + 1 positions, the token last: :attr:`tokens_after`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import xarray as xr

from attnpanel.series.recipes import Recipe, RecipeError, output_values, recipe
from attnpanel.series.windows import READINGS

PERIODS = {"minute": 60.0, "hour": 24.0, "dow": 7.0, "month": 12.0, "dom": 31.0}
DEFAULT_FEATURES = ("minute", "hour", "dow", "month")
STATISTICS_TOKEN = "statistics"  # the name of the position NILMFormer appends


def clock_values(times: pd.DatetimeIndex, feature: str, subtract_one: bool = False) -> np.ndarray:
    """The raw clock value of each timestamp (minute, hour, weekday Monday 0, month 1-12,
    day of month 1-31; month and day minus one where ``subtract_one``)."""
    if feature == "minute":
        return times.minute.to_numpy()
    if feature == "hour":
        return times.hour.to_numpy()
    if feature == "dow":
        return times.day_of_week.to_numpy() - (1 if subtract_one else 0)
    if feature == "month":
        return times.month.to_numpy() - (1 if subtract_one else 0)
    if feature == "dom":
        return times.day.to_numpy() - (1 if subtract_one else 0)
    raise RecipeError(f"no clock feature {feature!r}; there are {', '.join(PERIODS)}")


def clock_features(
    time: np.ndarray, features: Sequence[str] = DEFAULT_FEATURES, zone: str = "UTC",
    subtract_one: bool = False,
) -> np.ndarray:  # fmt: skip
    """``(window, 2E, position)`` float32: sine and cosine of each feature, in order, of the
    UTC timestamps ``time`` ``(window, position)`` read in ``zone``."""
    time = np.asarray(time)
    stamps = pd.DatetimeIndex(time.ravel()).tz_localize("UTC").tz_convert(zone)
    rows = []
    for feature in features:
        angle = 2 * np.pi * clock_values(stamps, feature, subtract_one) / PERIODS[feature]
        rows += [np.sin(angle), np.cos(angle)]
    return np.stack(rows).reshape(len(rows), *time.shape).swapaxes(0, 1).astype(np.float32)


@recipe("nilmformer")
@dataclass
class NILMFormerRecipe(Recipe):
    """NILMFormer's inputs and outputs (module docstring)."""

    scale: float | None = None  # W: the MaxScaling maximum the model was trained with
    clip: float | None = None  # W: the mains clipped here before scaling (6000 UK-DALE)
    features: Sequence[str] = DEFAULT_FEATURES  # clock features, in the model's order
    zone: str = "UTC"  # the clock the features are read in
    subtract_one: bool = False  # TSDatasetScaling's rule instead of NILMDataset's

    tokens_after: tuple[str, ...] = field(default=(STATISTICS_TOKEN,), init=False)

    def __post_init__(self):
        self.targets, self.features = tuple(self.targets), tuple(self.features)
        if self.scale is None:
            raise RecipeError(
                "the nilmformer recipe needs the scale the model was trained with "
                "(--scale W, or a recipe JSON)"
            )
        if not self.scale > 0 or not np.isfinite(self.scale):
            raise RecipeError(f"scale must be a positive number of W, got {self.scale}")
        unknown = [f for f in self.features if f not in PERIODS]
        if unknown:
            raise RecipeError(
                f"no clock feature {', '.join(unknown)}; there are {', '.join(PERIODS)}"
            )
        if len(self.targets) != 1:
            raise RecipeError(
                f"a NILMFormer predicts one target (c_out = 1); name one, not {len(self.targets)}"
            )

    @classmethod
    def fitted(cls, windows: xr.Dataset, clip: float | None = None, **options):
        """The recipe with the scale fitted as ``NILMscaler`` does: the maximum of the
        (clipped) mains over ``windows`` (the training windows)."""
        mains = windows[READINGS].sel(channel=windows.attrs["input"]).values
        if clip is not None:
            mains = np.clip(mains, 0, clip)
        return cls(scale=float(np.max(mains)), clip=clip, **options)

    def input_channels(self) -> list[str]:
        names = ["mains / scale"]
        for feature in self.features:
            names += [f"sin {feature}", f"cos {feature}"]
        return names

    def inputs(self, windows: xr.Dataset) -> tuple[tuple, dict]:
        self.check(windows)
        mains = self.signal(windows)
        if self.clip is not None:
            mains = np.clip(mains, 0, self.clip)
        clock = clock_features(windows["time"].values, self.features, self.zone, self.subtract_one)
        x = np.concatenate([(mains / self.scale)[:, None].astype(np.float32), clock], axis=1)
        return (torch.from_numpy(np.ascontiguousarray(x)),), {}  # (B, 1 + 2E, L)

    def outputs(self, output, windows: xr.Dataset) -> np.ndarray:
        found = output_values(output)
        expected = (windows.sizes["window"], 1, windows.sizes["position"])
        if found.shape[1:] != expected[1:]:
            raise RecipeError(
                f"a NILMFormer answers (B, 1, L) = (B, 1, {expected[2]}); this model answered "
                f"{tuple(found.shape)}"
            )
        return np.clip(found * self.scale, 0, None)

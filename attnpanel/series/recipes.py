"""Recipes: how a window becomes a model's inputs, and its output series in units.

A model of one's own reads its windows in its own way (channels first or last, scaled,
with clock features) and answers in its own scale. A :class:`Recipe` says both directions
for one kind of model, so that the page, the command line and every method above take
windows in units and give series in units. Recipes register by name (:func:`recipe`);
:func:`make_recipe` builds one from its name and options, :func:`read_recipe` from the
small JSON a recipe writes (:meth:`Recipe.save`), so that the scale a model was trained
with travels beside its checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from attnpanel.interventions.importance import output_tensor
from attnpanel.series.windows import READINGS
from attnpanel.traces.positions import Layout

_RECIPES: dict[str, type[Recipe]] = {}


class RecipeError(ValueError):
    """A recipe that does not fit the windows or the model: the message says which part."""


def recipe(name: str):
    """Register a :class:`Recipe` subclass under ``name``."""

    def register(cls):
        cls.name = name
        _RECIPES[name] = cls
        return cls

    return register


def recipes() -> list[str]:
    """The registered recipes' names."""
    return sorted(_RECIPES)


def make_recipe(name: str, **options) -> Recipe:
    """The recipe ``name`` with its options (those it does not take are refused)."""
    if name not in _RECIPES:
        raise RecipeError(f"no recipe {name!r}; there are {', '.join(recipes())}")
    cls = _RECIPES[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise RecipeError(f"the {name} recipe takes no {', '.join(unknown)}")
    return cls(**options)


def read_recipe(path: str | Path, **overrides) -> Recipe:
    """A recipe from the JSON :meth:`Recipe.save` wrote (plain data: JSON, never code),
    with ``overrides`` of its options (checked as :func:`make_recipe` checks them)."""
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise RecipeError(f"cannot read a recipe from {path}: {error}") from None
    if not isinstance(found, dict) or "recipe" not in found:
        raise RecipeError(f"{path} is not a recipe file (no 'recipe' key)")
    name = found.pop("recipe")
    return make_recipe(name, **{**found, **overrides})


@dataclass
class Recipe:
    """The two directions between windows and one kind of model.

    Subclasses set the fields they need and override :meth:`inputs`, :meth:`outputs`,
    :meth:`input_channels` and, where the model adds positions of its own (a statistics
    token, a CLS token), :attr:`tokens_after` / :attr:`tokens_before`.
    """

    name = "recipe"
    targets: Sequence[str] = ()  # the channels the model predicts, in its output's order

    tokens_before: tuple[str, ...] = field(default=(), init=False)  # named positions first
    tokens_after: tuple[str, ...] = field(default=(), init=False)  # ... and last

    def position_layout(self) -> Layout:
        """Where the model's positions lie over a window's steps (its named tokens)."""
        return Layout(before=self.tokens_before, after=self.tokens_after)

    def on_positions(self, values: np.ndarray) -> np.ndarray:
        """Series over a window's steps ``(..., L)`` over the model's positions: NaN at
        its named tokens (they have no reading)."""
        lead = values.shape[:-1]
        before = np.full(lead + (len(self.tokens_before),), np.nan)
        after = np.full(lead + (len(self.tokens_after),), np.nan)
        return np.concatenate([before, values, after], axis=-1)

    def reads(self, windows: xr.Dataset) -> list[str]:
        """The channels of the windows the model's inputs are made of (the input)."""
        return [windows.attrs["input"]]

    def check(self, windows: xr.Dataset) -> None:
        """Refuse windows that lack a channel the recipe reads or predicts."""
        present = [str(c) for c in windows["channel"].values]
        wanted = dict.fromkeys([*self.reads(windows), *self.targets])
        missing = [c for c in wanted if c not in present]
        if missing:
            raise RecipeError(
                f"the windows have no channel {', '.join(map(repr, missing))}; they have "
                f"{', '.join(present)}"
            )

    def inputs(self, windows: xr.Dataset) -> tuple[tuple, dict]:
        """The model's ``(args, kwargs)`` for every window, the batch first."""
        raise NotImplementedError

    def outputs(self, output, windows: xr.Dataset) -> np.ndarray:
        """The model's output as ``(window, target, position)`` in the windows' units."""
        raise NotImplementedError

    def input_channels(self) -> list[str]:
        """The names of the model's input channels, in its order."""
        raise NotImplementedError

    def truth(self, windows: xr.Dataset) -> np.ndarray:
        """The targets' readings, ``(window, target, position)`` in units."""
        self.check(windows)
        return windows[READINGS].sel(channel=list(self.targets)).values.astype(np.float64)

    def signal(self, windows: xr.Dataset) -> np.ndarray:
        """The input channel's readings, ``(window, position)`` in units."""
        return windows[READINGS].sel(channel=windows.attrs["input"]).values.astype(np.float64)

    def save(self, path: str | Path) -> None:
        """Write the recipe as JSON beside a checkpoint (:func:`read_recipe` reads it)."""
        data = {"recipe": self.name, **{k: _plain(v) for k, v in asdict(self).items()}}
        for key in ("tokens_before", "tokens_after"):
            data.pop(key, None)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def output_values(output) -> np.ndarray:
    """A model's output tensor (its first, as the interventions read it) as float64 numbers."""
    try:
        return output_tensor(output).detach().double().cpu().numpy()
    except TypeError as error:
        raise RecipeError(str(error)) from None


@recipe("generic")
@dataclass
class GenericRecipe(Recipe):
    """A model that takes ``(B, L, C)`` (``layout="BLC"``) or ``(B, C, L)`` (``"BCL"``) of
    the named channels divided by ``scale``, and answers ``(B, L, T)`` / ``(B, T, L)`` /
    ``(B, L)`` of its targets in the same scale."""

    channels: Sequence[str] = ()  # the input channels, default the windows' input alone
    layout: str = "BLC"  # BLC: channels last; BCL: channels first (its output likewise)
    scale: float = 1.0  # readings are divided by it on the way in, multiplied on the way out

    def __post_init__(self):
        self.targets, self.channels = tuple(self.targets), tuple(self.channels)
        if self.layout not in ("BLC", "BCL"):
            raise RecipeError(f"layout is BLC or BCL, not {self.layout!r}")
        if not self.scale or not np.isfinite(self.scale):
            raise RecipeError(f"scale must be a finite non-zero number, got {self.scale}")

    def reads(self, windows: xr.Dataset) -> list[str]:
        return list(self.channels) or [windows.attrs["input"]]

    def input_channels(self) -> list[str]:
        return list(self.channels) or ["input"]

    def inputs(self, windows: xr.Dataset) -> tuple[tuple, dict]:
        self.check(windows)
        values = windows[READINGS].sel(channel=self.reads(windows)).values / self.scale  # (W, C, L)
        values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        return ((values if self.layout == "BCL" else values.transpose(1, 2).contiguous()),), {}

    def outputs(self, output, windows: xr.Dataset) -> np.ndarray:
        found = output_values(output) * self.scale
        length = windows.sizes["position"]
        if found.ndim == 2:
            found = found[:, None, :]
        elif found.ndim == 3 and self.layout == "BLC":
            found = np.swapaxes(found, 1, 2)
        if found.ndim != 3 or found.shape[2] != length:
            raise RecipeError(
                f"the model's output has shape {found.shape}; the {self.layout} recipe expects "
                f"{length} positions per window"
            )
        return found

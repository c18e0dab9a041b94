"""Your model on your recordings: the files researchers keep (UK-DALE, REFIT, NILMTK's
HDF5, CSV, Parquet, a DataFrame) read into houses of channels, put on one clock and cut into
windows with their timestamps; recipes that turn a window into a model's inputs and its
output into series in units; the metrics NILM and forecasting papers report."""

from attnpanel.series import readers  # noqa: F401  (each format registers itself)
from attnpanel.series.metrics import energy, forecast, nilm, on_state, regression
from attnpanel.series.models import (
    ModelError,
    load_checkpoint,
    load_factory,
    make_model,
    read_state,
)
from attnpanel.series.nilmformer import NILMFormerRecipe, clock_features
from attnpanel.series.recipes import (
    GenericRecipe,
    Recipe,
    RecipeError,
    make_recipe,
    read_recipe,
    recipe,
    recipes,
)
from attnpanel.series.recordings import (
    Recording,
    RecordingError,
    Recordings,
    formats,
    read_recordings,
    reader,
)
from attnpanel.series.runs import RecordingModel, without_channel
from attnpanel.series.windows import by_date, by_house, resampled, windows_of

__all__ = [
    "GenericRecipe",
    "ModelError",
    "NILMFormerRecipe",
    "Recipe",
    "RecipeError",
    "Recording",
    "RecordingError",
    "RecordingModel",
    "Recordings",
    "by_date",
    "by_house",
    "clock_features",
    "energy",
    "forecast",
    "formats",
    "load_checkpoint",
    "load_factory",
    "make_model",
    "make_recipe",
    "nilm",
    "on_state",
    "read_recipe",
    "read_recordings",
    "read_state",
    "reader",
    "recipe",
    "recipes",
    "regression",
    "resampled",
    "windows_of",
    "without_channel",
]

"""attnpanel: an interactive explorer for multi-head self-attention at full resolution."""

from attnpanel.capturing.capture import FusedQKV, capture
from attnpanel.capturing.recorder import CaptureError
from attnpanel.interventions.effects import patching_effect
from attnpanel.interventions.gate import AblationError, ablate, attention_heads
from attnpanel.interventions.gradients import attention_gradients
from attnpanel.interventions.importance import head_importance
from attnpanel.interventions.model_run import Corruption, ModelRun
from attnpanel.interventions.patching import PatchingError, patch
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.kernels.masks import build_mask
from attnpanel.nilm.demo import demo, head_statistics
from attnpanel.nilm.power import PowerConfig
from attnpanel.nilm.power import generate as generate_power
from attnpanel.readouts.compare import compare
from attnpanel.readouts.embedding import qk_embedding
from attnpanel.readouts.flow import rollout, value_weighted
from attnpanel.readouts.positional import head_average, sinusoidal_encoding
from attnpanel.series.recipes import make_recipe, read_recipe
from attnpanel.series.recordings import read_recordings
from attnpanel.series.runs import RecordingModel
from attnpanel.series.windows import windows_of
from attnpanel.surveys.roles import head_roles
from attnpanel.surveys.survey import survey
from attnpanel.traces.build import build_trace, trace
from attnpanel.traces.io import load, save
from attnpanel.traces.positions import Layout, Positions
from attnpanel.traces.stages import attention_stage, recompute_weights
from attnpanel.traces.validate import validate

__all__ = [
    "AblationError",
    "AttentionExplorer",
    "CaptureError",
    "Corruption",
    "FusedQKV",
    "Layout",
    "ModelRun",
    "MultiHeadSelfAttention",
    "PatchingError",
    "Positions",
    "PowerConfig",
    "RecordingModel",
    "ablate",
    "attention_gradients",
    "attention_heads",
    "attention_stage",
    "build_mask",
    "build_trace",
    "capture",
    "compare",
    "demo",
    "explore",
    "generate_power",
    "head_average",
    "head_importance",
    "head_roles",
    "head_statistics",
    "load",
    "make_recipe",
    "patch",
    "patching_effect",
    "qk_embedding",
    "read_recipe",
    "read_recordings",
    "recompute_weights",
    "rollout",
    "save",
    "sinusoidal_encoding",
    "survey",
    "trace",
    "validate",
    "value_weighted",
    "windows_of",
]
__version__ = "0.1.0"


def __getattr__(name):
    # The explorer and explore() need panel; importing them lazily keeps ``import attnpanel``
    # (and every compute module) free of panel, holoviews and bokeh.
    if name == "AttentionExplorer":
        from attnpanel.app.explorer import AttentionExplorer

        return AttentionExplorer
    if name == "explore":
        from attnpanel.app.explore import explore

        return explore
    raise AttributeError(f"module 'attnpanel' has no attribute {name!r}")

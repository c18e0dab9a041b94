"""attnpanel: an interactive explorer for multi-head self-attention at full resolution.

Every public name is imported when first used (PEP 562): ``import attnpanel`` and the
command line's light commands (``attnpanel figure``, ``info``) do not import torch,
panel, holoviews or bokeh until a name that needs them is read (``import attnpanel``
took 3.0 s here, most of it torch).
"""

import importlib

# public name -> (module, name in it)
_PUBLIC = {
    "ablate": ("attnpanel.interventions.gate", "ablate"),
    "AblationError": ("attnpanel.interventions.gate", "AblationError"),
    "attention_gradients": ("attnpanel.interventions.gradients", "attention_gradients"),
    "attention_heads": ("attnpanel.interventions.gate", "attention_heads"),
    "attention_stage": ("attnpanel.traces.stages", "attention_stage"),
    "AttributionError": ("attnpanel.interventions.attribution", "AttributionError"),
    "AttentionExplorer": ("attnpanel.app.explorer", "AttentionExplorer"),
    "build_mask": ("attnpanel.kernels.masks", "build_mask"),
    "build_trace": ("attnpanel.traces.build", "build_trace"),
    "capture": ("attnpanel.capturing.capture", "capture"),
    "circuits": ("attnpanel.readouts.circuits", "circuits"),
    "CaptureError": ("attnpanel.capturing.recorder", "CaptureError"),
    "compare": ("attnpanel.readouts.compare", "compare"),
    "Corruption": ("attnpanel.interventions.model_run", "Corruption"),
    "demo": ("attnpanel.nilm.demo", "demo"),
    "explore": ("attnpanel.app.explore", "explore"),
    "FusedQKV": ("attnpanel.capturing.capture", "FusedQKV"),
    "generate_power": ("attnpanel.nilm.power", "generate"),
    "head_average": ("attnpanel.readouts.positional", "head_average"),
    "head_importance": ("attnpanel.interventions.importance", "head_importance"),
    "head_roles": ("attnpanel.surveys.roles", "head_roles"),
    "head_statistics": ("attnpanel.nilm.demo", "head_statistics"),
    "Layout": ("attnpanel.traces.positions", "Layout"),
    "load": ("attnpanel.traces.io", "load"),
    "make_recipe": ("attnpanel.series.recipes", "make_recipe"),
    "ModelRun": ("attnpanel.interventions.model_run", "ModelRun"),
    "MultiHeadSelfAttention": ("attnpanel.kernels.attention", "MultiHeadSelfAttention"),
    "patch": ("attnpanel.interventions.patching", "patch"),
    "patching_effect": ("attnpanel.interventions.effects", "patching_effect"),
    "PatchingError": ("attnpanel.interventions.patching", "PatchingError"),
    "Positions": ("attnpanel.traces.positions", "Positions"),
    "PowerConfig": ("attnpanel.nilm.power", "PowerConfig"),
    "qk_embedding": ("attnpanel.readouts.embedding", "qk_embedding"),
    "read_recipe": ("attnpanel.series.recipes", "read_recipe"),
    "read_recordings": ("attnpanel.series.recordings", "read_recordings"),
    "recompute_weights": ("attnpanel.traces.stages", "recompute_weights"),
    "RecordingModel": ("attnpanel.series.runs", "RecordingModel"),
    "rollout": ("attnpanel.readouts.flow", "rollout"),
    "save": ("attnpanel.traces.io", "save"),
    "score_attribution": ("attnpanel.interventions.attribution", "score_attribution"),
    "component_attribution": ("attnpanel.interventions.components", "component_attribution"),
    "sinusoidal_encoding": ("attnpanel.readouts.positional", "sinusoidal_encoding"),
    "survey": ("attnpanel.surveys.survey", "survey"),
    "trace": ("attnpanel.traces.build", "trace"),
    "validate": ("attnpanel.traces.validate", "validate"),
    "value_weighted": ("attnpanel.readouts.flow", "value_weighted"),
    "windows_of": ("attnpanel.series.windows", "windows_of"),
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name):
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'attnpanel' has no attribute {name!r}") from None
    found = getattr(importlib.import_module(module), attribute)
    globals()[name] = found  # once: later reads find it as a plain attribute
    return found


def __dir__():
    return sorted({*globals(), *_PUBLIC})

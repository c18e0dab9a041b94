"""attnpanel: an interactive explorer for multi-head self-attention at full resolution."""

from attnpanel.attention import MultiHeadSelfAttention, build_mask
from attnpanel.capture import CaptureError, FusedQKV, capture
from attnpanel.demo import demo, head_statistics
from attnpanel.io import load, save
from attnpanel.positional import head_average, sinusoidal_encoding
from attnpanel.power import PowerConfig
from attnpanel.power import generate as generate_power
from attnpanel.trace import attention_stage, build_trace, recompute_weights, trace, validate

__all__ = [
    "AttentionExplorer",
    "CaptureError",
    "FusedQKV",
    "MultiHeadSelfAttention",
    "PowerConfig",
    "attention_stage",
    "build_mask",
    "build_trace",
    "capture",
    "demo",
    "generate_power",
    "head_average",
    "head_statistics",
    "load",
    "recompute_weights",
    "save",
    "sinusoidal_encoding",
    "trace",
    "validate",
]
__version__ = "0.1.0"


def __getattr__(name):
    # The explorer needs panel; importing it lazily keeps ``import attnpanel`` (and every
    # compute module) free of panel, holoviews and bokeh.
    if name == "AttentionExplorer":
        from attnpanel.explorer import AttentionExplorer

        return AttentionExplorer
    raise AttributeError(f"module 'attnpanel' has no attribute {name!r}")

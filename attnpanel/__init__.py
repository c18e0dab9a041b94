"""attnpanel: an interactive explorer for multi-head self-attention at full resolution."""

from attnpanel.attention import MultiHeadSelfAttention, build_mask
from attnpanel.io import load, save
from attnpanel.trace import attention_stage, build_trace, recompute_weights, trace, validate

__all__ = [
    "MultiHeadSelfAttention",
    "attention_stage",
    "build_mask",
    "build_trace",
    "load",
    "recompute_weights",
    "save",
    "trace",
    "validate",
]
__version__ = "0.1.0"

"""Serve the attention explorer on the demo trace.

Demonstrates every stage of NILMFormer-style multi-head self-attention on 32 held-out
8-hour windows of household power: ``panel serve apps/main.py``.
Highlights: datashaded 480 x 480 attention, live masking, head toggles, value aggregation.
"""

import panel as pn

from attnpanel.explorer import AttentionExplorer, demo_trace, notify_errors

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)

AttentionExplorer(demo_trace()).servable(title="attnpanel explorer")

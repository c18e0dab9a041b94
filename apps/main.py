"""Serve the attention explorer on the demo trace: ``panel serve apps/main.py``.

Demonstrates every stage of NILMFormer's multi-head self-attention on 32 held-out 8-hour
windows of household power, one layer of the trained demo model.
Highlights: the full 480 x 480 attention rasterized by datashader, masks recomputed live
from q and k, a stage player, head toggles that recompute the output.
"""

import panel as pn

import attnpanel
from attnpanel.explorer import AttentionExplorer, notify_errors

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)

AttentionExplorer(attnpanel.demo()).servable(title="attnpanel explorer")

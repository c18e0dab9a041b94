"""A capture whose every string is a script: the untrusted text that a mailed trace file
or a stranger's model can carry. ``tests/test_untrusted.py`` and ``tests/hostile_app.py``
show it; a real browser must run none of it.

Each payload calls ``alert`` with its own number, so a dialog names what got through.
"""

from __future__ import annotations

import torch
from torch import nn

import attnpanel

SOURCE = "<img src=x onerror=alert(1)><script>alert(2)</script> **bold** [a](javascript:alert(3))"
TOKENS = [
    "<img src=x onerror=alert(4)>",
    "<script>alert(5)</script>",
    "<b>b</b>",
    "[PAD]",
    "<svg onload=alert(6)>",
    "&lt;ok&gt;",
]
LAYER = "<svg onload=alert(7)>"  # a module name: anything but "." and ""
NOTE = "\x1b]0;pwned\x07\x1b[2J<iframe src=javascript:alert(8)>"


class Hostile(nn.Module):
    """One ``nn.MultiheadAttention`` registered under a script-bearing name."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.blocks = nn.ModuleDict({LAYER: nn.MultiheadAttention(dim, heads, batch_first=True)})

    def forward(self, x):
        attention = self.blocks[LAYER]
        return attention(x, x, x)[0]


def hostile_capture():
    """The capture, its ``source`` and a free-form attribute set to script-bearing text."""
    torch.manual_seed(0)
    model = Hostile().eval()
    ds = attnpanel.capture(model, torch.randn(1, len(TOKENS), 16), tokens=[TOKENS])
    return ds.assign_attrs(source=SOURCE, note=NOTE)

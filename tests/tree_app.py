"""A served explorer on a DataTree capture: ``nn.Transformer`` with encoder self-attention,
causal decoder self-attention and cross-attention (7 queries over 10 keys).

Served by ``tests/test_browser_tree.py``; the same model as the zoo's ``torch_transformer``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo import build_torch_transformer  # noqa: E402

import attnpanel  # noqa: E402
from attnpanel.app.explore import explore

model, args, kwargs = build_torch_transformer()
explore(attnpanel.capture(model, *args, **kwargs)).servable(title="attnpanel tree")

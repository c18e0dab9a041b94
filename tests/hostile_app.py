"""The explorer on a capture whose every string is a script (``tests/hostile.py``).

Served by ``tests/test_untrusted.py``: a real browser must show the strings as text and
run none of them.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile import hostile_capture  # noqa: E402

from attnpanel.app.explore import explore

explore(hostile_capture()).servable(title="attnpanel hostile")

"""A served page of the kind its link names (``?kind=text``; tests/page_kinds.py), for the
browser walk of every page kind (``tests/test_browser_kinds.py``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import panel as pn  # noqa: E402
from page_kinds import KINDS  # noqa: E402

kind = pn.state.session_args.get("kind", [b"dense"])[0].decode()
KINDS[kind]().servable(title=f"attnpanel {kind}")

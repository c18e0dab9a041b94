"""The explorer of a small virtual trace whose overviews under another mask take seconds.

Served by ``tests/test_browser_background.py``. At L = 65,536 the overviews of a mask not
stored yet take ~10 s per head; here each one (other than the trace's own diagonal mask's)
waits ``DELAY_S`` first, so that the test can act on the page, and open another session,
while the maps compute. One trace and one set of overviews for every session, as
``attnpanel serve`` shares them.
"""

import sys
import time
from pathlib import Path

import panel as pn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairs import long_layer_pair  # noqa: E402

from attnpanel.app import serving
from attnpanel.app.explorer import notify_errors
from attnpanel.app.long_explorer import LongExplorer
from attnpanel.readouts import windows
from attnpanel.traces import overviews

DELAY_S = 6.0
# windows over 100 x 100 cells are first cut from the overview, then refined (as windows
# of 4,097 to ~32,000 positions are at L = 64,800)
windows.EXACT_CELLS = 100 * 100

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)


def _slow(compute):
    def slow_compute(task):
        if task.mask != "diagonal":
            time.sleep(DELAY_S)
        return compute(task)

    return slow_compute


if not getattr(overviews.compute, "slowed", False):
    overviews.compute = _slow(overviews.compute)
    overviews.compute.slowed = True
trace = serving.shared_trace("long pair", lambda: long_layer_pair()[1])
shared = pn.state.as_cached("attnpanel:long overviews", lambda: overviews.Overviews(trace))
LongExplorer(trace, overviews=shared).servable(title="attnpanel slow overviews")

"""The demo explorer with every uncached change treated as slow (``BUSY_AFTER_S = 0``).

Served by ``tests/test_browser_busy.py``: on this machine the demo's uncached changes redraw
in about 0.1 s, under the threshold of the busy indicator; here the indicator's mechanism
is shown with the threshold at 0, as a trace whose maps take seconds would show it.
"""

import panel as pn

import attnpanel
from attnpanel.app import scheduler, serving
from attnpanel.app.explorer import AttentionExplorer, notify_errors

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)
scheduler.BUSY_AFTER_S = 0.0
trace = serving.shared_trace("demo", attnpanel.demo)
AttentionExplorer(trace).servable(title="attnpanel busy")

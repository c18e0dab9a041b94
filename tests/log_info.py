"""``panel serve ... --setup tests/log_info.py``: the server's log shows attnpanel's INFO lines
(Bokeh's ``--log-level`` sets only Bokeh's own loggers)."""

import logging

logging.getLogger("attnpanel").setLevel(logging.INFO)

"""The floor of ``benchmarks/first_paint.py``: a Panel page with one 480 x 480 map, nothing else.

Served the way ``apps/main.py`` is (the same ``pn.extension`` options): what any Panel page
with one Bokeh image costs this machine and this browser, to read the explorer's figures
against (the machine's speed varies from day to day by up to 2x).
"""

import numpy as np
import panel as pn
from bokeh.plotting import figure

pn.extension(inline=True, notifications=True)
plot = figure(width=480, height=480, title="one 480 x 480 map")
cells = np.random.default_rng(0).random((480, 480), dtype=np.float32)
plot.image([cells], x=0, y=0, dw=480, dh=480, palette="Viridis256")
pn.Column(pn.pane.Markdown("## the floor: one map"), pn.pane.Bokeh(plot)).servable(title="one map")

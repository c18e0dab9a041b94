"""The baseline of ``benchmarks/first_paint.py``: the explorer's views as HoloViews DynamicMaps.

The same views as ``apps/main.py`` (every view the explorer registers, on the same shared
demo trace), each rendered the plain way: ``explorer.dynamic_map(name)`` in a
``pn.pane.HoloViews``, maps rasterized by datashader. What the page would cost built
naively.
"""

import panel as pn

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.serving import shared_trace

pn.extension()
trace = shared_trace("demo", attnpanel.demo)
explorer = AttentionExplorer(trace)
explorer.__panel__()  # the sections register their views
names = [view.name for view in explorer.engine.views if "marker" not in view.name]
pn.Column(
    *[pn.pane.HoloViews(explorer.dynamic_map(name), width=480, height=300) for name in names]
).servable(title="naive DynamicMap page")

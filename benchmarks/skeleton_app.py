"""A row of ``benchmarks/first_paint.py``: the explorer's first page with its data cut away.

Served the way ``apps/main.py`` is (``--warm``, the explorer built ahead for each visitor):
the same page, the same Bokeh models and views, but every data source of its figures cut
to its first two points (an image to 2 x 2 cells); the sections drawn after the first
paint (below the fold) are not cut, and ``benchmarks/first_paint.py`` does not wait for
them on this page. Its first paint is what this page's structure costs (Panel's and
Bokeh's models, views and layout) whatever the data: the explorer cannot come nearer the
floor than this by making its data cheaper.
"""

from functools import partial

import numpy as np
import panel as pn
from bokeh.models import ColumnDataSource

import attnpanel
from attnpanel.app import serving
from attnpanel.app.explorer import AttentionExplorer, notify_errors
from attnpanel.nilm.demo import demo_model_run

pn.extension(inline=True, notifications=True, exception_handler=notify_errors)
serving.release_memory()
serving.skip_document_validation()


def cut(value, np=np):
    """A column's first two entries (an image's first 2 x 2 cells)."""
    if isinstance(value, list):  # a list of images, or of values
        return [v[:2, :2].copy() if isinstance(v, np.ndarray) else v for v in value[:2]]
    if isinstance(value, np.ndarray):
        return value[:2, :2].copy() if value.ndim == 2 else value[:2].copy()
    return value


# (names bound as defaults: Bokeh clears this module's names once a session's script has
# run, and the next explorer is built after that, in a thread)
def skeleton(trace, model, explorer=AttentionExplorer, pn=pn, source=ColumnDataSource, cut=cut):
    """The explorer, every data source of its figures cut to two points."""
    built = explorer.built(trace, model=model)
    for pane in built.lay_out().select(pn.pane.Bokeh):
        for found in pane.object.references():
            if isinstance(found, source):
                found.data = {name: cut(column) for name, column in found.data.items()}
    return built


trace = serving.shared_trace("demo", partial(attnpanel.demo, on_demand=True))
model = serving.shared("attnpanel:demo model", demo_model_run)
page = serving.built_ahead("skeleton", partial(skeleton, trace, model))
page.servable(title="skeleton")

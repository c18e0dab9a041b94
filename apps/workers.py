"""Setup for ``panel serve apps/main.py --num-procs N --setup apps/workers.py``.

Panel runs this in each forked worker: the worker then stops when the server that forked
it stops (Bokeh leaves forked workers running after their parent is stopped).
"""

from tornado.process import task_id

from attnpanel.serving import die_with_parent

if task_id() is not None:  # a forked worker; a single process keeps its usual lifetime
    die_with_parent()

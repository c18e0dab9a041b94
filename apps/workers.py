"""Setup for ``panel serve apps/main.py --num-procs N --setup apps/workers.py``.

Panel runs this in each forked worker: the worker then stops when the server that forked
it stops (Bokeh leaves forked workers running after their parent is stopped), and says so
on the server's log.
"""

from tornado.process import task_id

from attnpanel.app.serving import worker_started

if task_id() is not None:  # a forked worker; a single process keeps its usual lifetime
    worker_started()

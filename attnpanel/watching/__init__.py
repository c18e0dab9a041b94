"""The one way into a running model: which torch calls are attention, which module runs
each (its layer name), and where its q, k, weights, values and head lanes are.

Reading a head (:mod:`attnpanel.capturing`) and writing one (:mod:`attnpanel.interventions`)
are subclasses of :class:`~attnpanel.watching.watcher.AttentionWatcher` that say what to do
at each attention site it finds; neither finds attention on its own.
"""

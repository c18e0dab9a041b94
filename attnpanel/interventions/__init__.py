"""Writing a head inside a running model: switched off (ablate), taken from another input
(patch), probed for gradients, and the methods that run the model many times on them
(importance, patching effects), all on the one watcher of :mod:`attnpanel.watching`."""

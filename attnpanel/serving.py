"""What a served explorer shares between sessions, and what a session gives back.

A Panel server runs an app file once per session (each browser tab). The trace is
immutable, so it is computed or loaded once per server process and shared by every
session (:func:`shared_trace`, on ``pn.state.as_cached``), with its arrays made read-only
so that no session can change what another one sees. A session holds its explorer (its
state and its Bokeh document); when it closes, :func:`release_on_close` collects it and
hands the freed memory back to the operating system. :func:`die_with_parent` makes the
workers of ``attnpanel serve --num-procs N`` (and of ``panel serve --num-procs N --setup
apps/workers.py``) stop with the server that forked them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import signal
import sys
from collections.abc import Callable

import numpy as np
import panel as pn
import xarray as xr


def freeze(capture: xr.Dataset | xr.DataTree) -> xr.Dataset | xr.DataTree:
    """``capture`` with every in-memory array read-only (a write raises); returned as is."""
    datasets = (
        [node.dataset for node in capture.subtree]
        if isinstance(capture, xr.DataTree)
        else [capture]
    )
    for ds in datasets:
        for var in ds.variables.values():
            if isinstance(var.data, np.ndarray):
                var.data.flags.writeable = False
    return capture


def shared_trace(key: str, build: Callable[[], xr.Dataset | xr.DataTree]):
    """The capture ``build()`` makes, made once per server process and shared read-only.

    Outside a server (a script, a notebook) it is built each time, as any call would be.
    """
    return pn.state.as_cached(f"attnpanel:{key}", lambda: freeze(build()))


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another platform or C library); looked up once
    (``find_library`` runs ``ldconfig``)."""
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return ctypes.CDLL(libc_name).malloc_trim if libc_name else None
    except (OSError, AttributeError):
        return None


def _trim_memory() -> None:
    """Collect garbage and return freed heap pages to the system (glibc keeps them)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_on_close() -> None:
    """When this session closes, collect what it held and give the memory back."""
    if pn.state.curdoc is None or pn.state.curdoc.session_context is None:
        return
    from tornado.ioloop import IOLoop

    # a moment later: while the callback runs, the session's document is still referenced
    pn.state.on_session_destroyed(lambda _context: IOLoop.current().call_later(1.0, _trim_memory))


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when the process that forked it exits.

    For the workers that ``--num-procs`` forks: Bokeh's parent process does not stop them
    when it is stopped. Linux only (``prctl(PR_SET_PDEATHSIG)``); returns whether it was set.
    A worker whose parent is already gone stops at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc_name = ctypes.util.find_library("c")
    try:
        prctl = ctypes.CDLL(libc_name, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent exited before the request took effect
        os.kill(os.getpid(), sig)
    return True


def workers_die_with_parent() -> None:
    """Make every process forked from now on (the server's workers) stop with this one."""
    os.register_at_fork(after_in_child=die_with_parent)

"""What a served explorer shares between sessions, and what a session gives back.

A Panel server runs an app file once per session (each browser tab). The trace is
immutable, so it is computed or loaded once per server process and shared by every
session (:func:`shared_trace`, on ``pn.state.as_cached``), with its arrays made read-only
so that no session can change what another one sees. A session holds its explorer (its
state and its Bokeh document); :func:`release_memory` hands what a session's building and
closing freed back to the operating system. :func:`built_ahead` builds the next
session's explorer on a worker thread while the server is idle, so that a page request
finds it ready. :func:`die_with_parent` makes the workers of ``attnpanel serve
--num-procs N`` (and of ``panel serve --num-procs N --setup apps/workers.py``) stop with
the server that forked them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np
import panel as pn
import xarray as xr
from bokeh.document import Document
from panel.io.state import set_curdoc

log = logging.getLogger(__name__)
T = TypeVar("T")


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


_BUILT: set[str] = set()  # the keys shared() has built (or found) in this process


def shared(key: str, build: Callable[[], T]) -> T:
    """``build()``'s result, made once per process and kept in Panel's cache under ``key``
    (``pn.state.as_cached``); :func:`is_shared` says whether it is there."""
    value = pn.state.as_cached(key, build)
    _BUILT.add(key)
    return value


def is_shared(key: str) -> bool:
    """Whether :func:`shared` has made ``key``'s value in this process (Panel keys its cache
    by ``(key, *keyword arguments)``: ``key in pn.state.cache`` is never true)."""
    return key in _BUILT


def shared_trace(key: str, build: Callable[[], xr.Dataset | xr.DataTree]):
    """The capture ``build()`` makes, made once per server process and shared read-only.

    Outside a server (a script, a notebook) it is built each time, as any call would be.
    """
    served = pn.state.curdoc is not None and pn.state.curdoc.session_context is not None
    return shared(
        f"attnpanel:{key}", lambda: settle(freeze(build())) if served else freeze(build())
    )


def settle(capture):
    """Take what the process holds for good (its modules, the shared capture) out of the
    garbage collector's sight (``gc.freeze``); returns ``capture``.

    For a server process only (a notebook's objects would never be collected): they live as
    long as the process. Every later full collection then scans only
    the sessions' own objects: on the demo with five sessions open, 0.11 s instead of
    0.32 s, for every collection a session's building or closing triggers.
    """
    trim_memory()  # what building it freed (a dense trace's maps, say) goes back
    gc.freeze()
    return capture


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another platform or C library); looked up once
    (``find_library`` runs ``ldconfig``)."""
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return ctypes.CDLL(libc_name).malloc_trim if libc_name else None
    except (OSError, AttributeError):
        return None


def trim_memory(collect: bool = True) -> None:
    """Collect garbage (unless ``collect`` is False) and return freed heap pages to the
    system (glibc keeps them, in each thread's own arena)."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


TRIM_DELAY_S = 5.0  # after the last of a burst of pages loading or sessions closing


class Trimmer:
    """One collection and trim for a burst of sessions opening or closing (a class arriving
    or leaving at once), not one per session: each costs 0.1-0.3 s of CPU."""

    def __init__(self):
        self._timeout = None

    def schedule(self) -> None:
        from tornado.ioloop import IOLoop

        loop = IOLoop.current()
        if self._timeout is not None:
            loop.remove_timeout(self._timeout)
        # later: while the callback runs, the session's document is still referenced
        self._timeout = loop.call_later(TRIM_DELAY_S, self._run)

    def _run(self) -> None:
        self._timeout = None
        trim_memory()


_TRIMMER = Trimmer()


def release_memory() -> None:
    """Collect and give the memory back once this session's page has loaded (serializing
    the page for the browser frees tens of MB that glibc would keep: the demo's first page
    left the server at 869 MiB, 776 after) and when it closes: once for the sessions that
    load or close within :data:`TRIM_DELAY_S` of each other, that long after the last."""
    if pn.state.curdoc is None or pn.state.curdoc.session_context is None:
        return
    pn.state.onload(_TRIMMER.schedule)
    pn.state.on_session_destroyed(lambda session_context: _TRIMMER.schedule())


@contextlib.contextmanager
def outside_sessions():
    """Within it, this thread runs outside every session, as a script does.

    Bokeh's current document is one for the whole process: while the event loop runs any
    session's callback (``bokeh.io.doc.patch_curdoc``), a worker thread sees that session's
    document as ``pn.state.curdoc``. An explorer built on a worker then scheduled its
    redraws on another session's document: when that session closed first, they never
    ran, and the explorer's idle work (its sections below the fold, its maps sent ahead)
    waited for them for good (one page in ten). Panel's current document here is a
    document of no session.
    """
    with set_curdoc(Document()):
        yield


class Ahead(Generic[T]):
    """One object built ahead of time, on a worker thread, for the next caller to take.

    A page request waits for its session to be built (its explorer: sections, readouts,
    Bokeh figures) before the browser gets the page. Built while the server is idle, the
    next session's explorer is ready when the request comes, and the request pays only for
    attaching it to its document.

    Parameters
    ----------
    build : callable
        ``() -> T``; called on the worker thread by :meth:`refill`, or by :meth:`take`
        itself when nothing was built ahead. It must not need a session: on the worker
        it runs outside every one (:func:`outside_sessions`).
    """

    def __init__(self, build: Callable[[], T]):
        self._build = build
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnpanel-ahead")
        self._next: Future | None = None

    def take(self) -> T:
        """What was built ahead (waiting for it if it is being built), else a new build."""
        ahead, self._next = self._next, None
        if ahead is not None:
            try:
                built = ahead.result()
            except Exception:  # noqa: BLE001 - built again below, where the error shows
                log.exception("building the next session ahead failed; building it now")
            else:
                log.info("this session takes what was built ahead for it")
                return built
        return self._build()

    def refill(self) -> None:
        """Start building the next one on the worker thread (unless one is on its way)."""
        if self._next is None:
            self._next = self._worker.submit(self._build_and_trim)

    def _build_and_trim(self) -> T:
        with outside_sessions():
            built = self._build()
        # what building freed, in the worker thread's own heap, goes back; no collection
        # (it would hold the interpreter while a page may be drawing), ctypes lets go of it
        trim_memory(collect=False)
        return built


class LoadingPage:
    """What a page shows at once while what it needs is built (the first page after the
    server starts): a spinner, each step by name with a progress bar, then the page. A
    step that fails says so on the page; the server goes on.

    Parameters
    ----------
    what : str
        What is being built ("the demo").
    steps : list of (str, callable)
        Each step's name and its work, ``() -> object``, run on a worker thread one after
        the other (the event loop stays free: the page keeps drawing the progress).
    page : callable
        ``page(results) -> viewable``: the page itself, from every step's result, built on
        the event loop once the steps are done.
    """

    def __init__(self, what: str, steps: list, page: Callable):
        self.what, self.steps, self.page = what, steps, page
        self.status = pn.pane.Markdown(f"Building {what} ...", margin=(0, 10))
        self.progress = pn.indicators.Progress(max=len(steps), value=0, width=320, margin=(0, 10))
        spinner = pn.indicators.LoadingSpinner(value=True, size=28, margin=(10, 10))
        note = pn.pane.Markdown(
            f"**attnpanel** · the first page after the server starts builds {what} once; "
            "later pages open at once.",
            margin=(0, 10),
        )
        self.layout = pn.Column(
            note, spinner, self.status, self.progress, sizing_mode="stretch_width"
        )

    def servable(self, title: str):
        pn.state.onload(self.build)
        return self.layout.servable(title=title)

    async def build(self) -> None:
        import asyncio

        results = []
        for index, (name, work) in enumerate(self.steps, start=1):
            self.status.object = f"Building {self.what}: {name} ({index} of {len(self.steps)})"
            try:
                results.append(await asyncio.to_thread(work))
            except Exception as error:  # noqa: BLE001 - said on the page; the server goes on
                log.exception("building %s failed", self.what)
                self.status.object = f"Building {self.what} failed at {name}: {error}"
                self.layout[1].value = False  # the spinner stops: nothing more is coming
                return
            self.progress.value = index
        self.layout[:] = [self.page(results)]


def warming() -> bool:
    """Whether this process is a server started with ``--warm`` (``panel serve APP --warm``
    runs the app once as it starts; Panel gives the app its own ``sys.argv``)."""
    return "--warm" in sys.orig_argv


def served_when_built(title: str, what: str, steps: list, page: Callable):
    """Serve ``page(results)`` once every step's shared result is built, with a
    :class:`LoadingPage` meanwhile on the first page that finds one not yet built.

    ``steps`` are ``(name, key, work)``: ``work()`` returns what :func:`shared` keeps under
    ``key`` (building it the first time). A server started with ``--warm`` (:func:`warming`)
    builds them as it starts, and every page, the first included, arrives with ``page``
    in its first document; so does every page after the first built them.
    """
    if warming() or all(is_shared(key) for _, key, _ in steps):
        return page([work() for _, _, work in steps]).servable(title=title)
    loading = LoadingPage(what, [(name, work) for name, _, work in steps], page)
    return loading.servable(title=title)


def built_ahead(key: str, build: Callable[[], T]) -> T:
    """This session's ``build()``, taken from the one built ahead for it, and the next one
    started once this session's page has loaded.

    In a server, the objects are kept per process under ``key`` (:class:`Ahead`); the next
    one is built after this page is drawn, so that it does not compete with it for the
    CPU. Outside a server (a script, a notebook) this is ``build()``.
    """
    doc = pn.state.curdoc
    if doc is None or doc.session_context is None:
        return build()
    ahead = pn.state.as_cached(f"attnpanel:ahead:{key}", lambda: Ahead(build))
    built = ahead.take()
    pn.state.onload(ahead.refill)
    return built


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


def worker_started() -> None:
    """In a forked worker: stop with the parent, and say so on the server's log."""
    stops = die_with_parent()
    said = "stops with its server" if stops else "cannot ask to stop with its server"
    # one write of the whole line: print() writes the text and its newline apart, and two
    # workers' lines on the server's log then ran into one
    sys.stderr.write(f"attnpanel worker {os.getpid()}: {said}\n")
    sys.stderr.flush()


def workers_die_with_parent() -> None:
    """Make every process forked from now on (the server's workers) stop with this one."""
    os.register_at_fork(after_in_child=worker_started)


def skip_document_validation() -> None:
    """Stop Bokeh from re-checking every session's document (``BOKEH_VALIDATE_DOC``).

    Bokeh walks all of a new session's models to validate them (about 0.05-0.2 s of server
    CPU a session on the demo). The explorer's page is the same for every session, and the
    test suite validates it once (``tests/test_serving.py``), so a server skips it.
    """
    from bokeh.settings import settings

    settings.perform_document_validation.set_value(False)

"""What served sessions share: one read-only trace per process, never written by a session."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import panel as pn
import pytest
import torch
import xarray as xr
from bokeh.document import Document
from served_app import ROOT, free_port
from session_doc import SessionDocument
from test_explorer import make_trace
from zoo import build_torch_transformer

import attnpanel
from attnpanel.app import serving
from attnpanel.app.explore import explore
from attnpanel.app.explorer import AttentionExplorer


def digest(ds) -> str:
    """A hash of every array of a trace, to see that nothing changed it."""
    found = hashlib.sha256()
    for name in sorted(ds.variables):
        found.update(name.encode())
        found.update(np.ascontiguousarray(ds[name].values).tobytes())
    return found.hexdigest()


def read_only(var: xr.Variable) -> bool:
    """Nothing written through ``var.data`` reaches the stored values: the array is
    read-only, or (an index coordinate under pandas 3) every read hands out a fresh copy
    of an immutable pandas Index."""
    if not var.data.flags.writeable:
        return True
    return isinstance(var, xr.IndexVariable) and var.data is not var.data


def test_freeze_makes_every_array_read_only():
    ds = serving.freeze(make_trace(n_batch=1))
    for name, var in ds.variables.items():
        assert read_only(var), name
    labels = ds["series"].values.copy()
    ds.variables["series"].data[0] = "changed"
    assert (ds["series"].values == labels).all()
    with pytest.raises(ValueError, match="read-only"):
        ds["weights"].values[0, 0, 0, 0] = 2.0


def test_freeze_reaches_every_group_of_a_data_tree():
    model, args, kwargs = build_torch_transformer()
    tree = serving.freeze(attnpanel.capture(model, *args, **kwargs))
    for node in tree.subtree:
        for var in node.dataset.variables.values():
            assert read_only(var)


def test_shared_trace_is_built_once_per_process():
    built = []

    def build():
        built.append(1)
        return make_trace(n_batch=1)

    key = f"test-{id(built)}"
    try:
        first = serving.shared_trace(key, build)
        second = serving.shared_trace(key, build)
    finally:
        pn.state.clear_caches()
    assert first is second and built == [1]
    assert not first["weights"].values.flags.writeable


def test_an_explorer_on_a_shared_trace_never_writes_to_it():
    """Every control of a session, on a frozen trace: a write would raise, and the arrays
    every other session reads are unchanged."""
    ds = serving.freeze(make_trace())
    before = digest(ds)
    explorer = AttentionExplorer(ds)
    explorer.__panel__().get_root(Document())
    for change in (
        dict(mask="causal"),
        dict(stage="scaled", head=3),
        dict(stage="masked", head="mean"),
        dict(sample=1, query=17),
        dict(enabled_heads=[0, 2, 5], side_by_side=True),
        dict(show_head_average=True, colormap="viridis"),
    ):
        explorer.param.update(**change)
        assert explorer.last_error == "", (change, explorer.last_error)
    assert digest(ds) == before


def test_sessions_on_one_capture_with_several_layers_do_not_see_each_other():
    torch.manual_seed(0)
    model, args, kwargs = build_torch_transformer()
    tree = serving.freeze(attnpanel.capture(model, *args, **kwargs))
    first, second = explore(tree), explore(tree)
    for session in (first, second):
        session.__panel__()
    first.layer = first.param.layer.objects[-1]  # a cross-attention layer
    assert second.layer == second.param.layer.objects[0]
    assert second.explorer.trace.sizes["query"] == 10  # still the encoder's 10 x 10
    assert first.explorer.trace.sizes["query"] == 7


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stops_with_parent(cmd: list[str], timeout: float = 180.0) -> None:
    """Start ``cmd`` (a server forking 2 workers), wait until both say they stop with their
    server, SIGTERM the parent only, and assert that every worker stops."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
        deadline = time.monotonic() + timeout
        said = []
        while len(said) < 2:  # the workers' setup can take seconds (a fresh checkout)
            assert proc.poll() is None, f"{cmd} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{cmd}: no worker set up in {timeout} s"
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            said += ["stops"] * line.count("stops with its server")
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [w for w in workers if _alive(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
        assert left == [], f"workers {left} outlived their server"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_panel_serve_workers_stop_with_the_server():
    """``panel serve --num-procs 2 --setup apps/workers.py``: stopping the server (SIGTERM
    to the parent only) stops its forked workers."""
    port = free_port()
    _stops_with_parent(
        [
            sys.executable,
            "-m",
            "panel",
            "serve",
            str(ROOT / "apps" / "main.py"),
            "--port",
            str(port),
            "--address",
            "127.0.0.1",
            "--num-procs",
            "2",
            "--setup",
            str(ROOT / "apps" / "workers.py"),
        ]
    )


@pytest.mark.slow
def test_attnpanel_serve_workers_stop_with_the_server():
    """``attnpanel serve --num-procs 2`` (the demo computed once, before the fork)."""
    port = free_port()
    _stops_with_parent(
        [
            sys.executable,
            "-m",
            "attnpanel",
            "serve",
            "--num-procs",
            "2",
            "--port",
            str(port),
            "--address",
            "127.0.0.1",
        ]
    )


def test_the_explorer_page_passes_bokehs_validation():
    """Servers skip Bokeh's per-session document validation (serving.skip_document_validation):
    the page, every section shown, is validated here instead; no error may be found."""
    from bokeh.core.validation.check import check_integrity

    explorer = AttentionExplorer(
        make_trace(), show_projection=True, show_merge=True, show_head_average=True
    )
    doc = Document()
    doc.add_root(explorer.__panel__().get_root(doc))
    issues = check_integrity(doc.roots)
    assert issues.error == [] and issues.warning == [], (issues.error, issues.warning)


def test_ahead_gives_what_its_worker_built_then_builds_on_the_callers_thread():
    """``serving.Ahead``: after ``refill`` the next ``take`` gets the object built on the
    worker thread; with nothing built ahead, ``take`` builds on its caller's thread."""
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return object()

    ahead = serving.Ahead(build)
    ahead.refill()
    ahead.refill()  # one on its way already: not a second
    first = ahead.take()
    assert built_on == [built_on[0]] and built_on[0].startswith("attnpanel-ahead")
    second = ahead.take()  # nothing built ahead: built here
    assert built_on[1] == threading.current_thread().name
    assert first is not second


def test_ahead_builds_again_where_the_worker_failed(caplog):
    """A build that failed on the worker is logged, and the taker builds it itself: an
    error it raises again then reaches the session, as without building ahead."""
    calls = []

    def build():
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise MemoryError("no room for the next session")
        return "explorer"

    ahead = serving.Ahead(build)
    ahead.refill()
    with caplog.at_level("ERROR", logger="attnpanel.app.serving"):
        assert ahead.take() == "explorer"
    assert "building the next session ahead failed" in caplog.text
    assert "no room for the next session" in caplog.text
    assert calls[1] == threading.current_thread().name


def test_an_explorer_built_ahead_while_another_session_runs_belongs_to_no_session():
    """Bokeh's current document is one for the whole process: while the event loop runs a
    session's callback (``patch_curdoc``, as Bokeh wraps every one), a worker thread saw
    that session as ``pn.state.curdoc``. The explorer built ahead there scheduled its
    redraws on the other session's document, and once that session had closed, its idle
    work (the sections below the fold) never ran: the page never filled in (one page in
    ten, ``test_browser_url``). The worker builds outside every session."""
    from bokeh.io.doc import patch_curdoc

    from attnpanel.app.documents import served_doc

    other = SessionDocument(arguments={"head": [b"5"]})
    trace = make_trace()
    seen = []

    def build():
        seen.append((pn.state.curdoc, served_doc()))
        explorer = AttentionExplorer.built(trace)
        explorer.param.update(head=1, mask="causal")  # a change while it is being built
        return explorer

    ahead = serving.Ahead(build)
    with patch_curdoc(other):  # another session's callback runs on the event loop
        assert pn.state.curdoc is other  # what any thread saw before
        ahead.refill()
        explorer = ahead.take()
    [(curdoc, served)] = seen
    assert served is None and curdoc is not other and curdoc.session_context is None
    assert other.loop.empty()  # nothing of it went to the other session
    assert np.isnan(explorer.drawn()[0, 1:]).all()  # the change was drawn: causal


def test_an_explorer_built_ahead_is_the_explorer_of_its_own_state():
    """``AttentionExplorer.built`` lays the page out without a session (a worker thread
    builds it); outside a server ``built_ahead`` is a plain build; changes then redraw."""
    trace = make_trace()
    explorer = serving.built_ahead("test", lambda: AttentionExplorer.built(trace))
    assert explorer.lay_out() is explorer.__panel__()
    before = explorer.drawn().copy()
    explorer.param.update(head=1, mask="causal")
    after = explorer.drawn()
    assert not np.array_equal(np.isnan(before), np.isnan(after))
    assert np.isnan(after[0, 1:]).all()  # causal: query 0 sees key 0 only


def run_alone(coroutine) -> None:
    """Run ``coroutine`` on an event loop of its own thread (a browser test of this process
    may have left one running in this thread)."""
    import asyncio
    import threading

    worker = threading.Thread(target=asyncio.run, args=(coroutine,))
    worker.start()
    worker.join()


def test_a_loading_page_shows_each_step_then_the_page_or_what_failed():
    import panel as pn

    from attnpanel.app.serving import LoadingPage

    seen = []
    steps = [("the first part", lambda: 2), ("the second part", lambda: 3)]
    page = LoadingPage("the thing", steps, lambda found: pn.pane.Markdown(f"made of {found}"))
    page.status.param.watch(lambda e: seen.append(e.new), "object")
    run_alone(page.build())
    assert seen == [
        "Building the thing: the first part (1 of 2)",
        "Building the thing: the second part (2 of 2)",
    ]
    assert page.progress.value == 2
    assert [p.object for p in page.layout] == ["made of [2, 3]"]
    broken = LoadingPage("the thing", [("a part", lambda: 1 / 0)], lambda found: None)
    run_alone(broken.build())
    assert broken.status.object == "Building the thing failed at a part: division by zero"
    assert broken.layout[1].value is False  # the spinner stopped


def test_pages_loading_or_closing_together_give_memory_back_once_after_the_last(monkeypatch):
    """serving.release_memory: a burst of sessions (a class arriving at once) costs one
    collection and trim, TRIM_DELAY_S after the last of them."""
    from tornado.ioloop import IOLoop

    class Loop:  # the session's loop: its timeouts, run by the test when they are due
        def __init__(self):
            self.timeouts = []

        def call_later(self, delay, callback):
            self.timeouts.append((delay, callback))
            return callback

        def remove_timeout(self, handle):
            self.timeouts = [t for t in self.timeouts if t[1] is not handle]

    loop, trims = Loop(), []
    monkeypatch.setattr(IOLoop, "current", staticmethod(lambda: loop))
    monkeypatch.setattr(serving, "trim_memory", lambda collect=True: trims.append(collect))
    trimmer = serving.Trimmer()
    for _ in range(5):  # five pages load within the delay of each other
        trimmer.schedule()
    assert trims == [] and len(loop.timeouts) == 1  # one pending, after the last
    [(delay, run)] = loop.timeouts
    assert delay == serving.TRIM_DELAY_S
    run()
    assert trims == [True]  # one collection and trim for the five


def test_a_page_opens_directly_when_warm_or_built_and_shows_its_building_otherwise(monkeypatch):
    """``served_when_built`` (apps/main.py, apps/text.py): the first page of a cold server
    is the loading page, and builds nothing itself; a server started with ``--warm`` builds
    the steps as it starts and serves the page; once built, every page is the page."""
    import uuid

    keys = [f"test:{uuid.uuid4()}" for _ in range(2)]
    calls = []

    def step(key, value):
        return lambda: serving.shared(key, lambda: calls.append(value) or value)

    steps = [("the first", keys[0], step(keys[0], 2)), ("the second", keys[1], step(keys[1], 3))]

    def page(found):
        return pn.pane.Markdown(f"made of {found}")

    loaded = []  # (outside a server Panel runs an onload callback at once)
    monkeypatch.setattr(pn.state, "onload", lambda callback, **_: loaded.append(callback))
    monkeypatch.setattr(sys, "orig_argv", ["panel", "serve", "app.py"])
    cold = serving.served_when_built("title", "the thing", steps, page)
    assert "Building the thing" in cold[2].object and calls == []
    assert len(loaded) == 1  # the building starts once the loading page has loaded
    monkeypatch.setattr(sys, "orig_argv", ["panel", "serve", "app.py", "--warm"])
    assert serving.served_when_built("title", "the thing", steps, page).object == "made of [2, 3]"
    assert calls == [2, 3]
    monkeypatch.setattr(sys, "orig_argv", ["panel", "serve", "app.py"])
    assert serving.served_when_built("title", "the thing", steps, page).object == "made of [2, 3]"
    assert calls == [2, 3]  # built once
